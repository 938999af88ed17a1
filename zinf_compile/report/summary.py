"""The short summary table, shared by the HTML report and the command line."""
from __future__ import annotations

from zinf_compile.plan import Plan
from zinf_compile.report.common import counts_text, groups, param_actions, param_uses, pid_of
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
    recs = plan.recomputes()
    if recs:
        rows.append(("recomputed tensors", f"{len(recs)}: {format_bytes(sum(a.nbytes for a in recs))} rebuilt in "
                                           "backward instead of kept"))
    return rows + param_rows(plan) + tile_rows(plan)


def tile_rows(plan: Plan) -> list[tuple[str, str]]:
    """One row per tiled matmul: the op, its axis, the tile count and the weight tile."""
    rows = []
    for t in plan.tiles:
        what = "gradient of " if t.grad else ""
        shape = "x".join(map(str, t.tile_shape))
        rows.append((f"tiled {t.graph} {t.op}", f"{t.target} {what}{t.param}: {t.count} tiles along {t.axis}, "
                                                f"weight tile {shape} ({format_bytes(t.tile_nbytes)})"))
    return rows


def param_rows(plan: Plan) -> list[tuple[str, str]]:
    """The managed parameters in a few rows; none when the plan manages none."""
    uses = param_uses(plan)
    if not uses:
        return []
    tiers = sorted({u.param.tier for u in uses})
    world = max(u.param.world for u in uses)
    whole = sum(u.param.nbytes for u in uses)
    shards = sum(u.param.shard_nbytes for u in uses)
    where = ", ".join(tiers)
    per_rank = f" per rank of {world}" if world > 1 else ""
    rows = [("managed parameters", f"{len(uses)}: {format_bytes(whole)} whole, "
                                   f"{format_bytes(shards)} of shards{per_rank} in {where}")]
    gathered = []
    by_pid = {u.param.pid: u.param for u in uses}
    for tier in tiers:
        mine = [u for u in uses if u.param.tier == tier]
        n = sum(len(u.gathers) for u in mine)
        # a tile's gather reads its share of the shard (action bytes: what it makes on the device)
        acts = [a for a in param_actions(plan) if a.kind == "gather" and pid_of(a) in by_pid
                and by_pid[pid_of(a)].tier == tier]
        made = sum(a.nbytes for a in acts)
        read = sum(a.nbytes * by_pid[pid_of(a)].shard_nbytes // max(1, by_pid[pid_of(a)].nbytes) for a in acts)
        text = f"{n} per step, {format_bytes(read)} read from {tier}"
        if made != read:
            text += f" ({format_bytes(made)} whole after the all-gather)"
        ahead = sum(len(u.fetches) for u in mine)
        if ahead:
            text += f", {ahead} of them fetched ahead"
        gathered.append(text)
    rows.append(("parameter gathers", "; ".join(gathered)))
    reduces = sum(len(u.reduces) for u in uses)
    if reduces:
        rows.append(("gradient reduces", f"{reduces} per step, into the shards in {where}"))
    return rows
