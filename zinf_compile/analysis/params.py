"""Facts about the parameters zinf may manage, read off graphs where every one of them is gathered
(the driver inserts gathers for all candidates, then partitions once). From these the planner
computes the timeline of any choice of managed parameters without rewriting a graph:

    a parameter kept resident holds its whole bytes at every step (instead of its shard's),
    its gathered copies do not exist, and its gradient lives on to the end (autograd keeps it)
    instead of dying at its reduce.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.fx as fx

from zinf_compile import ir
from zinf_compile.analysis.facts import GraphFacts
from zinf_compile.ir import GatherMeta, ReduceMeta


@dataclass(frozen=True)
class Interval:
    start: int  # first step
    end: int  # last step (inclusive)
    nbytes: int


@dataclass(frozen=True)
class ParamFact:
    pid: int
    name: str
    nbytes: int  # the whole parameter, as the graph reads it
    read_nbytes: int  # what one gather reads from the tier (this rank's shard, in its stored dtype)
    resident_bytes: int  # what the managed parameter keeps on the device between uses
    gathered_live: tuple[Interval, ...]  # its whole gathered copies while they are live
    gathered_floor: tuple[Interval, ...]  # the same, less the gaps an offload may use
    grad_kept: tuple[Interval, ...]  # what its gradient adds when autograd keeps it (resident)

    def resident_delta(self, n_steps: int, floor: bool) -> np.ndarray:
        """What keeping this parameter resident adds to the live (or floor) timeline."""
        d = np.full(n_steps, self.nbytes - self.resident_bytes, dtype=np.int64)
        for iv in (self.gathered_floor if floor else self.gathered_live):
            d[iv.start:iv.end + 1] -= iv.nbytes
        for iv in self.grad_kept:
            d[iv.start:iv.end + 1] += iv.nbytes
        return d


def buffer_index(facts: GraphFacts) -> dict[fx.Node, int]:
    """node -> the buffer its value lives in (the first, for multi-output nodes)."""
    out: dict[fx.Node, int] = {}
    for b in facts.buffers:
        for n in b.aliases:
            out.setdefault(n, b.id)
    return out


def intervals(facts: GraphFacts, buffer: int, gaps: list | None = None) -> list[Interval]:
    """The steps a buffer is live (less `gaps`, the buffer's gaps, when given), as intervals."""
    b = facts.buffers[buffer]
    if b.nbytes == 0 or b.device != facts.device:
        return []
    cuts = sorted((g.after + 1, g.before - 1) for g in gaps or ())
    out, s = [], max(b.def_step, 0)
    for a, e in cuts:
        if a > s:
            out.append(Interval(s, a - 1, b.nbytes))
        s = e + 1
    if s <= b.end_step:
        out.append(Interval(s, b.end_step, b.nbytes))
    return out


def param_facts(facts: GraphFacts, world: int = 1) -> dict[int, ParamFact]:
    """The managed parameters of the analysed graphs (by their ParamMeta), with what keeping each
    resident would change."""
    from zinf_compile.passes.params import read_nbytes

    where = buffer_index(facts)
    metas: dict[int, ir.ParamMeta] = {}
    vals: dict[int, torch.Tensor] = {}
    for spec_node in _placeholders(facts):
        m = ir.param(spec_node)
        if m is not None and m.pid not in metas:
            metas[m.pid] = m
            vals[m.pid] = spec_node.meta["val"]
    gathered: dict[int, set[int]] = {pid: set() for pid in metas}
    grads: dict[int, list[int]] = {pid: [] for pid in metas}
    for st in facts.steps:
        m = ir.meta(st.node)
        if isinstance(m, GatherMeta) and m.pid in gathered and st.node in where:
            gathered[m.pid].add(where[st.node])
        elif isinstance(m, ReduceMeta) and not m.part and m.pid in grads:
            g = st.node
            while isinstance(ir.meta(g), ReduceMeta):
                g = g.args[0]
            if g in where:
                grads[m.pid].append(where[g])
    end = len(facts.steps) - 1
    gaps_of: dict[int, list] = {}  # by buffer, once: scanning every gap per buffer was quadratic
    for g in facts.gaps:
        gaps_of.setdefault(g.buffer, []).append(g)
    out = {}
    for pid, m in metas.items():
        val = vals[pid]
        kept = []
        for b in grads[pid]:
            buf = facts.buffers[b]
            if buf.end_step < end and buf.device == facts.device:
                kept.append(Interval(buf.end_step + 1, end, buf.nbytes))
        out[pid] = ParamFact(
            pid, m.name, int(val.numel()) * val.element_size(),
            -(-read_nbytes(val.numel(), val.element_size(), m.master, m.gather) // world), m.resident_bytes,
            tuple(iv for b in sorted(gathered[pid]) for iv in intervals(facts, b)),
            tuple(iv for b in sorted(gathered[pid]) for iv in intervals(facts, b, gaps_of.get(b))),
            tuple(kept))
    return out


def _placeholders(facts: GraphFacts):
    seen = set()
    for st in facts.steps:
        g = st.node.graph
        if g not in seen:
            seen.add(g)
            yield from g.find_nodes(op="placeholder")


def parameter_reads(facts: GraphFacts) -> list[int]:
    """The steps that read a managed parameter's shard from its tier (a whole gather, a tile's
    rows, or this rank's shard before an all-gather): where a fetch can start the read earlier."""
    return [st.index for st in facts.steps if ir.is_shard_read(st.node)]
