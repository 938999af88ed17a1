"""Insert offload / prefetch / wait nodes where the plan anchors them.

For a gap inside one graph: `h = offload(x)` after the step that last reads x before the gap,
`h2 = prefetch(h)` before the prefetch step, `y = wait(h2)` before the next use, and the uses from
there on read y. For a tensor saved for backward, the forward returns the handle instead of the
tensor and the backward placeholder receives it: the forward frees the activation, the backward
brings it back.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode

from .base import PassContext, PassReport
from zinf_compile.runtime import ops

ZINF_META = "zinf"


def _fake(fn, *args):
    mode = detect_fake_mode([a for a in args if isinstance(a, torch.Tensor)])
    if mode is None:
        return fn(*args)
    with mode:
        return fn(*args)


@dataclass(frozen=True)
class InsertOffloads:
    name: str = "insert-offloads"

    def __call__(self, ctx: PassContext) -> PassReport:
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
            meta = {"group": group, "buffer": gap.buffer, "tier": off.tier}

            with source.graph.inserting_after(ctx.step_node(off.step)):
                h = source.graph.call_function(ops.offload, (source, ctx.engine_key, order))
            h.meta["val"] = _fake(ops.offload, source.meta["val"], ctx.engine_key, order)
            h.meta[ZINF_META] = {**meta, "kind": "offload"}

            graph = target.graph
            if source.graph is not graph:
                # saved for backward: the forward returns the handle, the backward receives it
                out = next(iter(source.graph.find_nodes(op="output")))
                out.args = fx.node.map_arg(out.args, lambda n: h if n is source else n)
                incoming = target
                incoming.meta["val"] = h.meta["val"]
                incoming.meta[ZINF_META] = {**meta, "kind": "handle"}
            else:
                incoming = h
            with graph.inserting_before(ctx.step_node(pre.step)):
                h2 = graph.call_function(ops.prefetch, (incoming, ctx.engine_key, device))
            h2.meta["val"] = _fake(ops.prefetch, incoming.meta["val"], ctx.engine_key, device)
            h2.meta[ZINF_META] = {**meta, "kind": "prefetch"}
            with graph.inserting_before(ctx.step_node(wai.step)):
                y = graph.call_function(ops.wait, (h2, ctx.engine_key, val.dtype, device, order))
            y.meta["val"] = _fake(ops.wait, h2.meta["val"], ctx.engine_key, val.dtype, device, order)
            y.meta[ZINF_META] = {**meta, "kind": "wait"}
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
        for gm in ctx.graphs.values():
            gm.graph.lint()
            gm.recompile()
        n = len(changes)
        return PassReport(self.name, tuple(changes), {"offload": n, "prefetch": n, "wait": n} if n else {})
