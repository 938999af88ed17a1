"""The short summary table, shared by the HTML report and the command line."""
from __future__ import annotations

from zinf_compile.plan import Plan
from zinf_compile.report.common import counts_text, groups
from zinf_compile.report.lanes import LANES
from zinf_compile.report.units import format_bytes, format_seconds


def summary_rows(plan: Plan) -> list[tuple[str, str]]:
    """(label, value) rows in human units: memory, traffic, time and action counts."""
    rows = [
        ("device", plan.device),
        ("profile", plan.profile),
        ("tier", plan.tier),
        ("graphs", ", ".join(plan.graphs)),
        ("steps", str(len(plan.steps))),
        ("budget", format_bytes(plan.budget)),
        ("peak before", format_bytes(plan.peak_before)),
        ("peak after", format_bytes(plan.peak_after)),
        ("lower bound", format_bytes(plan.lower_bound)),
    ]
    for tier in sorted(plan.bytes_moved):
        rows.append((f"bytes moved ({tier})", format_bytes(plan.bytes_moved[tier])))
    rows += [
        ("predicted compute", format_seconds(plan.predicted_compute_s)),
        ("predicted stall", format_seconds(plan.predicted_stall_s)),
        ("actions", counts_text(plan, LANES)),
        ("offloaded tensors", str(len({g.tensor for g in groups(plan)}))),
    ]
    return rows
