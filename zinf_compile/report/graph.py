"""The annotated graph as Graphviz DOT: steps are nodes, tensors are edges from def to use."""
from __future__ import annotations

import os
import re
import shutil
import subprocess

from zinf_compile.plan import Plan, TensorLife
from zinf_compile.report.common import PARAM_KINDS, Group, graph_color, groups
from zinf_compile.report.units import format_bytes, format_seconds

OFFLOAD_EDGE_COLOR = "#d62728"
ACTION_NODE_COLOR = "#d62728"
PARAM_NODE_COLOR = "#ff7f0e"  # steps with only a managed parameter's actions (gather/release/reduce)
# Past this many nodes, draw straight edges and cap graphviz's network-simplex passes: spline
# routing of the long forward -> backward edges takes dot minutes on a few hundred nodes.
FAST_LAYOUT_NODES = 60
_FAST_LAYOUT = {"splines": "line", "nslimit": "1", "nslimit1": "1", "mclimit": "0.5"}
_CLUSTER_FILL = {"forward": "#eef3fb", "backward": "#fdf1e8", "inference": "#eef8f0"}


def _q(text: object) -> str:
    """A DOT double-quoted string; newlines become DOT's centred line breaks."""
    s = str(text).replace("\\", "\\\\").replace('"', '\\"')
    return '"' + s.replace("\r", "").replace("\n", "\\n") + '"'


def _attrs(**kw: object) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in kw.items() if v is not None) + "]"


def _kept_steps(plan: Plan, max_nodes: int) -> tuple[list[int], str | None]:
    """All steps, or for a big graph those touched by actions and their timeline neighbours."""
    n = len(plan.steps)
    if n <= max_nodes:
        return list(range(n)), None
    touched = {a.step for a in plan.actions if 0 <= a.step < n}
    near = {j for i in touched for j in (i - 1, i, i + 1) if 0 <= j < n}
    if len(near) <= max_nodes:
        kept, what = near, "steps touched by actions and their neighbours"
    else:
        kept, what = touched, "steps touched by actions"
    if len(kept) > max_nodes:
        kept = _biggest_groups_steps(plan, max_nodes)
        what = "steps touched by the actions of the largest offloads"
    note = f"{n} steps (more than {max_nodes}): showing {len(kept)} {what}"
    return sorted(kept), note


def _biggest_groups_steps(plan: Plan, max_nodes: int) -> set[int]:
    kept: set[int] = set()
    for g in sorted(groups(plan), key=lambda g: (-g.nbytes, g.group)):
        add = {s for s in (g.offload, g.prefetch, g.wait) if s is not None} - kept
        if len(kept) + len(add) > max_nodes:
            continue
        kept |= add
    return kept


def _step_node(plan: Plan, i: int, acted: dict[int, list[str]]) -> str:
    s = plan.steps[i]
    label = f"{s.index}: {s.name}\n{s.op}\n{format_seconds(s.est_time_s)}"
    extra = {}
    if i in acted:
        label += "\n" + ", ".join(acted[i])
        param_only = all(k in PARAM_KINDS for k in acted[i])
        extra = {"color": PARAM_NODE_COLOR if param_only else ACTION_NODE_COLOR, "penwidth": "2"}
    return f"s{i} " + _attrs(label=label, tooltip=f"step {s.index}: {s.op}", **extra) + ";"


def _edge_label(g: Group) -> str:
    where = f" @ step {g.offload}" if g.offload is not None else ""
    back = f" / prefetch @ step {g.prefetch}" if g.prefetch is not None else ""
    return f"offload->{g.tier}{where}{back}"


def _tensor_tooltip(t: TensorLife) -> str:
    return f"{t.name} {t.shape} {t.dtype} {format_bytes(t.nbytes)} ({t.role})"


def _labelled_use(uses: list[int], g: Group) -> int | None:
    """The use the group brings the tensor back for: its wait step, else the first use after."""
    if g.wait in uses:
        return g.wait
    after = [u for u in uses if g.prefetch is not None and u >= g.prefetch]
    return min(after) if after else None


def write_dot(plan: Plan, path: str, max_nodes: int = 400) -> str:
    """Write the annotated graph of the plan as DOT. Returns `path`."""
    kept, note = _kept_steps(plan, max_nodes)
    kept_set = set(kept)
    by_tensor: dict[int, list[Group]] = {}
    acted: dict[int, list[str]] = {}
    for g in groups(plan):
        by_tensor.setdefault(g.tensor, []).append(g)
    for a in plan.actions:
        acted.setdefault(a.step, []).append(a.kind)
    acted = {i: sorted(set(k)) for i, k in acted.items()}

    title = f"zinf plan: {plan.device}, budget {format_bytes(plan.budget)}, peak " \
            f"{format_bytes(plan.peak_before)} -> {format_bytes(plan.peak_after)}"
    lines = ["digraph zinf_plan {",
             "  graph " + _attrs(label=title + (f"\n{note}" if note else ""), labelloc="t",
                                 fontname="Helvetica", fontsize="12", rankdir="TB",
                                 **(_FAST_LAYOUT if len(kept) > FAST_LAYOUT_NODES else {})) + ";",
             '  node [shape=box, style="rounded,filled", fillcolor=white, fontname=Helvetica, '
             'fontsize=9];',
             "  edge [color=gray55, arrowsize=0.6, fontname=Helvetica, fontsize=8];"]
    lines += _clusters(plan, kept, acted)
    lines += _inputs_and_edges(plan, kept_set, by_tensor, small=note is None)
    lines += _order_edges(kept)
    lines.append("}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _clusters(plan: Plan, kept: list[int], acted: dict[int, list[str]]) -> list[str]:
    by_graph: dict[str, list[int]] = {}
    for i in kept:
        by_graph.setdefault(plan.steps[i].graph, []).append(i)
    out = []
    for k, (graph, idx) in enumerate(by_graph.items()):
        name = re.sub(r"\W", "_", graph)
        out.append(f"  subgraph cluster_{k}_{name} {{")
        out.append("    graph " + _attrs(label=graph, style="filled", color=graph_color(graph),
                                         fillcolor=_CLUSTER_FILL.get(graph, "#f4f4f4")) + ";")
        out += ["    " + _step_node(plan, i, acted) for i in idx]
        out.append("  }")
    return out


def _inputs_and_edges(plan: Plan, kept: set[int], by_tensor: dict[int, list[Group]],
                      small: bool) -> list[str]:
    """Edges def -> use per tensor; graph inputs get a node when the graph is small or moved."""
    out = []
    for t in plan.tensors:
        moved = by_tensor.get(t.id, [])
        uses = sorted({u for u in t.use_steps if u in kept and u != t.def_step})
        if t.def_step < 0:
            if not (small or moved) or not uses:
                continue
            src = f"in{t.id}"
            out.append(f"  {src} " + _attrs(label=f"{t.name}\n{t.shape} {t.dtype}",
                                            shape="ellipse", style="filled", fillcolor="#f0f0f0",
                                            tooltip=_tensor_tooltip(t)) + ";")
        elif t.def_step in kept:
            src = f"s{t.def_step}"
        else:
            continue
        labels: dict[int, list[str]] = {}
        for g in moved:
            u = _labelled_use(uses, g)
            if u is not None:
                labels.setdefault(u, []).append(_edge_label(g))
        for u in uses:
            attrs: dict[str, object] = {"tooltip": _tensor_tooltip(t)}
            if moved:
                attrs.update(style="dashed", color=OFFLOAD_EDGE_COLOR, fontcolor=OFFLOAD_EDGE_COLOR,
                             penwidth="1.6")
                if u in labels:
                    attrs["label"] = f"{t.name} {format_bytes(t.nbytes)}\n" + "\n".join(labels[u])
            out.append(f"  {src} -> s{u} " + _attrs(**attrs) + ";")
    return out


def _order_edges(kept: list[int]) -> list[str]:
    """Invisible edges from each kept step to the next keep the timeline order top to bottom."""
    return [f"  s{a} -> s{b} [style=invis];" for a, b in zip(kept, kept[1:])]


def render_svg(dot_path: str, svg_path: str) -> str | None:
    """Render DOT to SVG with graphviz's `dot` if it is installed; None if not or if it fails."""
    try:
        exe = shutil.which("dot")
        if not exe:
            return None
        proc = subprocess.run([exe, "-Tsvg", dot_path, "-o", svg_path], capture_output=True,
                              timeout=90, check=False)
        if proc.returncode == 0 and os.path.isfile(svg_path) and os.path.getsize(svg_path):
            return svg_path
    except Exception:  # noqa: BLE001 - a missing picture must never fail the report
        pass
    try:  # no half-written or stale picture beside the report
        os.remove(svg_path)
    except OSError:
        pass
    return None
