"""The lane chart: one lane per action kind, the time each tensor is away, the time each managed
parameter is whole on the device, and the compute steps.

Activation lanes (offload/prefetch/wait) are always drawn; the parameter lanes (fetch/gather/
release/reduce) when the plan manages parameters. Adding a lane for a new action kind ("tile") is
one entry in LANES; kinds the plan holds that LANES does not name get a lane of their own after the
listed ones.
"""
from __future__ import annotations

import heapq

import numpy as np
from matplotlib.axes import Axes
from matplotlib.collections import LineCollection, PolyCollection
from matplotlib.figure import Figure
from matplotlib.lines import Line2D

from zinf_compile.plan import Plan
from zinf_compile.report.common import (
    GRAPH_COLORS,
    OTHER_COLOR,
    TIER_COLORS,
    Group,
    ParamSpan,
    counts_text,
    graph_color,
    groups,
    param_actions,
    param_spans,
    param_uses,
)
from zinf_compile.report.figure import (
    empty_note,
    new_figure,
    outside_legend,
    phase_bands,
    save,
    step_axis,
)
from zinf_compile.report.units import format_bytes

# The action lanes, top to bottom: the activations', then the managed parameters'.
ACTIVATION_LANES: list[str] = ["offload", "prefetch", "wait"]
PARAM_LANES: list[str] = ["fetch", "gather", "release", "reduce"]
LANES: list[str] = ACTIVATION_LANES + PARAM_LANES

# Where a tick sits relative to its anchor step: an offload runs after its step, prefetch and wait
# before theirs; a release frees the gathered parameter after its last use. Kinds not named here
# (fetch, gather, reduce: steps of their own) sit on the step.
ANCHOR_OFFSET: dict[str, float] = {"offload": 0.5, "prefetch": -0.5, "wait": -0.5, "release": 0.5,
                                   "recompute": -0.5}

LANE_COLORS: dict[str, str] = {"offload": "#d62728", "prefetch": "#2ca02c", "wait": "#1f77b4",
                               "fetch": "#bcbd22", "gather": "#ff7f0e", "release": "#8c564b",
                               "reduce": "#17becf", "recompute": "#9467bd"}
_SPARE_COLORS = ["#7f7f7f", "#e377c2", "#9467bd", "#ff9896", "#98df8a"]

MAX_AWAY_ROWS = 1000  # past this many tensors away at once, rows fold back onto the first
MAX_BARS = 1000  # compute bars drawn at most; more steps share a bar
NAME_LABELS_UP_TO = 24  # name the tensors on their bars when there are at most this many groups
PARAM_ROWS_UP_TO = 40  # name the managed parameters on their rows when there are at most this many
MAX_PARAM_ROWS = 400  # past this many managed parameters, their rows fold back onto the first
MIN_SPAN_FRACTION = 0.003  # a parameter's whole span is drawn at least this share of the steps wide


def lane_kinds(plan: Plan) -> list[str]:
    present = {a.kind for a in plan.actions}
    kinds = list(ACTIVATION_LANES)
    if plan.params or present & set(PARAM_LANES):
        kinds += PARAM_LANES
    return kinds + sorted(present - set(kinds))


def lane_color(kind: str, index: int) -> str:
    return LANE_COLORS.get(kind, _SPARE_COLORS[index % len(_SPARE_COLORS)])


def draw_lanes(plan: Plan, path: str) -> str:
    """Write a PNG lane chart of the plan's actions over the step index. Returns `path`."""
    return save(lane_figure(plan), path)


def lane_figure(plan: Plan) -> Figure:
    """The lane chart as a figure: axes for the action lanes, the tensors away, the parameters
    whole on the device (when the plan manages any) and the compute steps, top to bottom."""
    kinds = lane_kinds(plan)
    spans = [g for g in groups(plan) if g.start is not None and g.end is not None]
    rows = _pack_rows(spans)
    n_rows = min(max(rows, default=-1) + 1, MAX_AWAY_ROWS)
    away_h = min(3.6, max(1.0, 0.22 * n_rows))
    pspans = param_spans(plan)
    show_params = bool(pspans or plan.params)
    if show_params:
        prows, plabels = _param_rows(plan, pspans)
        n_prows = min(len(param_uses(plan)), MAX_PARAM_ROWS)
        whole_h = min(6.5, max(1.0, 0.16 * n_prows))
    heights = [0.42 * len(kinds), away_h] + ([whole_h] if show_params else []) + [1.7]
    fig = new_figure(13, 1.3 + sum(heights))
    axes = fig.subplots(len(heights), 1, sharex=True, gridspec_kw={"height_ratios": heights})
    n = len(plan.steps)
    _action_lanes(axes[0], plan, kinds)
    _away_rows(axes[1], plan, spans, rows, n_rows, away_h)
    if show_params:
        _whole_rows(axes[2], plan, pspans, prows, plabels, n_prows, whole_h)
    _compute_lane(axes[-1], plan)
    for ax in axes:
        ax.set_xlim(-1.0, max(n, 1))
        phase_bands(ax, plan, label=ax is axes[0])
        step_axis(ax)
    axes[-1].set_xlabel("step")
    title = f"actions: {counts_text(plan, kinds)}   ({len(spans)} groups, tier {plan.tier}"
    if show_params:
        title += f", {len(param_uses(plan))} parameters managed"
    fig.suptitle(title + ")")
    return fig


def _action_lanes(ax: Axes, plan: Plan, kinds: list[str]) -> None:
    steps_by_kind: dict[str, list[float]] = {k: [] for k in kinds}
    for a in plan.actions:
        steps_by_kind[a.kind].append(a.step + ANCHOR_OFFSET.get(a.kind, 0.0))
    for i, kind in enumerate(kinds):
        xs = np.asarray(steps_by_kind[kind], dtype=float)
        if not xs.size:
            continue
        segs = np.stack(
            [np.stack([xs, np.full_like(xs, i - 0.38)], 1),
             np.stack([xs, np.full_like(xs, i + 0.38)], 1)], 1)
        lw = 2.0 if xs.size <= 200 else 0.7
        ax.add_collection(LineCollection(segs, colors=lane_color(kind, i), linewidths=lw,
                                         rasterized=True))
    counts = plan.action_counts()
    ax.set_yticks(range(len(kinds)))
    ax.set_yticklabels([f"{k} ({counts.get(k, 0)})" for k in kinds])
    ax.set_ylim(len(kinds) - 0.5, -0.5)
    ax.grid(True, axis="x", alpha=0.25)
    if not plan.actions:
        empty_note(ax, "the plan has no actions")


def _pack_rows(spans: list[Group]) -> list[int]:
    """Give each span a row so that spans on one row do not overlap (greedy, by start)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start, spans[i].end))
    rows = [0] * len(spans)
    free: list[int] = []  # rows whose last span has ended, smallest first
    busy: list[tuple[int, int]] = []  # (end, row)
    next_row = 0
    for i in order:
        s = spans[i]
        while busy and busy[0][0] < s.start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            row = heapq.heappop(free)
        else:
            row, next_row = next_row, next_row + 1
        rows[i] = row
        heapq.heappush(busy, (s.end, row))
    return rows


def _away_rows(ax: Axes, plan: Plan, spans: list[Group], rows: list[int], n_rows: int,
               height_in: float) -> None:
    """A thin bar per group: offload -> prefetch (away), prefetch -> wait (coming back).

    Rows past MAX_AWAY_ROWS fold back onto the first ones (bars then overlap).
    """
    depth = max(rows, default=-1) + 1
    rows = [r % MAX_AWAY_ROWS for r in rows]
    lw = float(np.clip(height_in * 72 / max(n_rows, 1) * 0.6, 0.25, 7.0))
    away, back, away_c, back_c = [], [], [], []
    for g, row in zip(spans, rows):
        color = TIER_COLORS.get(g.tier, OTHER_COLOR)
        x0 = g.start + 0.5
        mid = g.prefetch - 0.5 if g.prefetch is not None else g.end - 0.5
        x1 = g.end - 0.5
        away.append([(x0, row), (max(mid, x0), row)])
        away_c.append(color)
        if x1 > mid:
            back.append([(mid, row), (x1, row)])
            back_c.append(color)
    ax.add_collection(LineCollection(away, colors=away_c, linewidths=lw, rasterized=True,
                                     capstyle="butt"))
    ax.add_collection(LineCollection(back, colors=back_c, linewidths=lw, alpha=0.35,
                                     rasterized=True, capstyle="butt"))
    if len(spans) <= NAME_LABELS_UP_TO:
        names = {t.id: t.name for t in plan.tensors}
        for g, row in zip(spans, rows):
            ax.text(g.start + 0.7, row - 0.18, f"{names.get(g.tensor, g.tensor)} "
                    f"{format_bytes(g.nbytes)}", fontsize=7, va="bottom", color="#333333",
                    clip_on=True)
    ax.set_ylim(max(n_rows, 1) - 0.4, -0.7)
    ax.set_yticks([])
    ax.set_ylabel("away", rotation=0, ha="right", va="center")
    ax.grid(True, axis="x", alpha=0.25)
    tiers = sorted({g.tier for g in spans})
    handles = [Line2D([], [], color=TIER_COLORS.get(t, OTHER_COLOR), lw=4, label=f"away on {t}")
               for t in tiers]
    if spans:
        handles.append(Line2D([], [], color=TIER_COLORS.get(tiers[0], OTHER_COLOR), lw=4,
                              alpha=0.35, label="prefetch → wait"))
        outside_legend(ax, handles=handles)
    if not spans and plan.actions:
        empty_note(ax, "no activation is offloaded")
    if depth > MAX_AWAY_ROWS:
        ax.text(0.005, 0.98, f"up to {depth} tensors away at once; rows fold onto {MAX_AWAY_ROWS}",
                transform=ax.transAxes, fontsize=8, va="top", color="#555555",
                bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})


def _param_rows(plan: Plan, spans: list[ParamSpan]) -> tuple[list[int], list[str]]:
    """A row per span and the rows' labels: one row per parameter, in order of its first gather
    (its forward and backward gathers side by side), named when there are few. Past
    MAX_PARAM_ROWS parameters, rows fold back onto the first ones."""
    uses = param_uses(plan)
    first = {u.param.pid: (u.gathers[0] if u.gathers else len(plan.steps), u.param.pid) for u in uses}
    order = sorted(first, key=first.get)
    row_of = {pid: i % MAX_PARAM_ROWS for i, pid in enumerate(order)}
    labels = []
    if len(uses) <= PARAM_ROWS_UP_TO:
        by_pid = {u.param.pid: u.param for u in uses}
        labels = [f"{by_pid[pid].name} {format_bytes(by_pid[pid].nbytes)}" for pid in order]
    return [row_of[s.pid] for s in spans], labels


def _whole_rows(ax: Axes, plan: Plan, spans: list[ParamSpan], rows: list[int], labels: list[str],
                n_rows: int, height_in: float) -> None:
    """A bar per gather: from the gather to the release, the parameter whole on the device.
    Colored by the tier its shard lives in; a tick where its gradient is reduced."""
    lw = float(np.clip(height_in * 72 / max(n_rows, 1) * 0.6, 0.25, 7.0))
    # a gathered parameter often lives a few steps: at least a few pixels wide on long timelines
    least = max(0.9, MIN_SPAN_FRACTION * len(plan.steps))
    segs, colors, reads, read_c = [], [], [], []
    for s, row in zip(spans, rows):
        x0, x1 = s.gather - 0.45, max(s.release, s.gather) + 0.45
        mid = (x0 + x1) / 2
        half = max(x1 - x0, least) / 2
        color = TIER_COLORS.get(s.tier, OTHER_COLOR)
        segs.append([(mid - half, row), (mid + half, row)])
        colors.append(color)
        if s.fetch is not None and s.fetch < s.gather:
            reads.append([(s.fetch - 0.45, row), (mid - half, row)])
            read_c.append(color)
    ax.add_collection(LineCollection(segs, colors=colors, linewidths=lw, rasterized=True, capstyle="butt",
                                     zorder=3))
    ax.add_collection(LineCollection(reads, colors=read_c, linewidths=lw, alpha=0.35, rasterized=True,
                                     capstyle="butt", zorder=3))
    tiers = sorted({s.tier for s in spans})
    handles = [Line2D([], [], color=TIER_COLORS.get(t, OTHER_COLOR), lw=4, label=f"whole, shard on {t}")
               for t in tiers]
    if reads:
        handles.append(Line2D([], [], color=read_c[0], lw=4, alpha=0.35, label="fetch → gather"))
    row_of = {s.pid: r for s, r in zip(spans, rows)}
    reduces = [(a.step, row_of[-1 - a.group]) for a in param_actions(plan)
               if a.kind == "reduce" and -1 - a.group in row_of]
    if reduces:
        xs, ys = zip(*reduces)
        ax.scatter(xs, ys, marker="|", s=max(lw, 2.0) ** 2 * 2.5, color=LANE_COLORS["reduce"],
                   linewidths=1.5 if labels else 0.8, zorder=2, rasterized=True)
        handles.append(Line2D([], [], color=LANE_COLORS["reduce"], marker="|", ls="none",
                              markersize=8, label="gradient reduced"))
    if labels:
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7 if len(labels) <= 20 else 5)
    else:
        ax.set_yticks([])
        n = len(param_uses(plan))
        fold = f"; rows fold onto {MAX_PARAM_ROWS}" if n > MAX_PARAM_ROWS else ""
        ax.text(0.005, 0.98, f"{n} parameters, a row each in order of first gather{fold}",
                transform=ax.transAxes, fontsize=8, va="top", color="#555555",
                bbox={"facecolor": "white", "alpha": 0.8, "lw": 0})
    ax.set_ylim(max(n_rows, 1) - 0.4, -0.7)
    ax.set_ylabel("whole", rotation=0, ha="right", va="center")
    ax.grid(True, axis="x", alpha=0.25)
    if handles:
        outside_legend(ax, handles=handles)
    if not spans:
        empty_note(ax, "no parameter is gathered")


def _compute_lane(ax: Axes, plan: Plan) -> None:
    """A bar per step, as tall as its estimated time, colored by graph.

    Past MAX_BARS steps a bar stands for `per` consecutive steps and shows the longest of them, so
    that bars narrower than a pixel do not alias into stripes.
    """
    times = np.array([s.est_time_s for s in plan.steps], dtype=float)
    scale, unit = (1e3, "ms") if times.size and times.max() >= 1e-3 else (1e6, "µs")
    per = max(1, -(-times.size // MAX_BARS))
    if times.size:
        starts = np.arange(0, times.size, per)
        h = np.maximum.reduceat(times, starts) * scale
        x0, x1 = starts - 0.5, np.minimum(starts + per, times.size) - 0.5
        zero = np.zeros_like(h)
        verts = np.stack([np.stack([x0, zero], 1), np.stack([x0, h], 1),
                          np.stack([x1, h], 1), np.stack([x1, zero], 1)], 1)
        colors = [graph_color(plan.steps[i].graph) for i in starts]
        few = starts.size <= 200  # few bars: a white edge between them
        ax.add_collection(PolyCollection(verts, facecolors=colors,
                                         edgecolors="white" if few else "none",
                                         linewidths=0.5 if few else 0, rasterized=True))
        ax.set_ylim(0, max(h.max(), 1e-9) * 1.1)
    graphs = list(dict.fromkeys(s.graph for s in plan.steps))
    handles = [Line2D([], [], color=GRAPH_COLORS.get(g, OTHER_COLOR), lw=6, label=g)
               for g in graphs]
    if handles:
        outside_legend(ax, handles=handles)
    what = "compute" if per == 1 else f"compute, max\nof {per} steps"
    ax.set_ylabel(f"{what}\n({unit})")
    ax.grid(True, axis="y", alpha=0.3)
