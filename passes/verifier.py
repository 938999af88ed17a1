"""The verifier: invariants the graphs keep after every pass (the driver runs it), each failure
naming the pass and the invariant.

1. a managed parameter is read only by zinf's ops (gathers, fetches, reduces): never directly;
2. each fetch is finished by exactly one gather after it, in the same graph;
3. each gradient reduce stands after every other reader of its gradient;
4. no whole parameter (a gather, or a chain of single-input ops from one) is saved for backward;
5. a weight's tiles are never stacked: tile i's rows are dead before tile i+2's are gathered;
6. every wait reads a prefetch that stands before it in the same graph;
7. every offload handle reaches exactly one prefetch (directly, or through the forward's outputs
   into one backward placeholder; the other placeholders it reaches are unread), and nothing reads
   the offloaded storage after its offload, through any alias;
9. each recompute of the plan, once applied, is a chain of nodes in the backward whose last node is
   read, and the forward no longer saves the tensor it rebuilds;
and, once the plan is applied (`check_budget`):
8. the re-analysed graphs, with prefetched data counted from the prefetch on, stay within budget.
"""
from __future__ import annotations

import torch.fx as fx

from zinf_compile import ir
from zinf_compile.analysis import analyze, graph_specs
from zinf_compile.config import tier_frees_device
from zinf_compile.errors import ZinfError
from zinf_compile.ir import FetchMeta, GatherMeta, RecomputeMeta, ReduceMeta, output_node
from zinf_compile.runtime import ops

from .base import Graphs, PassContext


class VerificationError(ZinfError):
    pass


def _fail(after: str, msg: str):
    raise VerificationError(f"after pass {after!r}: {msg}")


def check_invariants(graphs: Graphs, ctx: PassContext, after: str) -> None:
    """Invariants 1-7; raises VerificationError naming the pass."""
    for role, gm in graphs.items():
        graph = gm.graph
        order = {n: i for i, n in enumerate(graph.nodes)}
        last_read = _last_reads(graph, order) if any(n.target is ops.offload for n in graph.nodes) else {}
        for n in graph.nodes:
            m = ir.meta(n)
            if n.op == "placeholder" and isinstance(m, ir.ParamMeta):
                direct = [u.name for u in n.users if not _reads_managed(u)]
                if direct:
                    _fail(after, f"{role}: the managed parameter {m.name} is read directly by {direct}")
            elif isinstance(m, FetchMeta):
                finish = list(n.users)
                if len(finish) != 1 or not isinstance(ir.meta(finish[0]), GatherMeta) \
                        or order[finish[0]] < order[n]:
                    _fail(after, f"{role}: the fetch {n.name} of {m.name} is not finished by one later gather "
                                 f"(users: {[u.name for u in finish]})")
            elif isinstance(m, ReduceMeta) and not m.part:
                g = n
                while isinstance(ir.meta(g), ReduceMeta):
                    g = g.args[0]
                late = [u.name for u in g.users if u.op != "output" and not isinstance(ir.meta(u), ReduceMeta)
                        and order[u] > order[n]]
                if late:
                    _fail(after, f"{role}: the gradient of {m.name} is reduced by {n.name} before {late} read it")
            elif n.target is ops.wait:
                pre = n.args[0]
                if not (isinstance(pre, fx.Node) and pre.target is ops.prefetch):
                    _fail(after, f"{n.name} waits on {pre}, which is not a prefetch")
                if order.get(pre, len(order)) >= order[n]:
                    _fail(after, f"{n.name} stands before its prefetch {pre.name}")
            elif n.target is ops.offload:
                src = n.args[0]
                late = [u.name for u in src.users if u is not n and order.get(u, -1) > order[n]]
                if late:
                    _fail(after, f"{src.name} is read by {late} after its offload {n.name}")
                key = _storage(src)
                reader = last_read.get(key) if key is not None else None
                if reader is not None and order[reader] > order[n]:
                    _fail(after, f"{reader.name} reads the storage of {src.name} (through another alias) after "
                                 f"its offload {n.name}")
                readers = [u for u in n.users if u.target is ops.prefetch or u.op == "output"]
                if len(readers) != len(n.users) or not readers:
                    _fail(after, f"offload {n.name} is not consumed by exactly one prefetch (users: {list(n.users)})")
        _check_tiles(graph, order, role, after)
    if "forward" in graphs:
        saved = saved_whole_parameters(graphs["forward"], ctx.num_fwd_outputs)
        if saved:
            _fail(after, f"the forward saves whole parameters for backward: {saved}")
        specs = graph_specs(graphs, ctx.num_fwd_outputs)
        for spec in specs:  # a handle the forward returns must reach one prefetch in the backward
            reached: dict[fx.Node, list] = {}
            for placeholder, fw_node in spec.saved.items():
                if fw_node.target is ops.offload:
                    reached.setdefault(fw_node, []).extend(placeholder.users)
            for fw_node, users in reached.items():
                if len(users) != 1 or users[0].target is not ops.prefetch:
                    _fail(after, f"the saved handle {fw_node.name} reaches {users} in backward, not one prefetch")
    _check_recomputes(graphs, ctx, after)
    for group, nodes in ctx.inserted.items():
        if not nodes["wait"].users:
            _fail(after, f"the wait {nodes['wait'].name} of group {group} has no users: the tensor came back for "
                         "nothing")


def _check_recomputes(graphs: Graphs, ctx: PassContext, after: str) -> None:
    """Invariant 9, once the recompute pass ran (its nodes are there, or it is the pass just run)."""
    if "backward" not in graphs or ctx.plan is None or not ctx.plan.recomputes():
        return
    chains: dict[int, list[fx.Node]] = {}
    for n in graphs["backward"].graph.nodes:
        m = ir.meta(n)
        if isinstance(m, RecomputeMeta):
            chains.setdefault(m.group, []).append(n)
    if not chains and after != "recompute":
        return
    want = {a.group: a for a in ctx.plan.recomputes()}
    if set(chains) != set(want):
        _fail(after, f"recomputes {sorted(want)} planned, chains of {sorted(chains)} in the backward")
    flat: list = []
    fx.node.map_arg(output_node(graphs["forward"].graph).args[0], flat.append)
    saved = {n.name for n in flat[max(ctx.num_fwd_outputs, 0):]}
    for group, nodes in chains.items():
        last = nodes[-1]
        if not last.users:
            _fail(after, f"the recompute {group} rebuilds {ir.meta(last).of} as {last.name}, which nothing reads")
        if ir.meta(last).of in saved:
            _fail(after, f"the forward still saves {ir.meta(last).of}, which the recompute {group} rebuilds")


def _storage(n: fx.Node):
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef

    val = n.meta.get("val")
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def _last_reads(graph: fx.Graph, order: dict) -> dict:
    """Storage (of the fake values) -> the last node reading a tensor in it, the offloads and the
    output aside (the output reads what the forward saves: handles where it offloads)."""
    last: dict = {}
    for u in graph.nodes:
        if u.op == "output" or u.target is ops.offload:
            continue
        for inp in u.all_input_nodes:
            key = _storage(inp)
            if key is not None:
                last[key] = u
    return last


def _reads_managed(u: fx.Node) -> bool:
    """Ops that may read a managed parameter's (empty) placeholder: zinf's own."""
    return u.op == "output" or getattr(u.target, "namespace", None) == "zinf"


def _check_tiles(graph: fx.Graph, order: dict, role: str, after: str) -> None:
    tiles: dict[int, list[fx.Node]] = {}
    for n in graph.nodes:
        m = ir.meta(n)
        if isinstance(m, GatherMeta) and m.rows is not None and m.part == "whole":
            tiles.setdefault(m.pid, []).append(n)
    for pid, ts in tiles.items():
        for a, c in zip(ts, ts[2:]):
            last = max((order[u] for u in _readers(a)), default=order[a])
            if last > order[c]:
                _fail(after, f"{role}: tiles of {ir.meta(a).name} stacked: {a.name} is still read after {c.name}")


def _readers(n: fx.Node) -> list[fx.Node]:
    """n's users, through the transposes and casts a tile goes through to its matmul."""
    out, todo = [], list(n.users)
    while todo:
        u = todo.pop()
        out.append(u)
        if u.op == "call_function" and len(u.all_input_nodes) == 1:
            todo.extend(u.users)
    return out


def saved_whole_parameters(fw: fx.GraphModule, num_fwd_outputs: int = 0) -> list[str]:
    """The forward's outputs (saved for backward) that are a gathered parameter, or a chain of
    single-input ops from one (the all-gather, its wait, views, casts): what must never be saved."""
    flat: list = []
    fx.node.map_arg(output_node(fw.graph).args[0], flat.append)
    found = []
    for a in flat[max(num_fwd_outputs, 0):]:
        n = a
        while isinstance(n, fx.Node) and n.op == "call_function" and not isinstance(ir.meta(n), GatherMeta) \
                and len(n.all_input_nodes) == 1:
            n = n.all_input_nodes[0]
        if isinstance(n, fx.Node) and isinstance(ir.meta(n), GatherMeta):
            found.append(a.name)
    return found


def fused_bytes(facts) -> "np.ndarray":
    """Per step, the bytes the analysis counts for a recompute chain's fused interior nodes
    (RecomputeMeta.fused: pointwise ops Inductor folds into the kernel that makes the rebuilt
    tensor), which never exist: the candidate's temp_nbytes left them out by the same rule."""
    import numpy as np

    out = np.zeros(len(facts.live), dtype=np.int64)
    dev = facts.device
    for b in facts.buffers:
        m = ir.meta(b.aliases[0])
        if isinstance(m, RecomputeMeta) and m.fused and b.nbytes and b.device == dev and b.def_step >= 0:
            out[b.def_step:b.end_step + 1] += b.nbytes
    return out


def check_budget(graphs: Graphs, ctx: PassContext, plan, after: str = "fetch-ahead") -> int:
    """Invariant 8; returns the simulated peak."""
    specs = graph_specs(graphs, ctx.num_fwd_outputs)
    facts = analyze(specs, device=ctx.facts.device)
    live = facts.live.copy()
    where = {n: b.id for b in facts.buffers for n in b.aliases}
    for nodes in ctx.inserted.values():
        pre, y = nodes["prefetch"], nodes["wait"]
        live[facts.step_of[pre]:facts.step_of[y]] += facts.buffers[where[y]].nbytes
    live -= fused_bytes(facts)
    peak = int(live.max()) if len(live) else 0
    frees = tier_frees_device(plan.tier, plan.device)
    if peak > plan.budget and ((frees and (plan.moves() or plan.params)) or (not plan.moves() and plan.recomputes())):
        _fail(after, f"simulated peak {peak} bytes is over the budget {plan.budget}")
    return peak


def verify(ctx: PassContext, num_fwd_outputs: int, after: str, graphs: Graphs) -> int:
    """Every invariant at once (tests break them by hand): returns the simulated peak."""
    ctx.num_fwd_outputs = num_fwd_outputs
    check_invariants(graphs, ctx, after)
    return check_budget(graphs, ctx, ctx.plan, after)
