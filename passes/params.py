"""Partitioned parameters (ZeRO-3): gather before use, release after, gradients reduced to shards.

The driver inserts gathers for every parameter zinf *may* manage, partitions once, and lets the
planner decide from the facts of those graphs which parameters stay managed; KeepResident then
gives the others back their direct reads. No choice is tried on a copy of a graph.

    InsertGathers      joint or inference graph: each candidate parameter is read only through
                       `zinf::gather(p)` before its first use; in a joint graph the gather (and the
                       whole copies of it: views, casts) are MUST_RECOMPUTE, so the partitioner
                       gathers again in the backward instead of saving the whole parameter.
    ReduceGrads        joint graph: each candidate's gradient goes to `zinf::reduce_grad(g, p)`.
    DropReducedOutputs backward: None where it returns a reduce (autograd accumulates nothing for a
                       managed parameter); each reduce right after its gradient's last reader.
    SinkGathers        each gather next to its first user (the partitioner puts recomputed nodes
                       where it likes), so a parameter is whole only while it is used.
    KeepResident       the parameters the plan keeps resident: their gathers and reduces removed,
                       their uses read the placeholder again, their gradients returned to autograd.
    AllReduceGrads     over several ranks, the gradients of resident parameters averaged (as DDP).
    FetchAhead         the plan's fetches: an NVMe shard's read started at its anchor step, the
                       gather finishing it (`gather_from(p, fetch(p))`).

Release needs no node: the gathered tensor is an ordinary buffer, freed by Inductor after its last
use; the plan records where that is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from zinf_compile import ir
from zinf_compile.ir import FetchMeta, GatherMeta, ParamMeta, ReduceMeta, emit, output_node
from zinf_compile.runtime import ops

from .base import Graphs, Pass, PassContext

_CASTS = (torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default)
aten, c10d = torch.ops.aten, torch.ops._c10d_functional


def stored_nbytes(numel: int, itemsize: int, master: str | None) -> int:
    """Bytes of a parameter's data as stored in its tier: in its master dtype when it has one."""
    return int(numel) * (getattr(torch, master).itemsize if master else itemsize)


def read_nbytes(numel: int, itemsize: int, master: str | None, gather: str | None) -> int:
    """Bytes one gather reads from the tier: the gather copy where it is narrower than the shard."""
    stored = stored_nbytes(numel, itemsize, master)
    return min(stored, int(numel) * getattr(torch, gather).itemsize) if gather else stored


def gather_dtype_of(gather: str | None, dtype: str, master: str | None = None) -> str | None:
    """The dtype name of the copy a parameter of `dtype` (names without "torch.") is gathered from
    under option gather_dtype=`gather`: None where the copy would not be narrower than its shard
    (runtime.params.narrower, which the take-over applies)."""
    from zinf_compile.runtime.params import narrower

    if gather is None:
        return None
    out = narrower(getattr(torch, gather), getattr(torch, master or dtype))
    return None if out is None else str(out).removeprefix("torch.")


def param_meta(name: str, pid: int, resident_bytes: int, tier: str, requires_grad: bool = True,
               engine: int = 0, master: str | None = None, gather: str | None = None) -> ParamMeta:
    return ParamMeta(pid, name, resident_bytes, tier, requires_grad, engine, master, gather)


def _whole_copies(g: fx.Node) -> list[fx.Node]:
    """g and the single-input views and casts of it (a transpose for a matmul, autocast's bf16
    copy), breadth first: each is the whole parameter again, so each is recomputed, never saved."""
    out, todo = [], [g]
    while todo:
        n = todo.pop(0)
        out.append(n)
        for u in n.users:
            if (u.op == "call_function" and len(u.all_input_nodes) == 1
                    and (u.target in _CASTS or getattr(u.target, "is_view", False))):
                todo.append(u)
    return out


def _refresh_views(g: fx.Node) -> None:
    """The views and casts of g were traced on another tensor (the parameter, or a gather now
    gone): their fake values alias its storage, and the analysis would count g dead at its first
    view. Recompute them from g's value, inputs first."""
    for n in _whole_copies(g)[1:]:
        args = fx.node.map_arg(n.args, lambda a: a.meta["val"])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: a.meta["val"])
        with ir.fake_mode_of(g.meta["val"]):
            n.meta["val"] = n.target(*args, **kwargs)


@dataclass(frozen=True)
class InsertGathers(Pass):
    """`params`: (placeholder index, ParamMeta) of the parameters to gather. Over `world` > 1
    ranks a gather is shard(p) -> all_gather_into_tensor -> wait_tensor -> slice -> view with
    torch's functional collectives over `group`, which Inductor schedules."""

    name: ClassVar[str] = "insert-gathers"
    params: tuple[tuple[int, ParamMeta], ...] = ()
    recompute: bool = False
    world: int = 1
    group: str | None = None

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        graph = (graphs.get("joint") or graphs["inference"]).graph
        placeholders = list(graph.find_nodes(op="placeholder"))
        order = {n: i for i, n in enumerate(graph.nodes)}
        changes = []
        for index, meta in self.params:
            p = placeholders[index]
            ir.mark(p, meta)
            users = sorted(p.users, key=order.get)
            if not users:
                continue
            with graph.inserting_before(users[0]):
                chain = self._chain(graph, p, meta)
            g = chain[-1]
            p.replace_all_uses_with(g, delete_user_cb=lambda u, c=chain: u is not c[0])
            _refresh_views(g)
            if self.recompute:
                for n in chain[:-1] + _whole_copies(g):
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            changes.append(f"gather {meta.name} before {users[0].name}")
        return self.report(changes, gathers=len(changes))

    def _chain(self, graph: fx.Graph, p: fx.Node, meta: ParamMeta) -> list[fx.Node]:
        if self.world == 1:
            return [ir.mark(emit(graph, ops.gather, (p, meta.engine, meta.where)), GatherMeta(meta.pid, meta.name))]
        val = p.meta["val"]
        shard = ir.mark(emit(graph, ops.shard, (p, meta.engine, meta.where)), GatherMeta(meta.pid, meta.name, "shard"))
        chain = [shard]
        for target, args in ((c10d.all_gather_into_tensor.default, (self.world, self.group)),
                             (c10d.wait_tensor.default, ()),
                             (aten.slice.Tensor, (0, 0, int(val.numel()))),
                             (aten.view.default, (list(val.shape),))):
            chain.append(ir.mark(emit(graph, target, (chain[-1], *args)), GatherMeta(meta.pid, meta.name, "collective")))
        ir.mark(chain[-1], GatherMeta(meta.pid, meta.name))
        return chain


@dataclass(frozen=True)
class ReduceGrads(Pass):
    """Joint graph: the gradient of each of `params` (placeholder index, ParamMeta) goes into its
    shard: reduce_grad(g, p), or over `world` > 1 ranks flat, padded g -> reduce_scatter_tensor
    (sum) -> wait_tensor -> store_grad(part, p). The parameter goes along (saved for the backward,
    free: its storage is empty), so the backward reduces into whichever instance's parameter the
    call got. The joint graph returns the forward's outputs, then one gradient per primal."""

    name: ClassVar[str] = "reduce-grads"
    params: tuple[tuple[int, ParamMeta], ...] = ()
    world: int = 1
    group: str | None = None

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        graph = graphs["joint"].graph
        placeholders = list(graph.find_nodes(op="placeholder"))
        out = output_node(graph)
        outs = list(out.args[0])
        changes = []
        for index, meta in self.params:
            slot = ctx.num_fwd_outputs + index
            g, p = outs[slot], placeholders[index]
            if not isinstance(g, fx.Node) or not meta.requires_grad:
                continue  # no gradient flows to this parameter
            with graph.inserting_before(out):
                outs[slot] = self._chain(graph, g, p, ReduceMeta(meta.pid, meta.name, index))
            changes.append(f"reduce the gradient of {meta.name} ({g.name}) into its shard")
        out.args = (tuple(outs),)
        return self.report(changes, reduces=len(changes))

    def _chain(self, graph: fx.Graph, g: fx.Node, p: fx.Node, meta: ReduceMeta) -> fx.Node:
        if self.world == 1:
            return ir.mark(emit(graph, ops.reduce_grad, (g, p)), meta)
        val = g.meta["val"]
        numel = int(val.numel())
        pad = -(-numel // self.world) * self.world - numel
        part = ReduceMeta(meta.pid, meta.name, meta.slot, part=True)
        x = g
        if not val.is_contiguous():
            x = ir.mark(emit(graph, aten.clone.default, (x,), {"memory_format": torch.contiguous_format}), part)
        for target, args in ((aten.view.default, ([-1],)), (aten.constant_pad_nd.default, ([0, pad],)),
                             (c10d.reduce_scatter_tensor.default, ("sum", self.world, self.group)),
                             (c10d.wait_tensor.default, ())):
            x = ir.mark(emit(graph, target, (x, *args)), part)
        return ir.mark(emit(graph, ops.store_grad, (x, p)), meta)


def _reduce_chain(r: fx.Node) -> list[fx.Node]:
    """A reduce and the collective steps feeding it, first to last."""
    chain = [r]
    while isinstance(chain[0].args[0], fx.Node) and isinstance(ir.meta(chain[0].args[0]), ReduceMeta):
        chain.insert(0, chain[0].args[0])
    return chain


def _reduces(graph: fx.Graph) -> list[fx.Node]:
    return [n for n in graph.nodes if isinstance(ir.meta(n), ReduceMeta) and not ir.meta(n).part]


@dataclass(frozen=True)
class DropReducedOutputs(Pass):
    """Backward: None where it returns a reduce's result, each reduce (with its collectives) right
    after the last reader of its gradient, so the gradient dies there."""

    name: ClassVar[str] = "drop-reduced-outputs"

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        graph = graphs["backward"].graph
        out = output_node(graph)
        out.args = (tuple(None if isinstance(a, fx.Node) and isinstance(ir.meta(a), ReduceMeta) else a
                          for a in out.args[0]),)
        order = {n: i for i, n in enumerate(graph.nodes)}
        changes = []
        for r in _reduces(graph):
            chain = _reduce_chain(r)
            g = chain[0].args[0]
            readers = [u for u in g.users if u not in chain and u.op != "output"]
            anchor = max(readers, key=order.get) if readers else g
            for n in chain:
                anchor.append(n)
                anchor = n
            changes.append(f"{r.name} after {g.name}'s last reader")
        return self.report(changes, reduces=len(changes))


@dataclass(frozen=True)
class SinkGathers(Pass):
    """Each part of a gather to just before its first user, last first."""

    name: ClassVar[str] = "sink-gathers"

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        moved = []
        for gm in graphs.values():
            graph = gm.graph
            parts = [n for n in graph.nodes if isinstance(ir.meta(n), GatherMeta)]
            order = {n: i for i, n in enumerate(graph.nodes)}
            for g in reversed(parts):
                users = sorted(g.users, key=lambda u: order.get(u, 0))
                if users and users[0].prev is not g:
                    users[0].prepend(g)
                    moved.append(f"{g.name} before {users[0].name}")
                    order = {n: i for i, n in enumerate(graph.nodes)}
        return self.report(moved, moved=len(moved))


@dataclass(frozen=True)
class KeepResident(Pass):
    """The parameters `pids` stay resident: each gather chain of theirs is removed and its uses
    read the placeholder; each reduce of their gradient is removed and the backward returns the
    gradient to autograd in its slot again."""

    name: ClassVar[str] = "keep-resident"
    pids: frozenset[int] = frozenset()

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        changes = []
        for role, gm in graphs.items():
            graph = gm.graph
            whole: dict[int, list[fx.Node]] = {}  # pid -> its whole gathers, one scan of the graph
            for n in graph.nodes:
                if ir.is_whole_gather(n):
                    whole.setdefault(ir.meta(n).pid, []).append(n)
            for p in list(graph.find_nodes(op="placeholder")):
                m = ir.param(p)
                if m is None or m.pid not in self.pids:
                    continue
                del p.meta[ir.KEY]
                for g in whole.get(m.pid, ()):
                    chain = [g]
                    while chain[0] is not p and isinstance(ir.meta(chain[0]), GatherMeta):
                        chain.insert(0, chain[0].args[0])
                    g.replace_all_uses_with(p)
                    for n in reversed(chain[1:]):
                        graph.erase_node(n)
                    changes.append(f"{role}: {m.name} read resident")
                _refresh_views(p)
            out = output_node(graph)
            outs = list(out.args[0]) if role == "backward" else None
            for r in _reduces(graph):
                m = ir.meta(r)
                if m.pid not in self.pids:
                    continue
                chain = _reduce_chain(r)
                g = chain[0].args[0]
                for n in reversed(chain):
                    if n.users:  # the inference graph or a joint: the output still names it
                        n.replace_all_uses_with(g)
                    graph.erase_node(n)
                if outs is not None:
                    outs[m.slot] = g
                changes.append(f"{role}: the gradient of {m.name} returned to autograd")
            if outs is not None:
                out.args = (tuple(outs),)
        return self.report(changes, resident=len(self.pids))


@dataclass(frozen=True)
class AllReduceGrads(Pass):
    """Backward over `world` > 1 ranks: average the gradients in `slots` (resident parameters)
    with torch's functional collectives (which Inductor lowers and can overlap)."""

    name: ClassVar[str] = "allreduce-grads"
    slots: tuple[int, ...] = ()
    world: int = 1
    group: str | None = None

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        graph = graphs["backward"].graph
        out = output_node(graph)
        outs = list(out.args[0])
        changes = []
        for i in self.slots:
            g = outs[i] if i < len(outs) else None
            if not isinstance(g, fx.Node):
                continue
            with graph.inserting_before(out):
                ar = emit(graph, c10d.all_reduce.default, (g, "sum", self.group))
                w = emit(graph, c10d.wait_tensor.default, (ar,))
                outs[i] = emit(graph, aten.div.Tensor, (w, self.world))
            changes.append(f"all-reduce the gradient of primal {i} ({g.name})")
        out.args = (tuple(outs),)
        return self.report(changes, allreduces=len(changes))


_FETCH = {ops.gather: (ops.fetch, ops.gather_from), ops.shard: (ops.fetch, ops.shard_from),
          ops.gather_rows: (ops.fetch_rows, ops.gather_rows_from)}


@dataclass(frozen=True)
class FetchAhead(Pass):
    """The plan's fetch actions: for each, the shard read that the gather at the buffer's first
    node makes starts right before the anchor step (`fetch`), and the gather finishes it.
    `holds`: a fetched shard is device memory until its gather (the analysis counts it)."""

    name: ClassVar[str] = "fetch-ahead"
    holds: bool = False

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        changes = []
        for a in ctx.plan.fetches():
            g = ctx.facts.buffers[a.tensor].aliases[0]
            graph, (start, finish) = g.graph, _FETCH[g.target]
            m: GatherMeta = ir.meta(g)
            anchor = ctx.step_node(a.step)
            p = g.args[0]
            with graph.inserting_before(anchor):
                h = graph.call_function(start, (p, *g.args[1:]))
            with ir.fake_mode_of(p.meta["val"]):
                h.meta["val"] = torch.empty((1,), dtype=torch.int64, device="cpu")
            ir.mark(h, FetchMeta(m.pid, m.name, a.nbytes if self.holds else 0, m.rows))
            with graph.inserting_before(g):
                new = graph.call_function(finish, (p, h, *g.args[1:]))
            new.meta.update(g.meta)
            g.replace_all_uses_with(new)
            graph.erase_node(g)
            changes.append(f"fetch {m.name}{'' if m.rows is None else ' rows %d:%d' % m.rows} before "
                           f"{anchor.name}, {ctx.facts.step_of[g] - a.step} steps ahead of its gather")
        return self.report(changes, fetches=len(changes))


def is_gather(n: fx.Node) -> bool:
    """A node that reads a managed parameter from its tier (whole, rows, or this rank's shard)."""
    return ir.is_shard_read(n)


def partition_pass(partition_fn: Callable, joint_inputs, kwargs: dict) -> "Partition":
    return Partition(partition_fn, joint_inputs, tuple(sorted(kwargs.items())))


@dataclass(frozen=True, eq=False)
class Partition(Pass):
    """AOT's joint graph -> forward and backward, by the partitioner the compile uses."""

    name: ClassVar[str] = "partition"
    fn: Callable = None  # type: ignore[assignment]
    joint_inputs: Any = None
    kwargs: tuple = ()

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        joint = graphs.pop("joint")
        fw, bw = self.fn(joint, self.joint_inputs, **dict(self.kwargs))
        graphs["forward"], graphs["backward"] = fw, bw
        return self.report((), saved=len(list(output_node(fw.graph).args[0])) - ctx.num_fwd_outputs)
