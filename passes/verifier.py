"""The verifier: invariants a rewritten graph must keep. Runs after every pass in the tests.

1. every wait reads a prefetch, and the prefetch stands before it in the same graph;
2. every offload handle reaches exactly one prefetch (directly, or through the forward's outputs
   into the backward placeholder) before the tensor's next use, which now reads the wait;
3. nothing reads an offloaded tensor after its offload in the same graph;
4. the re-analysed graphs, with prefetched data counted from the prefetch on, stay within budget.
"""
from __future__ import annotations

import torch.fx as fx

from .base import PassContext
from zinf_compile.analysis.facts import analyze
from zinf_compile.config import tier_frees_device
from zinf_compile.errors import ZinfError
from zinf_compile.runtime import ops


class VerificationError(ZinfError):
    pass


def verify(ctx: PassContext, num_fwd_outputs: int, after: str) -> int:
    """Check the invariants; returns the simulated peak. Raises VerificationError naming the pass."""

    def fail(msg: str):
        raise VerificationError(f"after pass {after!r}: {msg}")

    for gm in ctx.graphs.values():
        order = {n: i for i, n in enumerate(gm.graph.nodes)}
        for n in gm.graph.nodes:
            if n.target is ops.wait:
                pre = n.args[0]
                if not (isinstance(pre, fx.Node) and pre.target is ops.prefetch):
                    fail(f"{n.name} waits on {pre}, which is not a prefetch")
                if order.get(pre, 1 << 62) >= order[n]:
                    fail(f"{n.name} stands before its prefetch {pre.name}")
            if n.target is ops.offload:
                src = n.args[0]
                late = [u.name for u in src.users if u is not n and order.get(u, -1) > order[n]]
                if late:
                    fail(f"{src.name} is read by {late} after its offload {n.name}")
                readers = [u for u in n.users if u.target is ops.prefetch or u.op == "output"]
                if len(readers) != len(n.users) or not readers:
                    fail(f"offload {n.name} is not consumed by exactly one prefetch (users: {list(n.users)})")
    for group, nodes in ctx.inserted.items():
        y = nodes["wait"]
        if not y.users:
            fail(f"the wait {y.name} of group {group} has no users: the tensor came back for nothing")

    from zinf_compile.pipeline import graph_specs

    specs = graph_specs(ctx.graphs, num_fwd_outputs)
    for spec in specs:  # a handle the forward returns must reach a prefetch in the backward
        for placeholder, fw_node in spec.saved.items():
            if fw_node.target is ops.offload:
                users = list(placeholder.users)
                if len(users) != 1 or users[0].target is not ops.prefetch:
                    fail(f"the saved handle {fw_node.name} reaches {users} in backward, not one prefetch")
    facts = analyze(specs, device=ctx.facts.device)
    live = facts.live.copy()
    for nodes in ctx.inserted.values():
        pre, y = nodes["prefetch"], nodes["wait"]
        p, w = facts.step_of[pre], facts.step_of[y]
        live[p:w] += facts.buffers[_buffer_of(facts, y)].nbytes
    peak = int(live.max()) if len(live) else 0
    if tier_frees_device(ctx.plan.tier, ctx.plan.device) and peak > ctx.plan.budget and ctx.plan.moves():
        fail(f"simulated peak {peak} bytes is over the budget {ctx.plan.budget}")
    return peak


def _buffer_of(facts, node) -> int:
    for b in facts.buffers:
        if node in b.aliases:
            return b.id
    raise VerificationError(f"{node.name} has no buffer")
