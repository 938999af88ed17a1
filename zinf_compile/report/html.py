"""The HTML report: one self-contained file with the pictures, the summary and the tensors."""
from __future__ import annotations

import base64
import os
import re
from html import escape

from zinf_compile.plan import Plan
from zinf_compile.report.common import Group, ParamUse, groups, param_spans, param_uses
from zinf_compile.report.graph import render_svg, write_dot
from zinf_compile.report.lanes import draw_lanes
from zinf_compile.report.summary import summary_rows
from zinf_compile.report.timeline import draw_timeline
from zinf_compile.report.units import format_bytes

MAX_TENSOR_ROWS = 200
MAX_DOT_CHARS = 200_000  # DOT source shown when there is no SVG

_STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", Helvetica, Arial, sans-serif;
       margin: 2em auto; max-width: 1400px; padding: 0 1em; color: #222; }
h1 { margin-bottom: 0.2em; } .sub { color: #666; margin-top: 0; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 14px; }
th, td { border: 1px solid #ddd; padding: 3px 10px; text-align: left; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.summary th { width: 12em; }
img { max-width: 100%; border: 1px solid #eee; }
.graph { overflow: auto; max-height: 90vh; border: 1px solid #eee; }
pre { background: #f8f8f8; padding: 0.5em; overflow: auto; max-height: 40em; font-size: 12px; }
.more { color: #666; font-style: italic; }
"""


def write_report(plan: Plan, out_dir: str, title: str = "zinf plan") -> dict[str, str]:
    """Write timeline.png, lanes.png, graph.dot (+ graph.svg) and report.html into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    files = {
        "timeline": draw_timeline(plan, os.path.join(out_dir, "timeline.png")),
        "lanes": draw_lanes(plan, os.path.join(out_dir, "lanes.png")),
        "dot": write_dot(plan, os.path.join(out_dir, "graph.dot")),
    }
    svg = render_svg(files["dot"], os.path.join(out_dir, "graph.svg"))
    if svg:
        files["svg"] = svg
    html_path = os.path.join(out_dir, "report.html")
    with open(html_path, "w", encoding="utf-8") as f:
        f.write(render_html(plan, files, title))
    files["html"] = html_path
    return files


def render_html(plan: Plan, files: dict[str, str], title: str) -> str:
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{escape(title)}</title><style>{_STYLE}</style></head><body>",
        f"<h1>{escape(title)}</h1>",
        f'<p class="sub">{escape(plan.device)} · profile {escape(plan.profile)} · tier '
        f"{escape(plan.tier)} · {len(plan.steps)} steps · {len(plan.actions)} actions · "
        f"plan version {plan.version}</p>",
        "<h2>Summary</h2>",
        _table([(k, v) for k, v in summary_rows(plan)], cls="summary"),
        "<h2>Notes</h2>",
        _notes(plan),
        "<h2>Memory timeline</h2>",
        _img(files["timeline"], "device memory over the steps, before and after the plan"),
        "<h2>Actions</h2>",
        _img(files["lanes"], "offload, prefetch, wait, gather, release and reduce actions over the steps"),
        "<h2>Offloaded tensors</h2>",
        _tensor_table(plan),
        "<h2>Managed parameters</h2>",
        _param_table(plan),
        "<h2>Graph</h2>",
        _graph(files),
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def _table(rows: list[tuple[str, str]], cls: str) -> str:
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(v)}</td></tr>" for k, v in rows)
    return f'<table class="{cls}">{body}</table>'


def _notes(plan: Plan) -> str:
    if not plan.notes:
        return '<p class="more">no notes</p>'
    return "<ul>" + "".join(f"<li>{escape(n)}</li>" for n in plan.notes) + "</ul>"


def _img(path: str, alt: str) -> str:
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    return f'<img src="data:image/png;base64,{data}" alt="{escape(alt)}">'


def _step_ref(plan: Plan, step: int | None) -> str:
    if step is None:
        return "—"
    if 0 <= step < len(plan.steps):
        return f"{step} ({plan.steps[step].name})"
    return str(step)


def _tensor_table(plan: Plan) -> str:
    tensors = {t.id: t for t in plan.tensors}
    moved: list[Group] = [g for g in groups(plan) if g.offload is not None]
    moved.sort(key=lambda g: (-g.nbytes, g.offload, g.group))
    if not moved:
        return '<p class="more">no tensor is offloaded</p>'
    head = ["tensor", "shape", "dtype", "bytes", "offload after", "prefetch before",
            "wait before", "tier"]
    rows = []
    for g in moved[:MAX_TENSOR_ROWS]:
        t = tensors.get(g.tensor)
        cells = [
            escape(t.name if t else f"#{g.tensor}"),
            escape(t.shape if t else "?"),
            escape(t.dtype if t else "?"),
            f'<td class="num">{escape(format_bytes(g.nbytes))}</td>',
            escape(_step_ref(plan, g.offload)),
            escape(_step_ref(plan, g.prefetch)),
            escape(_step_ref(plan, g.wait)),
            escape(g.tier),
        ]
        rows.append("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>"
                                      for c in cells) + "</tr>")
    more = len(moved) - MAX_TENSOR_ROWS
    if more > 0:
        rows.append(f'<tr><td colspan="{len(head)}" class="more">... {more} more</td></tr>')
    header = "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
    return f"<table>{header}{''.join(rows)}</table>"


def _param_table(plan: Plan) -> str:
    """The managed parameters, largest first: sizes, home tier, and where each is gathered."""
    uses: list[ParamUse] = param_uses(plan)
    if not uses:
        return '<p class="more">no parameter is managed: all stay resident on the device</p>'
    whole: dict[int, int] = {}
    for s in param_spans(plan):
        whole[s.pid] = whole.get(s.pid, 0) + s.release - s.gather + 1
    uses.sort(key=lambda u: (-u.param.nbytes, u.param.pid))
    world = max(u.param.world for u in uses)
    tiers = " and ".join(sorted({u.param.tier for u in uses}))
    n = f'{len(uses)} parameter{"s" if len(uses) != 1 else ""}'
    kept = (f"{n} sharded over {world} ranks, the shards in {tiers}" if world > 1 else
            f"{n} kept in {tiers} (one rank: each shard is the whole parameter)")
    intro = (f"<p>{escape(kept)}. Each is gathered whole from its tier before its uses (again in the "
             "backward; an NVMe shard's read may start steps ahead, a fetch), released after the last, "
             "and its gradient reduced into the shard.</p>")
    fetched = {(s.pid, s.gather): s.fetch for s in param_spans(plan)}
    head = ["parameter", "bytes", "shard", "tier", "gathers per step", "gathered before",
            "fetched from the tier", "whole for (steps)", "gradient reduced after"]
    rows = []
    for u in uses[:MAX_TENSOR_ROWS]:
        p = u.param
        cells = [
            escape(p.name),
            f'<td class="num">{escape(format_bytes(p.nbytes))}</td>',
            f'<td class="num">{escape(format_bytes(p.shard_nbytes))}</td>',
            escape(p.tier),
            f'<td class="num">{len(u.gathers)}</td>',
            escape(", ".join(_step_in_graph(plan, s, +1) for s in u.gathers) or "—"),
            escape(", ".join(_fetched(fetched.get((p.pid, g)), g) for g in u.gathers) or "—"),
            f'<td class="num">{whole.get(p.pid, 0)}</td>',
            escape(", ".join(_step_in_graph(plan, s, -1) for s in u.reduces) or "—"),
        ]
        rows.append("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>"
                                      for c in cells) + "</tr>")
    more = len(uses) - MAX_TENSOR_ROWS
    if more > 0:
        rows.append(f'<tr><td colspan="{len(head)}" class="more">... {more} more</td></tr>')
    header = "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"
    return f'{intro}<table class="params">{header}{"".join(rows)}</table>'


def _fetched(fetch: int | None, gather: int) -> str:
    """When a gather's shard read starts: at the gather, or that many steps ahead."""
    if fetch is None or fetch >= gather:
        return "at the gather"
    return f"{gather - fetch} steps ahead (step {fetch})"


def _step_in_graph(plan: Plan, step: int, near: int) -> str:
    """ "12 mm_3 (forward)": an action's step, named by its neighbour `near` steps away in the same
    graph (a gather's next step is the op it gathers for; a reduce's previous, the gradient's)."""
    if not 0 <= step < len(plan.steps):
        return str(step)
    here = plan.steps[step]
    j = step + near
    op = plan.steps[j] if 0 <= j < len(plan.steps) and plan.steps[j].graph == here.graph else here
    return f"{step} {op.name} ({here.graph})"


def _graph(files: dict[str, str]) -> str:
    svg_path = files.get("svg")
    if svg_path:
        with open(svg_path, encoding="utf-8", errors="replace") as f:
            svg = f.read()
        svg = re.sub(r"<\?xml[^>]*\?>|<!DOCTYPE[^>]*>", "", svg, flags=re.S).strip()
        return f'<div class="graph">{svg}</div>'
    with open(files["dot"], encoding="utf-8") as f:
        dot = f.read()
    cut = len(dot) > MAX_DOT_CHARS
    dot = dot[:MAX_DOT_CHARS] + ("\n... (cut)" if cut else "")
    return (
        '<p class="more">Graphviz (<code>dot</code>) was not found, so the graph is not drawn; '
        "render <code>graph.dot</code> with <code>dot -Tsvg graph.dot -o graph.svg</code>.</p>"
        f"<details><summary>DOT source</summary><pre>{escape(dot)}</pre></details>"
    )
