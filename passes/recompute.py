"""Rebuild the saved activations the plan recomputes, in the backward, instead of keeping them.

For each recompute action: the forward's chain (analysis.recompute.Recompute.chain) is emitted
again in the backward right before the action's step, reading the backward placeholders of its
leaves (saved anyway); every reader of the saved tensor's placeholder reads the rebuilt value; the
forward no longer returns the tensor and the backward no longer receives it (both lists shrink at
the same position, which is how AOT pairs them), so its storage dies at its last forward use.

Runs before insert-offloads: the plan never offloads a leaf across its rebuild, and a leaf that
comes back earlier has its placeholder's readers (the chain's among them) redirected to its wait.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch.fx as fx

from zinf_compile import ir
from zinf_compile.analysis.recompute import fused_nodes
from zinf_compile.ir import RecomputeMeta, output_node

from .base import Graphs, Pass, PassContext
from .insert_offload import _repropagate, _storage_key


@dataclass(frozen=True)
class Recompute(Pass):
    name: ClassVar[str] = "recompute"

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        acts = ctx.plan.recomputes() if ctx.plan is not None else ()
        if not acts:
            return self.report([])
        cands = {(r.buffer, r.before): r for r in ctx.facts.recomputes}
        fw, bw = graphs["forward"].graph, graphs["backward"].graph
        out = output_node(fw)
        changes = []
        dropped: set[fx.Node] = set()
        for a in acts:
            r = cands[(a.tensor, a.step)]
            env = dict(zip(r.leaves, r.leaf_placeholders))
            fused = fused_nodes(r.chain)
            with bw.inserting_before(ctx.step_node(r.before)):
                for n in r.chain:
                    args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda x: env[x])
                    new = ir.emit(bw, n.target, args, kwargs)
                    ir.mark(new, RecomputeMeta(a.group, r.buffer, n.name, n in fused))
                    env[n] = new
            rebuilt = env[r.target]
            key = _storage_key(r.placeholder)
            users = list(r.placeholder.users)
            for u in users:
                u.replace_input_with(r.placeholder, rebuilt)
            _repropagate(users, key)  # views made of it now view the rebuilt storage
            dropped.add(r.target)
            bw.erase_node(r.placeholder)
            changes.append(f"{r.target.name}: rebuilt before step {r.before} by {len(r.chain)} op(s) from "
                           f"{', '.join(leaf.name for leaf in r.leaves)} ({r.nbytes} bytes not saved)")
        # the forward returns it no more: only its saved slots (after the user's outputs) go
        n_user = ctx.num_fwd_outputs
        flat = list(out.args[0])
        out.args = (tuple(x for i, x in enumerate(flat) if i < n_user or x not in dropped),)
        return self.report(changes, recompute=len(changes))
