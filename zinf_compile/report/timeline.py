"""The memory timeline: device bytes per step, before and after the plan."""
from __future__ import annotations

import numpy as np

from zinf_compile.plan import Plan
from zinf_compile.report.common import (
    AFTER_COLOR,
    BEFORE_COLOR,
    BUDGET_COLOR,
    LOWER_BOUND_COLOR,
)
from zinf_compile.report.figure import (
    empty_note,
    new_figure,
    outside_legend,
    phase_bands,
    save,
    step_axis,
)
from zinf_compile.report.units import byte_unit, format_bytes


def draw_timeline(plan: Plan, path: str) -> str:
    """Write a PNG of memory over the step index, before and after the plan. Returns `path`."""
    fig = new_figure(12, 4.8)
    ax = fig.add_subplot()
    before = np.asarray(plan.timeline_before, dtype=float)
    after = np.asarray(plan.timeline_after, dtype=float)
    top = max(plan.peak_before, plan.peak_after, plan.budget, plan.lower_bound, 1,
              *(float(a.max()) for a in (before, after) if a.size))
    unit, scale = byte_unit(top)

    if before.size:
        edges = np.arange(before.size + 1) - 0.5
        ax.stairs(before / scale, edges, fill=True, color=BEFORE_COLOR, alpha=0.2, lw=0)
        ax.stairs(before / scale, edges, color=BEFORE_COLOR, lw=1.0,
                  label=f"before plan (peak {format_bytes(plan.peak_before)})")
    if after.size:
        edges = np.arange(after.size + 1) - 0.5
        ax.stairs(after / scale, edges, color=AFTER_COLOR, lw=1.6,
                  label=f"after plan (peak {format_bytes(plan.peak_after)})")
        i = int(after.argmax())
        ax.plot([i], [after[i] / scale], marker="v", color=AFTER_COLOR, ms=7, ls="none",
                label=f"peak after, step {i}")
    ax.axhline(plan.budget / scale, color=BUDGET_COLOR, ls="--", lw=1.4,
               label=f"budget {format_bytes(plan.budget)}")
    ax.axhline(plan.lower_bound / scale, color=LOWER_BOUND_COLOR, ls=":", lw=1.6,
               label=f"lower bound {format_bytes(plan.lower_bound)}")

    n = max(len(plan.steps), before.size, after.size)
    ax.set_xlim(-0.5, max(n, 1) - 0.5)
    ax.set_ylim(0, top * 1.08 / scale)
    ax.set_xlabel("step")
    ax.set_ylabel(f"device memory ({unit})")
    ax.grid(True, alpha=0.3)
    step_axis(ax)
    phase_bands(ax, plan, label=True)
    if n == 0:
        empty_note(ax, "the plan has no steps")
    outside_legend(ax)
    fig.suptitle(
        f"device memory: peak {format_bytes(plan.peak_before)} → {format_bytes(plan.peak_after)}"
        f"   (budget {format_bytes(plan.budget)}, {plan.device}, offload to {plan.tier})"
    )
    return save(fig, path)
