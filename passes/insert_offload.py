"""Insert offload / prefetch / wait nodes where the plan anchors them.

For a gap inside one graph: `h = offload(x)` after the step that last reads x before the gap,
`h2 = prefetch(h)` before the prefetch step, `y = wait(h2)` before the next use, and the uses from
there on read y. For a tensor saved for backward, the forward returns the handle instead of the
tensor and the backward placeholder receives it: the forward frees the activation, the backward
brings it back.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx

from zinf_compile import ir
from zinf_compile.analysis.sizes import dense_dim_order
from zinf_compile.ir import MoveMeta, output_node
from zinf_compile.runtime import ops

from .base import Graphs, Pass, PassContext

aten = torch.ops.aten


def _fake(fn, *args):
    with ir.fake_mode_of(*args):
        return fn(*args)


@dataclass(frozen=True)
class InsertOffloads(Pass):
    name: ClassVar[str] = "insert-offloads"

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        gaps = {(g.buffer, g.after, g.before): g for g in (*ctx.facts.gaps, *ctx.facts.rebuild_gaps)}
        groups: dict[int, dict[str, object]] = {}
        for a in ctx.plan.moves():
            groups.setdefault(a.group, {})[a.kind] = a
        # an alias read after a gap -> what stands for it since (the wait, or its view of the wait)
        rebuilt: dict[fx.Node, fx.Node] = {}
        came_back: dict[int, fx.Node] = {}  # buffer -> the wait that brought it back last
        # before any placeholder becomes a handle; only the moved gaps' views (every gap's would
        # be gaps x views, 1.3 s on a 128-layer GPT)
        layout = {r: _layout(r) for acts in groups.values() if "offload" in acts
                  for r in gaps[(acts["offload"].tensor, acts["offload"].step, acts["wait"].step)].views}
        pairs = []  # (backward placeholder, the forward output saved into it), as partitioned
        if "forward" in graphs:
            from zinf_compile.analysis.graphs import graph_specs

            pairs = list(graph_specs(graphs, ctx.num_fwd_outputs)[1].saved.items())
        changes = []
        for group in sorted(groups, key=lambda k: (groups[k]["offload"].tensor, groups[k]["offload"].step)):
            acts = groups[group]
            off, pre, wai = acts["offload"], acts["prefetch"], acts["wait"]
            gap = gaps[(off.tensor, off.step, wai.step)]
            # after an earlier move of the buffer in this graph, its wait stands for the storage
            # (the facts' source may be an alias that move already sent away); a node that move
            # replaced reads what stands for it now
            back = came_back.get(gap.buffer)
            source = back if back is not None and back.graph is gap.source.graph else rebuilt.get(gap.source, gap.source)
            originals = list(gap.views)
            if not originals:
                alone = rebuilt.get(gap.target, gap.target)
                if _layout(alone) != _layout(source):  # the wait has the source's shape: a view of it
                    originals, layout[gap.target] = [gap.target], _layout(alone)
            views = [rebuilt.get(r, r) for r in originals]
            target = views[0] if views else rebuilt.get(gap.target, gap.target)
            val = (source if views else target).meta["val"]
            layouts = [layout[r] for r in originals]
            keys = {n: _storage_key(n) for n in (*views, target)}  # before placeholders become handles
            order = list(gap.dim_order) if source is gap.source else dense_dim_order(source.meta["val"])
            device = val.device

            def meta(kind, group=group, gap=gap, off=off):
                return MoveMeta(kind, group, gap.buffer, off.tier)

            with source.graph.inserting_after(ctx.step_node(off.step)):
                h = source.graph.call_function(ops.offload, (source, ctx.engine_key, order))
            h.meta["val"] = _fake(ops.offload, source.meta["val"], ctx.engine_key, order)
            ir.mark(h, meta("offload"))

            graph = target.graph
            if source.graph is not graph:
                # saved for backward: the forward returns the handle in place of every alias of the
                # storage it saved, and each backward placeholder of them receives the handle
                aliases = {n for n in ctx.facts.buffers[gap.buffer].aliases if n.graph is source.graph}
                aliases |= {rebuilt[n] for n in aliases if n in rebuilt} | {source}
                out = output_node(source.graph)
                out.args = fx.node.map_arg(out.args, lambda n: h if n in aliases else n)
                for r in (p for p, fw_node in pairs if fw_node in aliases):
                    r.meta["val"] = h.meta["val"]
                    ir.mark(r, meta("handle"))
                incoming = target
            else:
                incoming = h
            with graph.inserting_before(_before(ctx.step_node(pre.step))):
                h2 = graph.call_function(ops.prefetch, (incoming, ctx.engine_key, device))
            h2.meta["val"] = _fake(ops.prefetch, incoming.meta["val"], ctx.engine_key, device)
            ir.mark(h2, meta("prefetch"))
            with graph.inserting_before(_before(ctx.step_node(wai.step))):
                y = graph.call_function(ops.wait, (h2, ctx.engine_key, val.dtype, device, order))
            y.meta["val"] = _fake(ops.wait, h2.meta["val"], ctx.engine_key, val.dtype, device, order)
            ir.mark(y, meta("wait"))
            later = ctx.facts.step_of
            position: dict[fx.Node, int] = {}

            def after_wait(user: fx.Node) -> bool:
                """A node the plan's facts do not know (a recompute's, made since) stands after
                the wait in the graph's order."""
                if not position:
                    position.update((n, i) for i, n in enumerate(graph.nodes))
                return position.get(user, -1) > position[y]

            def redirect(old: fx.Node, new: fx.Node) -> None:
                """Every use of `old` after the gap reads `new` (the output too: what the forward
                saves is the tensor that came back; in backward: every use); views made of it
                after the gap get values on the new storage (the analysis reads storages from them)."""
                moved = []
                for user in list(old.users):
                    if user in (h, h2, y, new):
                        continue
                    step = later.get(user)
                    if step is None and user.op == "call_function" and user.graph is graph:
                        step = wai.step if after_wait(user) else -1
                    if source.graph is not graph or (step if step is not None else -1) >= wai.step \
                            or user.op == "output":
                        user.replace_input_with(old, new)
                        moved.append(user)
                _repropagate(moved, keys.get(old))

            if views:
                # each alias read after the gap: the same sizes, strides and offset on the new storage
                at = y
                for r, orig, lay in zip(views, originals, layouts):
                    args = (y, *lay)
                    with graph.inserting_after(at):
                        v = graph.call_function(aten.as_strided.default, args)
                    v.meta["val"] = _fake(aten.as_strided.default, y.meta["val"], *args[1:])
                    redirect(r, v)
                    rebuilt[r] = rebuilt[orig] = v
                    at = v
            else:
                redirect(target, y)
                rebuilt[gap.target] = rebuilt[target] = y
            came_back[gap.buffer] = y
            ctx.inserted[group] = {"offload": h, "prefetch": h2, "wait": y}
            changes.append(f"{source.name}: offload after step {off.step}, prefetch before {pre.step}, "
                           f"wait before {wai.step} ({off.tier}, {off.nbytes} bytes"
                           + (f"; {len(views)} views rebuilt)" if views else ")"))
        n = len(changes)
        return self.report(changes, offload=n, prefetch=n, wait=n)



def _before(anchor: fx.Node) -> fx.Node:
    """Where "right before step s" is: before the chain a recompute put before s (it may read
    what the wait brings back)."""
    while isinstance(ir.meta(anchor.prev), ir.RecomputeMeta):
        anchor = anchor.prev
    return anchor


def _layout(n: fx.Node) -> tuple:
    v = n.meta["val"]
    return list(v.shape), list(v.stride()), v.storage_offset()


def _storage_key(n: fx.Node):
    from torch.multiprocessing.reductions import StorageWeakRef

    val = n.meta.get("val")
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def _repropagate(nodes: list[fx.Node], old) -> None:
    """Recompute the fake value of each node in `nodes` that was a view of the old storage (now
    made from the new one), and of the views made of it in turn."""
    todo = list(nodes)
    seen = set()
    while todo:
        n = todo.pop()
        key = _storage_key(n) if n.op == "call_function" and old is not None else None
        if n in seen or key is None or not key == old:
            continue
        seen.add(n)
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: a.meta["val"])
        with ir.fake_mode_of(*[a.meta.get("val") for a in n.all_input_nodes]):
            n.meta["val"] = n.target(*args, **kwargs)
        todo.extend(n.users)
