"""Recompute candidates: saved activations the backward can rebuild from what it already has.

A saved activation X (a forward value the backward reads through its own placeholder) is a
candidate when a short chain of cheap forward ops rebuilds it from other saved tensors: views and
layout ops (free or one copy), pointwise ops, softmax. Never a random op (its draw would differ),
never an op that writes in place, never a matmul or convolution (not cheap). The chain ends at
tensors the backward receives anyway (its leaves), each still live in the backward when X is
first read there, so recomputing X extends no other tensor's life.

Recomputing X frees its storage over the same stretch as offloading it across the forward and
backward would (from its last forward step to its first backward use), at the price of the chain's
compute, and holds the chain's intermediate storages for a moment at that use. Facts are data: the
chain's nodes, its cost, its leaves; the planner weighs them, passes/recompute.py applies them.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from zinf_compile.analysis.sizes import tensor_nbytes

aten = torch.ops.aten

MAX_CHAIN = 8  # ops re-emitted per candidate: past this the chain is a subgraph, not a cheap rebuild
# not tagged pointwise, yet cheap: one pass over their input (copies, concatenation, softmax)
LAYOUT = frozenset({aten.clone.default, aten._to_copy.default, aten.cat.default, aten.expand.default,
                    aten._softmax.default, aten._log_softmax.default})
# factories that take no tensor: constants the chain makes again (a scalar of a `where`)
# views torch does not register as views (they share the storage all the same)
VIEWS = frozenset({aten._unsafe_view.default})
FACTORIES = frozenset({aten.scalar_tensor.default, aten.full.default, aten.zeros.default, aten.ones.default})


@dataclass(frozen=True)
class Recompute:
    """Saved activation `target` (its storage is buffer `buffer`) rebuilt in the backward right
    before step `before` (its first backward use) by re-running `chain` (forward nodes, in order,
    ending with `target`) on `leaves` (saved forward nodes; the backward receives each in the
    placeholder at the same position of `leaf_placeholders`)."""

    buffer: int
    after: int  # the buffer's last forward step: it is free from after+1 ...
    before: int  # ... to before-1, and rebuilt before step `before`
    target: fx.Node
    placeholder: fx.Node  # the backward placeholder that receives `target` today
    chain: tuple[fx.Node, ...]
    leaves: tuple[fx.Node, ...]
    leaf_placeholders: tuple[fx.Node, ...]
    leaf_buffers: tuple[int, ...]
    nbytes: int  # the storage freed
    flops: int  # the flop counter's (0 for elementwise ops it does not count)
    bytes_touched: int  # memory traffic of the chain's ops that make storage (views move nothing)
    est_time_s: float  # the chain's compute, from the cost model's estimate of the forward steps
    temp_nbytes: int  # intermediate storages the chain makes besides the rebuilt one


def cheap_kind(node: fx.Node) -> str | None:
    """"view" | "pointwise" | "layout" | "factory" for an op a recompute may re-run; None otherwise."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload) or t.namespace != "aten":
        return None
    tags = set(t.tags)
    if torch.Tag.nondeterministic_seeded in tags or t._schema.is_mutable:
        return None
    if t in FACTORIES:
        return "factory"
    if t.is_view or t in VIEWS:
        return "view"
    if torch.Tag.pointwise in tags:
        return "pointwise"
    if t in LAYOUT:
        return "layout"
    return None


def recompute_candidates(buffers, saved: dict, step_of: dict, bw_start: int, steps) -> tuple[Recompute, ...]:
    """The candidates among `buffers` (analysis.facts.Buffer). `saved`: backward placeholder ->
    the forward node saved into it; `bw_start`: the backward's first step; `steps`: StepFacts."""
    placeholders: dict[fx.Node, list[fx.Node]] = {}
    for p, n in saved.items():
        placeholders.setdefault(n, []).append(p)
    buffer_of = {a: b.id for b in buffers for a in b.aliases}
    order: dict[fx.Node, int] = {}  # graph order of the forward's nodes, once (per chain was quadratic)
    out = []
    for b in buffers:
        if b.role != "saved" or b.nbytes == 0:
            continue
        fw_saved = [a for a in b.aliases if a in placeholders]
        if len(fw_saved) != 1 or len(placeholders[fw_saved[0]]) != 1:
            continue  # several tensors of the storage saved: rebuilding one frees nothing
        x = fw_saved[0]
        p = placeholders[x][0]
        bw_uses = [s for s in b.use_steps if s >= bw_start]
        fw_events = [s for s in (b.def_step, *b.use_steps) if 0 <= s < bw_start]
        if not bw_uses or not fw_events or x.op == "placeholder":
            continue
        before, after = min(bw_uses), max(fw_events)
        if not order:
            order = {n: i for i, n in enumerate(x.graph.nodes)}
        found = _chain(x, placeholders, order)
        if found is None:
            continue
        chain, leaves = found
        leaf_ph = tuple(placeholders[leaf][0] for leaf in leaves)
        leaf_buf = tuple(buffer_of.get(leaf, -1) for leaf in leaves)
        # each leaf must still be in the backward at `before` (else the rebuild would keep it longer)
        if any(lb < 0 or lb == b.id or (buffers[lb].end_step < before and buffers[lb].role != "input")
               for lb in leaf_buf):
            continue
        flops = sum(steps[step_of[n]].flops for n in chain if n in step_of)
        secs = sum(steps[step_of[n]].est_time_s for n in chain if n in step_of)
        traffic = sum(_traffic(n) for n in chain if cheap_kind(n) != "view")
        seen: set = set()
        temp = 0
        fused = fused_nodes(chain)
        for n in chain[:-1]:  # storages the chain makes besides the rebuilt one (views make none)
            if n in fused:
                continue  # inside the kernel that makes the rebuilt tensor: never stored
            v = n.meta.get("val")
            key = buffer_of.get(n, n)
            if isinstance(v, torch.Tensor) and key != b.id and key not in leaf_buf:
                if key not in seen:
                    seen.add(key)
                    temp += tensor_nbytes(v)
        out.append(Recompute(b.id, after, before, x, p, chain, leaves, leaf_ph, leaf_buf, b.nbytes, flops, traffic,
                             secs, temp))
    return tuple(out)


def fused_nodes(chain) -> frozenset:
    """The chain's interior nodes that make no storage at the rebuild: pointwise ops and scalar
    factories, which Inductor fuses into the kernel that consumes them (every reader of a
    re-emitted node is inside the chain, so nothing outside needs its value). Not fused: the last
    node, the storage the last node views (walking back through views), and the outputs of layout
    ops (copies, cat, softmax), which are realized. The same rule decides a candidate's
    `temp_nbytes` and, through RecomputeMeta.fused, what the verifier's re-analysis of the
    rewritten backward counts: the two agree by construction."""
    if not chain:
        return frozenset()
    base = chain[-1]
    kept = {base}
    while cheap_kind(base) == "view" and base.all_input_nodes:
        base = base.all_input_nodes[0]
        kept.add(base)
    return frozenset(n for n in chain[:-1] if n not in kept and cheap_kind(n) in ("pointwise", "factory"))


def _traffic(n: fx.Node) -> int:
    total = 0
    for a in (*n.all_input_nodes, n):
        v = a.meta.get("val")
        if isinstance(v, torch.Tensor):
            total += tensor_nbytes(v)
    return total


def _chain(x: fx.Node, available: dict, order: dict) -> tuple[tuple[fx.Node, ...], tuple[fx.Node, ...]] | None:
    """(the forward nodes rebuilding x, in graph `order`; the saved nodes they read), or None."""
    nodes: set[fx.Node] = set()
    leaves: set[fx.Node] = set()
    todo = [x]
    while todo:
        n = todo.pop()
        if n in nodes or n in leaves:
            continue
        if n is not x and n in available:
            leaves.add(n)
            continue
        if n.target is operator.getitem or cheap_kind(n) is None or len(nodes) >= MAX_CHAIN:
            return None
        for a in n.all_input_nodes:
            if not isinstance(a.meta.get("val"), torch.Tensor):
                return None  # a size computed in the forward (a SymInt node): not in the backward
        nodes.add(n)
        todo.extend(n.all_input_nodes)
    return tuple(sorted(nodes, key=order.get)), tuple(sorted(leaves, key=order.get))


def conflicts(r: Recompute, gap) -> bool:
    """Whether offloading `gap` (analysis.facts.Gap) and recomputing `r` exclude each other: the
    gap moves r's own storage, or one of r's leaves is away when the chain reads it (the gap spans
    r's rebuild; a gap that ends at the rebuild brings the leaf back before the chain)."""
    if gap.buffer == r.buffer:
        return True
    return gap.buffer in r.leaf_buffers and gap.after < r.before < gap.before


def rebuild_gaps(recomputes, gaps) -> tuple:
    """A leaf's gap across forward and backward cut short at a rebuild that reads the leaf: the
    leaf comes back for the chain instead of for its own first use (and stays until then). Kept
    apart from the facts' gaps: the floor counts the whole gaps; the planner takes a cut one where
    a recompute it chose excludes the whole one."""
    import dataclasses

    by_buffer = _by_buffer(gaps)
    out = {}
    for r in recomputes:
        for g in (g for lb in r.leaf_buffers for g in by_buffer.get(lb, ())):
            if g.after < r.before < g.before and g.source.graph is not g.target.graph:
                cut = dataclasses.replace(g, before=r.before)
                out.setdefault((cut.buffer, cut.after, cut.before), cut)
    return tuple(out[k] for k in sorted(out))


def in_floor(recomputes, gaps) -> tuple:
    """The recomputes the floor counts: each one's storage has no gap (else the gaps free it
    already), no gap of a leaf excludes it (`conflicts`), and no leaf is itself rebuilt: every lever
    of the floor can then be used together. Gaps indexed by buffer once (recomputes x gaps, for
    each recompute, was quadratic)."""
    by_buffer = _by_buffer(gaps)
    rebuilt = {o.buffer for o in recomputes}
    return tuple(r for r in recomputes
                 if r.buffer not in by_buffer
                 and not any(conflicts(r, g) for lb in r.leaf_buffers for g in by_buffer.get(lb, ()))
                 and not any(lb in rebuilt for lb in r.leaf_buffers))


def _by_buffer(gaps) -> dict:
    out: dict[int, list] = {}
    for g in gaps:
        out.setdefault(g.buffer, []).append(g)
    return out
