"""Graph facts: the steps of one or more FX graphs on one timeline, the storages (buffers) their
tensors live in, when each is defined and used, the device memory timeline and its lower bound.

Forward and backward are analysed together: a tensor the forward saves for backward is one buffer
whose uses span both graphs, so the long gap between its last forward use and its first backward
use is visible as what it is — the best thing to move off the device.
"""
from __future__ import annotations

import functools
import gc
import operator
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import sympy
import torch
import torch.fx as fx

from zinf_compile import ir
from zinf_compile.analysis.recompute import in_floor, rebuild_gaps, recompute_candidates
from zinf_compile.analysis.sizes import dense_dim_order, shape_str, storage_nbytes, tensor_nbytes


@dataclass(frozen=True)
class StepFact:
    index: int
    graph: str
    node: fx.Node
    flops: int
    est_time_s: float


@dataclass(frozen=True)
class Buffer:
    """One storage: all the tensors (views) that share it."""

    id: int
    graph: str  # where it is defined
    role: str  # input | activation | saved | output | gradient | tangent
    nbytes: int
    size_expr: sympy.Expr
    device: str
    def_step: int  # first step it is live; -1 for the first graph's inputs, the backward's first step for tangents
    end_step: int  # last step it is live (the timeline's end for what outlives the graphs)
    use_steps: tuple[int, ...]
    aliases: tuple[fx.Node, ...]  # nodes whose value lives in this storage, in graph order


@dataclass(frozen=True)
class Gap:
    """A stretch with no use of a buffer: from `after` (a use or the definition) to `before`
    (the next use). The buffer may be away during (after, before)."""

    buffer: int
    after: int
    before: int
    source: fx.Node  # the tensor the offload reads (defined by step `after`): covers the storage densely
    target: fx.Node  # the tensor the uses from `before` on read (replaced by the wait)
    dim_order: tuple[int, ...]
    # the aliases read from `before` on when they are not just `target` covering the storage: each
    # is rebuilt as a view (as_strided) of the waited storage; empty: `target` is the waited tensor
    views: tuple[fx.Node, ...] = ()


@dataclass(frozen=True)
class GraphFacts:
    graphs: tuple[str, ...]
    device: str
    steps: tuple[StepFact, ...]
    buffers: tuple[Buffer, ...]
    gaps: tuple[Gap, ...]
    step_of: dict = field(repr=False)  # fx.Node -> step index
    live: np.ndarray = field(repr=False)  # device bytes live at each step
    working_set: np.ndarray = field(repr=False)  # bytes the step itself reads and writes
    lower_bound: int = 0  # peak when every gap is used (prefetch just in time)
    floor: np.ndarray | None = field(default=None, repr=False)  # per step: live bytes no lever can free
    recomputes: tuple = ()  # analysis.recompute.Recompute: saved activations the backward can rebuild
    rebuild_gaps: tuple[Gap, ...] = ()  # leaves' gaps cut short at a rebuild (analysis.recompute.rebuild_gaps)

    @property
    def peak(self) -> int:
        return int(self.live.max()) if len(self.live) else 0


@dataclass(frozen=True)
class GraphSpec:
    """One graph to analyse. For a backward graph, `saved` maps each of its placeholders that
    receives a saved tensor to the forward node that produced it."""

    role: str
    gm: fx.GraphModule
    num_user_outputs: int = -1  # forward: how many outputs are the user's (-1: all)
    saved: dict = field(default_factory=dict)  # bw placeholder -> fw node


def _tensors_of(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (list, tuple)):
        return [t for v in val for t in _tensors_of(v)]
    return []


def _is_step(node: fx.Node) -> bool:
    return node.op in ("call_function", "call_method", "call_module")


def paused_gc(fn):
    """Run fn with Python's cyclic GC off. Analysis and planning make many small acyclic objects,
    and every collection they trigger walks every object of the process (the FX graphs and their
    fake tensors): on a 7,015-step graph analysis took 1.13 s with the GC on, 0.32 s with it off,
    and `bench planning` saw it jump from 0.2 to 5.6 s between neighbouring sizes."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        was = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was:
                gc.enable()

    return run


@paused_gc
def analyze(specs: Sequence[GraphSpec], device: str | None = None, step_cost=None) -> GraphFacts:
    """Facts of the graphs in `specs`, laid end to end. `step_cost(node) -> (flops, seconds)`."""
    steps: list[StepFact] = []
    step_of: dict[fx.Node, int] = {}
    for spec in specs:
        for node in spec.gm.graph.nodes:
            if _is_step(node):
                flops, secs = step_cost(node) if step_cost else (0, 0.0)
                step_of[node] = len(steps)
                steps.append(StepFact(len(steps), spec.role, node, int(flops), float(secs)))
    n_steps = len(steps)
    end = n_steps - 1

    # -- buffers: one per storage --------------------------------------------------------------
    b_graph: list[str] = []
    b_role: list[str] = []
    b_size: list[tuple[int, sympy.Expr]] = []
    b_device: list[str] = []
    b_def: list[int] = []
    b_uses: list[set[int]] = []
    b_aliases: list[list[fx.Node]] = []
    b_persist: list[bool] = []
    buffer_of: dict[fx.Node, list[int]] = {}

    def new_buffer(graph, role, t, def_step, node):
        b_graph.append(graph)
        b_role.append(role)
        held = ir.resident_bytes(node)
        if held is not None:  # a managed parameter or a fetched shard: its device bytes
            b_size.append((int(held), sympy.Integer(int(held))))
        else:
            b_size.append(storage_nbytes(t))
        b_device.append(t.device.type)
        b_def.append(def_step)
        b_uses.append(set())
        b_aliases.append([node])
        b_persist.append(role == "input")
        return len(b_graph) - 1

    for spec in specs:
        storages: dict[int, int] = {}  # a storage's address -> its buffer (the graph's values keep it alive)
        graph_steps = [step_of[n] for n in spec.gm.graph.nodes if n in step_of]
        first = graph_steps[0] if graph_steps else 0
        for node in spec.gm.graph.nodes:
            ts = _tensors_of(node.meta.get("val"))
            if ir.is_handle(node):
                ts = []  # a handle is 8 bytes of bookkeeping, not device memory worth planning
            if node.op == "placeholder":
                if node in spec.saved:
                    src = spec.saved[node]
                    ids = buffer_of.get(src, [])
                    buffer_of[node] = ids
                    for b, t in zip(ids, ts):
                        storages[t.untyped_storage()._cdata] = b
                        b_aliases[b].append(node)
                        if b_role[b] == "activation":
                            b_role[b] = "saved"
                    continue
                role = "input" if spec.role != "backward" else "tangent"
                ids = []
                for t in ts:
                    key = t.untyped_storage()._cdata
                    if key not in storages:
                        storages[key] = new_buffer(spec.role, role, t, first if role == "tangent" else -1, node)
                    else:
                        b_aliases[storages[key]].append(node)
                    ids.append(storages[key])
                buffer_of[node] = ids
                continue
            if node.op == "output":
                flat = []
                fx.node.map_arg(node.args[0], flat.append)
                n_user = len(flat) if spec.num_user_outputs < 0 else spec.num_user_outputs
                for i, out in enumerate(flat):
                    if i < n_user:
                        for b in buffer_of.get(out, []):
                            b_persist[b] = True
                            if b_role[b] not in ("input",):
                                b_role[b] = "output" if spec.role != "backward" else "gradient"
                continue
            if node not in step_of:
                continue
            s = step_of[node]
            for b in _read_buffers(node, buffer_of):
                b_uses[b].add(s)
            ids = []
            for t in ts:
                key = t.untyped_storage()._cdata
                if key not in storages:
                    storages[key] = new_buffer(spec.role, "activation", t, s, node)
                elif storages[key] not in ids:  # (only this loop adds the node as an alias)
                    b_aliases[storages[key]].append(node)
                ids.append(storages[key])
            buffer_of[node] = ids

    dev = device or _majority_device(b_device, b_size)
    buffers = []
    for b in range(len(b_graph)):
        uses = tuple(sorted(b_uses[b]))
        last = max([b_def[b], *uses]) if (uses or b_def[b] >= 0) else b_def[b]
        endb = end if b_persist[b] else last
        buffers.append(
            Buffer(b, b_graph[b], b_role[b], b_size[b][0], b_size[b][1], b_device[b], b_def[b], endb, uses,
                   tuple(b_aliases[b]))
        )

    # live bytes per step (a difference array) and each step's working set, accumulated at once
    starts, ends, sizes, ws_at, ws_add = [], [], [], [], []
    for b in buffers:
        if b.device != dev or b.nbytes == 0:
            continue
        starts.append(max(b.def_step, 0))
        ends.append(b.end_step + 1)
        sizes.append(b.nbytes)
        at = set(b.use_steps)
        if b.def_step >= 0:
            at.add(b.def_step)
        ws_at.extend(at)
        ws_add.extend([b.nbytes] * len(at))
    live = np.zeros(n_steps + 1, dtype=np.int64)
    ws = np.zeros(max(n_steps, 1), dtype=np.int64)
    np.add.at(live, np.asarray(starts, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
    np.subtract.at(live, np.asarray(ends, dtype=np.int64), np.asarray(sizes, dtype=np.int64))
    np.add.at(ws, np.asarray(ws_at, dtype=np.int64), np.asarray(ws_add, dtype=np.int64))
    live = np.cumsum(live)[:n_steps]
    graph_of_step = [st.node.graph for st in steps]
    orders: dict[fx.Node, tuple] = {}  # (dense_dim_order, bytes) of each alias, once
    reach: dict[fx.Node, tuple] = {}  # (defining step, last reading step) of each alias, once
    static: dict[fx.Node, bool] = {}  # whether each alias's layout is static, once
    gaps = tuple(g for b in buffers if b.device == dev
                 for g in _gaps(b, step_of, graph_of_step, orders, reach, static))
    recomputes = ()
    bw = [spec for spec in specs if spec.saved]
    if bw and n_steps:
        bw_start = next((st.index for st in steps if st.graph == bw[0].role), n_steps)
        recomputes = recompute_candidates(buffers, bw[0].saved, step_of, bw_start, steps)
    cut = ()
    if recomputes:
        cut = rebuild_gaps(recomputes, gaps)
    floor = _floor_of(live, buffers, gaps, recomputes)
    return GraphFacts(
        graphs=tuple(s.role for s in specs),
        device=dev,
        steps=tuple(steps),
        buffers=tuple(buffers),
        gaps=gaps,
        step_of=step_of,
        live=live,
        working_set=ws[:n_steps],
        lower_bound=int(floor.max()) if n_steps else 0,
        floor=floor,
        recomputes=recomputes,
        rebuild_gaps=cut,
    )


def _floor_of(live: np.ndarray, buffers, gaps, recomputes) -> np.ndarray:
    """Per step, the live bytes when every lever is used: every gap's storage away inside it, and
    every recompute that no gap makes unnecessary or excludes (analysis.recompute.in_floor) freeing
    its storage until its rebuild, which holds the chain's intermediates for a moment."""
    floor = live.copy()
    for g in gaps:
        floor[g.after + 1:g.before] -= buffers[g.buffer].nbytes
    for r in in_floor(recomputes, gaps):
        floor[r.after + 1:r.before] -= r.nbytes
        floor[r.before] += r.temp_nbytes
    return floor


def _read_buffers(node: fx.Node, buffer_of: dict) -> list[int]:
    """The buffers a step reads. `getitem` on a multi-output node reads only the element it picks
    (else every output of layer norm would live as long as its longest-lived sibling)."""
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        parent, idx = node.args
        vals = parent.meta.get("val")
        ids = buffer_of.get(parent, [])
        if isinstance(vals, (list, tuple)) and isinstance(idx, int) and len(ids) == len(_tensors_of(vals)):
            if not isinstance(vals[idx], torch.Tensor):
                return []
            return [ids[sum(isinstance(v, torch.Tensor) for v in vals[:idx])]]
    return [b for inp in node.all_input_nodes for b in buffer_of.get(inp, [])]


def _majority_device(devices: list[str], sizes) -> str:
    totals: dict[str, int] = {}
    for d, (n, _) in zip(devices, sizes):
        totals[d] = totals.get(d, 0) + n
    non_cpu = {d: n for d, n in totals.items() if d != "cpu"}
    if non_cpu:
        return max(non_cpu, key=non_cpu.get)
    return "cpu"


def _gaps(b: Buffer, step_of: dict, graph_of_step: list, orders: dict, reach: dict, static: dict) -> list[Gap]:
    """The gaps of a buffer that an offload can use.

    A gap qualifies when the buffer is an activation (inputs and outputs are held by the caller,
    so moving them frees nothing) and one tensor defined before the gap covers its storage densely
    (the offload copies it). After the gap, one alias covering the storage densely is the waited
    tensor itself; several aliases, or views that do not cover it (q, k and v of one projection),
    are each rebuilt as a view of the waited storage (static sizes, strides and offsets).
    `orders`, `reach` and `static` memoize per alias what every gap of its buffer asks again.
    """
    if b.role not in ("activation", "saved") or b.nbytes == 0 or b.def_step < 0:
        return []
    events = sorted({b.def_step, *b.use_steps})
    out = []
    spans = None  # (alias, its graph, defining step, last reading step) of each alias, once per buffer
    for a, c in zip(events, events[1:]):
        if c - a < 2:
            continue
        if spans is None:
            spans = [(u, u.graph, *_reach(u, step_of, reach)) for u in b.aliases]
        graph = graph_of_step[a]
        # the aliases read from c on in c's graph (its output too: a tensor the forward saves)
        gc = graph_of_step[c]
        readers = [u for u, g, born, last in spans if g is gc and born < c <= last]
        if not readers:
            continue
        cross = readers[0].graph is not graph
        if len(readers) == 1 and _covers(readers[0], b, orders):
            target = readers[0]
            source = (target if target.op == "placeholder" or step_of[target] <= a else None) if not cross \
                else _saved_source(b, target, a, step_of)
            if source is not None and _covers(source, b, orders):
                out.append(Gap(b.id, a, c, source, target, tuple(orders[source][0])))
                continue
        # several readers, or one that does not cover the storage: a covering base, views rebuilt
        if not all(_static_view(r, b, static) for r in readers) or \
                (cross and any(r.op != "placeholder" for r in readers)):
            continue
        bases = [n for n, g, born, _ in spans if g is graph and born <= a
                 and _covers(n, b, orders) and _static_view(n, b, static) and n.meta["val"].storage_offset() == 0]
        if not bases:
            continue
        source = bases[0]
        if any(r.meta["val"].dtype != source.meta["val"].dtype for r in readers):
            continue
        out.append(Gap(b.id, a, c, source, readers[0], tuple(orders[source][0]), tuple(readers)))
    return out


_NEVER = 10**18


def _reach(n: fx.Node, step_of: dict, reach: dict) -> tuple[int, int]:
    """(the step that defines alias n, -1 for a placeholder; the last step that reads it, _NEVER
    when its graph outputs it), memoized in `reach`. n exists before step c when the first is
    below c (its later uses must then be redirected); it is read from c on when the second is c
    or more."""
    known = reach.get(n)
    if known is None:
        born = -1 if n.op == "placeholder" else step_of.get(n, _NEVER)
        last = max((_NEVER if u.op == "output" else step_of.get(u, -1) for u in n.users), default=-1)
        known = reach[n] = (born, last)
    return known


def _covers(n: fx.Node, b: Buffer, orders: dict) -> bool:
    """Whether alias n is one dense tensor over all of b's bytes. `orders` memoizes n's size and,
    once the size matches, its dense_dim_order (most views cover part of a storage: their order
    is never needed)."""
    known = orders.get(n)
    if known is None:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return False
        nbytes = tensor_nbytes(val)
        known = orders[n] = (dense_dim_order(val) if nbytes == b.nbytes else None, nbytes)
    return known[0] is not None and known[1] == b.nbytes


def _static_view(n: fx.Node, b: Buffer, static: dict | None = None) -> bool:
    """Sizes, strides and offset known as integers (a view of the waited storage can be rebuilt),
    memoized in `static` when given."""
    if static is not None:
        known = static.get(n)
        if known is None:
            known = static[n] = _static_view(n, b)
        return known
    val = n.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return False
    try:
        ints = [*val.shape, *val.stride(), val.storage_offset()]
    except RuntimeError:
        return False
    return all(isinstance(x, int) for x in ints)


def _saved_source(b: Buffer, target: fx.Node, a: int, step_of: dict) -> fx.Node | None:
    """For a backward placeholder `target`, the one forward node saved into it (the alias the
    forward offloads right after step `a`)."""
    fw = [n for n in b.aliases if n.op != "placeholder" and step_of.get(n, _NEVER) <= a
          and any(u.op == "output" for u in n.users)]
    return fw[0] if len(fw) == 1 else None
