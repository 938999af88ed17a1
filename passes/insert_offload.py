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

import torch.fx as fx

from zinf_compile import ir
from zinf_compile.ir import MoveMeta, output_node
from zinf_compile.runtime import ops

from .base import Graphs, Pass, PassContext


def _fake(fn, *args):
    with ir.fake_mode_of(*args):
        return fn(*args)


@dataclass(frozen=True)
class InsertOffloads(Pass):
    name: ClassVar[str] = "insert-offloads"

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        gaps = {(g.buffer, g.after, g.before): g for g in ctx.facts.gaps}
        groups: dict[int, dict[str, object]] = {}
        for a in ctx.plan.moves():
            groups.setdefault(a.group, {})[a.kind] = a
        stand_in: dict[int, fx.Node] = {}
        changes = []
        for group in sorted(groups, key=lambda k: (groups[k]["offload"].tensor, groups[k]["offload"].step)):
            acts = groups[group]
            off, pre, wai = acts["offload"], acts["prefetch"], acts["wait"]
            gap = gaps[(off.tensor, off.step, wai.step)]
            source = stand_in.get(gap.buffer, gap.source)
            target = stand_in.get(gap.buffer, gap.target)
            val = target.meta["val"]
            order = list(gap.dim_order)
            device = val.device

            def meta(kind, group=group, gap=gap, off=off):
                return MoveMeta(kind, group, gap.buffer, off.tier)

            with source.graph.inserting_after(ctx.step_node(off.step)):
                h = source.graph.call_function(ops.offload, (source, ctx.engine_key, order))
            h.meta["val"] = _fake(ops.offload, source.meta["val"], ctx.engine_key, order)
            ir.mark(h, meta("offload"))

            graph = target.graph
            if source.graph is not graph:
                # saved for backward: the forward returns the handle, the backward receives it
                out = output_node(source.graph)
                out.args = fx.node.map_arg(out.args, lambda n: h if n is source else n)
                incoming = target
                incoming.meta["val"] = h.meta["val"]
                ir.mark(incoming, meta("handle"))
            else:
                incoming = h
            with graph.inserting_before(ctx.step_node(pre.step)):
                h2 = graph.call_function(ops.prefetch, (incoming, ctx.engine_key, device))
            h2.meta["val"] = _fake(ops.prefetch, incoming.meta["val"], ctx.engine_key, device)
            ir.mark(h2, meta("prefetch"))
            with graph.inserting_before(ctx.step_node(wai.step)):
                y = graph.call_function(ops.wait, (h2, ctx.engine_key, val.dtype, device, order))
            y.meta["val"] = _fake(ops.wait, h2.meta["val"], ctx.engine_key, val.dtype, device, order)
            ir.mark(y, meta("wait"))
            # every later use reads the waited tensor
            later = ctx.facts.step_of
            for user in list(target.users):
                if user in (h, h2, y):
                    continue
                if source.graph is not graph or later.get(user, -1) >= wai.step:
                    user.replace_input_with(target, y)
            stand_in[gap.buffer] = y
            ctx.inserted[group] = {"offload": h, "prefetch": h2, "wait": y}
            changes.append(f"{source.name}: offload after step {off.step}, prefetch before {pre.step}, "
                           f"wait before {wai.step} ({off.tier}, {off.nbytes} bytes)")
        n = len(changes)
        return self.report(changes, offload=n, prefetch=n, wait=n)
