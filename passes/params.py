"""Partitioned parameters (ZeRO-3): gather before use, release after, gradients reduced to shards.

    InsertGathers   joint or inference graph: each managed parameter is read only through
                    `zinf::gather(p)`, placed before its first use. In a joint graph the gather is
                    marked MUST_RECOMPUTE, so the partitioner gathers again in the backward instead
                    of saving the whole parameter from forward to backward.
    ReduceGrads     joint graph: each managed parameter's gradient goes to
                    `zinf::reduce_grad(g, p)` (into p's shard); after partitioning the backward
                    returns None for it, so autograd never accumulates a whole gradient.
    SinkGathers     any graph: each gather moves to just before its first user (the partitioner puts
                    recomputed nodes where it likes), so a parameter is whole only while it is used.

Release needs no node: the gathered tensor is an ordinary buffer, freed by Inductor after its last
use; the plan records where that is.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .base import PassReport


def param_meta(name: str, pid: int, resident_bytes: int, tier: str, requires_grad: bool = True,
               engine: int = 0, master: str | None = None) -> dict:
    """The meta a managed parameter's placeholder carries (the analysis counts `resident_bytes`)."""
    return {"kind": "param", "name": name, "pid": pid, "resident_bytes": resident_bytes, "tier": tier,
            "requires_grad": requires_grad, "engine": engine, "master": master}


def partition_with_params(partition_fn, gm: fx.GraphModule, joint_inputs, kwargs: dict, managed: dict[int, dict],
                          allreduce: list[int] = (), world: int = 1):
    """Partition a joint graph whose primals `managed` (primal index -> param_meta) are managed
    parameters: gathers in, partition (gathers recomputed in backward), gradients to reduce_grad,
    gathers next to their uses. The gradients of primals `allreduce` (resident parameters over
    `world` > 1 ranks) are averaged over the ranks. Returns (forward, backward, reports)."""
    reports = []
    if managed:
        primals = [n for n in gm.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
        reports.append(InsertGathers()(gm.graph, {primals[i]: m for i, m in managed.items()}, recompute=True))
        # the joint graph returns the forward's outputs, then one gradient per primal, in order
        nfo = kwargs["num_fwd_outputs"]
        reports.append(ReduceGrads()(gm.graph, {nfo + i: (primals[i], m) for i, m in managed.items()
                                                if m["requires_grad"]}))
        gm.recompile()
    fw, bw = partition_fn(gm, joint_inputs, **kwargs)
    if managed:
        ReduceGrads.drop_outputs(bw.graph)
        reports.append(SinkGathers()(fw.graph))
        reports.append(SinkGathers()(bw.graph))
        for m in (fw, bw):
            m.recompile()
    if allreduce and world > 1:
        reports.append(AllReduceGrads()(bw.graph, list(allreduce), world))
        bw.recompile()
    return fw, bw, reports


@dataclass(frozen=True)
class AllReduceGrads:
    """Average the gradients of resident parameters over the ranks, in the graph, with torch's
    functional collectives (which Inductor lowers and can overlap): all_reduce(sum) / world."""

    name: str = "allreduce-grads"

    def __call__(self, graph: fx.Graph, slots: list[int], world: int) -> PassReport:
        from torch._guards import detect_fake_mode
        from torch.distributed.distributed_c10d import _get_default_group

        group = _get_default_group().group_name
        c10d = torch.ops._c10d_functional
        out = next(iter(graph.find_nodes(op="output")))
        outs = list(out.args[0])
        changes = []
        for i in slots:
            g = outs[i]
            if not isinstance(g, fx.Node):
                continue
            val = g.meta["val"]
            with graph.inserting_before(out), detect_fake_mode([val]):
                ar = graph.call_function(c10d.all_reduce.default, (g, "sum", group))
                ar.meta["val"] = torch.empty_like(val)
                w = graph.call_function(c10d.wait_tensor.default, (ar,))
                w.meta["val"] = torch.empty_like(val)
                d = graph.call_function(torch.ops.aten.div.Tensor, (w, world))
                d.meta["val"] = torch.empty_like(val)
            outs[i] = d
            changes.append(f"all-reduce the gradient of primal {i} ({g.name})")
        out.args = (tuple(outs),)
        graph.lint()
        return PassReport(self.name, tuple(changes), {"allreduces": len(changes)} if changes else {})


def _fake_gather(p: fx.Node):
    from torch._guards import detect_fake_mode

    val = p.meta["val"]
    mode = detect_fake_mode([val])
    with mode:
        return torch.empty_like(val, memory_format=torch.contiguous_format)


_CASTS = {torch.ops.prims.convert_element_type.default, torch.ops.aten._to_copy.default}


def _whole_copies(g: fx.Node) -> list[fx.Node]:
    """The gather and the single-input views and casts of it (a transpose for a matmul, autocast's
    bf16 copy): each is the whole parameter again, so each is recomputed in backward, never saved."""
    out, todo = [], [g]
    while todo:
        n = todo.pop()
        out.append(n)
        for u in n.users:
            if (u.op == "call_function" and len(u.all_input_nodes) == 1
                    and (u.target in _CASTS or getattr(u.target, "is_view", False))):
                todo.append(u)
    return out


@dataclass(frozen=True)
class InsertGathers:
    name: str = "insert-gathers"

    def __call__(self, graph: fx.Graph, managed: dict[fx.Node, dict], recompute: bool) -> PassReport:
        """`managed`: placeholder -> param_meta(...)."""
        from zinf_compile.runtime.ops import gather

        order = {n: i for i, n in enumerate(graph.nodes)}
        changes = []
        for p, meta in managed.items():
            p.meta["zinf"] = meta
            users = sorted(p.users, key=order.get)
            if not users:
                continue
            with graph.inserting_before(users[0]):
                # the tier argument also names the master dtype of a parameter taken over at run time
                where = meta["tier"] + (f",{meta['master']}" if meta.get("master") else "")
                g = graph.call_function(gather, (p, meta["engine"], where))
            g.meta["val"] = _fake_gather(p)
            g.meta["zinf"] = {"kind": "gather", "name": meta["name"], "pid": meta["pid"]}
            p.replace_all_uses_with(g, delete_user_cb=lambda u, g=g: u is not g)
            if recompute:
                for n in _whole_copies(g):
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            changes.append(f"gather {meta['name']} before {users[0].name}")
        graph.lint()
        return PassReport(self.name, tuple(changes), {"gathers": len(changes)} if changes else {})


@dataclass(frozen=True)
class ReduceGrads:
    name: str = "reduce-grads"

    def __call__(self, graph: fx.Graph, slots: dict[int, tuple[fx.Node, dict]]) -> PassReport:
        """Joint graph: `slots` maps a position among the outputs (a managed parameter's gradient)
        to (the parameter's placeholder, param_meta). Its gradient g is replaced there by
        reduce_grad(g, p): the parameter itself goes along (the partitioner saves it for the
        backward, free: its storage is empty), so the backward reduces into whichever instance's
        parameter the call got. After partitioning, `drop_outputs` returns None in its place."""
        from zinf_compile.runtime.ops import reduce_grad

        out = next(iter(graph.find_nodes(op="output")))
        outs = list(out.args[0])
        changes = []
        for i, (p, meta) in sorted(slots.items()):
            g = outs[i]
            if not isinstance(g, fx.Node):
                continue  # no gradient flows to this parameter
            with graph.inserting_before(out):
                r = graph.call_function(reduce_grad, (g, p))
            from torch._guards import detect_fake_mode

            with detect_fake_mode([g.meta["val"]]):
                r.meta["val"] = g.meta["val"].new_empty((0,))
            r.meta["zinf"] = {"kind": "reduce", "name": meta["name"], "pid": meta["pid"]}
            outs[i] = r
            changes.append(f"reduce-scatter the gradient of {meta['name']} ({g.name})")
        out.args = (tuple(outs),)
        graph.lint()
        return PassReport(self.name, tuple(changes), {"reduces": len(changes)} if changes else {})

    @staticmethod
    def drop_outputs(graph: fx.Graph) -> None:
        """Backward graph: None where it returns a reduce_grad's result (autograd accumulates
        nothing for a managed parameter), each reduce right after its gradient's last reader."""
        from zinf_compile.runtime.ops import reduce_grad

        out = next(iter(graph.find_nodes(op="output")))
        out.args = (tuple(None if isinstance(a, fx.Node) and a.target is reduce_grad else a
                          for a in out.args[0]),)
        SinkGathers.sink_to_producer(graph)
        graph.lint()


@dataclass(frozen=True)
class SinkGathers:
    name: str = "sink-gathers"

    def __call__(self, graph: fx.Graph) -> PassReport:
        from zinf_compile.runtime.ops import gather

        order = {n: i for i, n in enumerate(graph.nodes)}
        moved = []
        for g in list(graph.find_nodes(op="call_function", target=gather)):
            users = sorted(g.users, key=order.get)
            if users and users[0].prev is not g:
                users[0].prepend(g)
                moved.append(f"{g.name} before {users[0].name}")
        graph.lint()
        return PassReport(self.name, tuple(moved), {"moved": len(moved)} if moved else {})

    @staticmethod
    def sink_to_producer(graph: fx.Graph) -> None:
        """Each reduce_grad right after the node that makes its gradient (the gradient's last use)."""
        from zinf_compile.runtime.ops import reduce_grad

        order = {n: i for i, n in enumerate(graph.nodes)}
        for r in list(graph.find_nodes(op="call_function", target=reduce_grad)):
            g = r.args[0]
            anchor = g
            # after the last reader of g, so g dies at the reduce
            readers = [u for u in g.users if u is not r and u.op != "output"]
            if readers:
                anchor = max(readers, key=order.get)
            anchor.append(r)


@dataclass(frozen=True)
class PrefetchGathers:
    """Start each gather's shard read early enough to hide it under compute: walk back from the
    gather over the steps before it, adding their estimated time, until the read fits; never past
    the previous gather of the same graph (so at most the next few parameters are in flight), never
    across a graph. The gather becomes gather_from(p, fetch(p)); the fetched shard counts as memory
    from the fetch on (`resident_bytes` on the fetch node)."""

    name: str = "prefetch-gathers"

    def __call__(self, graph: fx.Graph, step_time, read_time, fetched_bytes) -> PassReport:
        """step_time(node) -> seconds; read_time(nbytes) -> seconds; fetched_bytes(nbytes) -> the
        device bytes a fetched shard holds until its gather (0 when it lands off the device)."""
        from zinf_compile.runtime.ops import fetch, gather, gather_from

        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        gathers = sorted(graph.find_nodes(op="call_function", target=gather), key=pos.get)
        last_placeholder = max((pos[n] for n in graph.find_nodes(op="placeholder")), default=0)
        changes = []
        floor = 0
        for g in gathers:
            p = g.args[0]
            val = p.meta["val"]
            master = p.meta.get("zinf", {}).get("master")  # the shard is read in its master dtype
            nbytes = int(val.numel()) * (getattr(torch, master).itemsize if master else val.element_size())
            need, hidden, at = read_time(nbytes), 0.0, pos[g]
            floor = max(floor, pos[p], last_placeholder)
            while at - 1 > floor and hidden < need:
                at -= 1
                if nodes[at].op == "call_function":
                    hidden += step_time(nodes[at])
            floor = pos[g]
            if at == pos[g]:
                continue
            with graph.inserting_before(nodes[at]):
                h = graph.call_function(fetch, (p, *g.args[1:]))
                h.meta["val"] = _fake_handle(val)
                h.meta["zinf"] = {"kind": "fetch", "name": g.meta["zinf"]["name"], "pid": g.meta["zinf"]["pid"],
                                  "resident_bytes": fetched_bytes(nbytes)}
            with graph.inserting_before(g):
                new = graph.call_function(gather_from, (p, h, *g.args[1:]))
            new.meta.update(g.meta)
            g.replace_all_uses_with(new)
            graph.erase_node(g)
            changes.append(f"fetch {h.meta['zinf']['name']} {pos[g] - at} nodes ahead")
        graph.lint()
        return PassReport(self.name, tuple(changes), {"fetches": len(changes)} if changes else {})


def _fake_handle(val):
    from torch._guards import detect_fake_mode

    with detect_fake_mode([val]):
        return torch.empty((1,), dtype=torch.int64, device="cpu")


def remove_param_nodes(graph: fx.Graph) -> None:
    """Undo InsertGathers/PrefetchGathers on a graph (a plan that did not fit: try another choice)."""
    from zinf_compile.runtime.ops import fetch, gather, gather_from

    for g in list(graph.find_nodes(op="call_function", target=gather)) + list(
            graph.find_nodes(op="call_function", target=gather_from)):
        g.replace_all_uses_with(g.args[0])
        graph.erase_node(g)
    for f in list(graph.find_nodes(op="call_function", target=fetch)):
        graph.erase_node(f)
    for n in graph.find_nodes(op="placeholder"):
        if n.meta.get("zinf", {}).get("kind") == "param":
            del n.meta["zinf"]


def is_gather(n: fx.Node) -> bool:
    from zinf_compile.runtime.ops import gather, gather_from

    return n.op == "call_function" and n.target in (gather, gather_from)
