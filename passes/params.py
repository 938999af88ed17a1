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


def stored_nbytes(numel: int, itemsize: int, master: str | None) -> int:
    """Bytes of a parameter's data as stored in its tier: in its master dtype when it has one."""
    return int(numel) * (getattr(torch, master).itemsize if master else itemsize)


def partition_with_params(partition_fn, gm: fx.GraphModule, joint_inputs, kwargs: dict, managed: dict[int, dict],
                          allreduce: list[int] = (), world: int = 1):
    """Partition a joint graph whose primals `managed` (primal index -> param_meta) are managed
    parameters: gathers in, partition (gathers recomputed in backward), gradients to reduce_grad,
    gathers next to their uses. The gradients of primals `allreduce` (resident parameters over
    `world` > 1 ranks) are averaged over the ranks. Returns (forward, backward, reports)."""
    reports = []
    if managed:
        primals = [n for n in gm.graph.find_nodes(op="placeholder") if not n.name.startswith("tangents")]
        reports.append(InsertGathers()(gm.graph, {primals[i]: m for i, m in managed.items()}, recompute=True,
                                       world=world))
        # the joint graph returns the forward's outputs, then one gradient per primal, in order
        nfo = kwargs["num_fwd_outputs"]
        reports.append(ReduceGrads()(gm.graph, {nfo + i: (primals[i], m) for i, m in managed.items()
                                                if m["requires_grad"]}, world=world))
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
GATHER_PARTS = ("shard", "gather-part", "gather")  # node.meta["zinf"]["kind"] along a gather


def _group_name() -> str:
    from torch.distributed.distributed_c10d import _get_default_group

    return _get_default_group().group_name


def _all_gather_chain(graph: fx.Graph, p: fx.Node, meta: dict, where: str, world: int) -> list[fx.Node]:
    """shard(p) -> all_gather_into_tensor -> wait_tensor -> slice(numel) -> view(shape), each
    with its fake value; the last is the whole parameter."""
    from torch._guards import detect_fake_mode

    from zinf_compile.runtime.ops import shard

    c10d = torch.ops._c10d_functional
    val = p.meta["val"]
    numel, group = int(val.numel()), _group_name()
    steps = [(shard, lambda prev: (p, meta["engine"], where)),
             (c10d.all_gather_into_tensor.default, lambda prev: (prev, world, group)),
             (c10d.wait_tensor.default, lambda prev: (prev,)),
             (torch.ops.aten.slice.Tensor, lambda prev: (prev, 0, 0, numel)),
             (torch.ops.aten.view.default, lambda prev: (prev, list(val.shape)))]
    chain: list[fx.Node] = []
    with detect_fake_mode([val]):
        for target, args in steps:
            n = graph.call_function(target, args(chain[-1] if chain else None))
            fake_args = [a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args]
            n.meta["val"] = target(*fake_args)
            n.meta["zinf"] = {"kind": "shard" if not chain else "gather-part", "name": meta["name"],
                              "pid": meta["pid"]}
            chain.append(n)
    return chain


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


def _refresh_views(g: fx.Node) -> None:
    """The views and casts of a gather were traced on the parameter: their fake values alias the
    parameter's storage, so the analysis would count the gathered tensor dead at its first view
    (before the matmul that reads the view). Recompute them from the gather's value."""
    from torch._guards import detect_fake_mode

    for n in _whole_copies(g)[1:]:  # breadth-first from g: a node's input is refreshed first
        args = fx.node.map_arg(n.args, lambda a: a.meta["val"])
        kwargs = fx.node.map_arg(n.kwargs, lambda a: a.meta["val"])
        with detect_fake_mode([g.meta["val"]]):
            n.meta["val"] = n.target(*args, **kwargs)


@dataclass(frozen=True)
class InsertGathers:
    name: str = "insert-gathers"

    def __call__(self, graph: fx.Graph, managed: dict[fx.Node, dict], recompute: bool, world: int = 1) -> PassReport:
        """`managed`: placeholder -> param_meta(...). Over `world` > 1 ranks the gather is
        shard(p) -> all_gather_into_tensor -> wait_tensor -> slice -> view, with torch's
        functional collectives, which Inductor schedules."""
        from zinf_compile.runtime.ops import gather

        order = {n: i for i, n in enumerate(graph.nodes)}
        changes = []
        for p, meta in managed.items():
            p.meta["zinf"] = meta
            users = sorted(p.users, key=order.get)
            if not users:
                continue
            # the tier argument also names the master dtype of a parameter taken over at run time
            where = meta["tier"] + (f",{meta['master']}" if meta.get("master") else "")
            with graph.inserting_before(users[0]):
                if world > 1:
                    chain = _all_gather_chain(graph, p, meta, where, world)
                else:
                    chain = [graph.call_function(gather, (p, meta["engine"], where))]
                    chain[0].meta["val"] = _fake_gather(p)
            g = chain[-1]
            g.meta["zinf"] = {"kind": "gather", "name": meta["name"], "pid": meta["pid"]}
            p.replace_all_uses_with(g, delete_user_cb=lambda u, c=chain: u is not c[0])
            _refresh_views(g)
            if recompute:
                for n in chain[:-1] + _whole_copies(g):
                    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            changes.append(f"gather {meta['name']} before {users[0].name}")
        graph.lint()
        return PassReport(self.name, tuple(changes), {"gathers": len(changes)} if changes else {})


@dataclass(frozen=True)
class ReduceGrads:
    name: str = "reduce-grads"

    def __call__(self, graph: fx.Graph, slots: dict[int, tuple[fx.Node, dict]], world: int = 1) -> PassReport:
        """Joint graph: `slots` maps a position among the outputs (a managed parameter's gradient)
        to (the parameter's placeholder, param_meta). Its gradient g is replaced there by
        reduce_grad(g, p), or over `world` > 1 ranks by flat, padded g -> reduce_scatter_tensor
        (functional, sum) -> wait_tensor -> store_grad(part, p). The parameter itself goes along
        (the partitioner saves it for the backward, free: its storage is empty), so the backward
        reduces into whichever instance's parameter the call got. After partitioning,
        `drop_outputs` returns None in its place."""
        from torch._guards import detect_fake_mode

        from zinf_compile.runtime.ops import reduce_grad, store_grad

        out = next(iter(graph.find_nodes(op="output")))
        outs = list(out.args[0])
        changes = []
        for i, (p, meta) in sorted(slots.items()):
            g = outs[i]
            if not isinstance(g, fx.Node):
                continue  # no gradient flows to this parameter
            val = g.meta["val"]
            with graph.inserting_before(out), detect_fake_mode([val]):
                if world > 1:
                    numel = int(val.numel())
                    pad = -(-numel // world) * world - numel
                    aten, c10d = torch.ops.aten, torch.ops._c10d_functional
                    steps = []
                    if not val.is_contiguous():
                        steps.append((aten.clone.default, lambda x: (x,), {"memory_format": torch.contiguous_format}))
                    steps += [(aten.view.default, lambda x: (x, [-1]), {}),
                              (aten.constant_pad_nd.default, lambda x: (x, [0, pad]), {}),
                              (c10d.reduce_scatter_tensor.default, lambda x: (x, "sum", world, _group_name()), {}),
                              (c10d.wait_tensor.default, lambda x: (x,), {}),
                              (store_grad, lambda x: (x, p), {})]
                    x = g
                    for target, args, kwargs in steps:
                        x = graph.call_function(target, args(x), kwargs)
                        fake = [a.meta["val"] if isinstance(a, fx.Node) else a for a in x.args]
                        x.meta["val"] = target(*fake, **kwargs)
                        x.meta["zinf"] = {"kind": "reduce-part", "name": meta["name"], "pid": meta["pid"]}
                    r = x
                else:
                    r = graph.call_function(reduce_grad, (g, p))
                    r.meta["val"] = val.new_empty((0,))
            r.meta["zinf"] = {"kind": "reduce", "name": meta["name"], "pid": meta["pid"]}
            outs[i] = r
            changes.append(f"reduce-scatter the gradient of {meta['name']} ({g.name})")
        out.args = (tuple(outs),)
        graph.lint()
        return PassReport(self.name, tuple(changes), {"reduces": len(changes)} if changes else {})

    @staticmethod
    def drop_outputs(graph: fx.Graph) -> None:
        """Backward graph: None where it returns a reduce's result (autograd accumulates nothing
        for a managed parameter), each reduce right after its gradient's last reader."""
        from zinf_compile.runtime.ops import REDUCES

        out = next(iter(graph.find_nodes(op="output")))
        out.args = (tuple(None if isinstance(a, fx.Node) and a.target in REDUCES else a
                          for a in out.args[0]),)
        SinkGathers.sink_to_producer(graph)
        graph.lint()


@dataclass(frozen=True)
class SinkGathers:
    name: str = "sink-gathers"

    def __call__(self, graph: fx.Graph) -> PassReport:
        # last first: each part of a gather lands before its (already moved) first user
        parts = [n for n in graph.nodes if n.meta.get("zinf", {}).get("kind") in GATHER_PARTS]
        moved = []
        for g in reversed(parts):
            order = {n: i for i, n in enumerate(graph.nodes)} if not moved else order
            users = sorted(g.users, key=lambda u: order.get(u, 0))
            if users and users[0].prev is not g:
                users[0].prepend(g)
                moved.append(f"{g.name} before {users[0].name}")
                order = {n: i for i, n in enumerate(graph.nodes)}
        graph.lint()
        return PassReport(self.name, tuple(moved), {"moved": len(moved)} if moved else {})

    @staticmethod
    def sink_to_producer(graph: fx.Graph) -> None:
        """Each reduce (with the collectives feeding it) right after the last reader of its
        gradient, so the gradient dies there."""
        from zinf_compile.runtime.ops import REDUCES

        order = {n: i for i, n in enumerate(graph.nodes)}
        ends = [n for n in graph.nodes if n.op == "call_function" and n.target in REDUCES]
        for r in ends:
            chain = [r]
            while chain[0].args and isinstance(chain[0].args[0], fx.Node) and \
                    chain[0].args[0].meta.get("zinf", {}).get("kind") == "reduce-part":
                chain.insert(0, chain[0].args[0])
            g = chain[0].args[0]
            readers = [u for u in g.users if u not in chain and u.op != "output"]
            anchor = max(readers, key=order.get) if readers else g
            for n in chain:
                anchor.append(n)
                anchor = n


@dataclass(frozen=True)
class PrefetchGathers:
    """Start each gather's shard read early enough to hide it under compute: walk back from the
    gather over the steps before it, adding their estimated time, until the read fits; never past
    the previous gather of the same graph (so at most the next few parameters are in flight), never
    across a graph. The gather becomes gather_from(p, fetch(p)); the fetched shard counts as memory
    from the fetch on (`resident_bytes` on the fetch node). With `room` (node -> the bytes free at
    its step without the fetches, or None), a fetch holding memory spans only steps with room for
    it: it starts later, or not at all where even its gather's step has none."""

    name: str = "prefetch-gathers"

    def __call__(self, graph: fx.Graph, step_time, read_time, fetched_bytes, room=None) -> PassReport:
        """step_time(node) -> seconds; read_time(nbytes) -> seconds; fetched_bytes(nbytes) -> the
        device bytes a fetched shard holds until its gather (0 when it lands off the device)."""
        from zinf_compile.runtime.ops import (fetch, fetch_rows, gather, gather_from, gather_rows, gather_rows_from,
                                              shard, shard_from)

        nodes = list(graph.nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        gathers = sorted([*graph.find_nodes(op="call_function", target=gather),
                          *graph.find_nodes(op="call_function", target=gather_rows),
                          *graph.find_nodes(op="call_function", target=shard)], key=pos.get)
        fetch_of = {gather: fetch, shard: fetch, gather_rows: fetch_rows}
        finish_of = {gather: gather_from, shard: shard_from, gather_rows: gather_rows_from}
        last_placeholder = max((pos[n] for n in graph.find_nodes(op="placeholder")), default=0)
        changes = []
        floor = 0
        held_back = 0  # fetches started later than the read needs, or not at all, for want of room
        for g in gathers:
            p = g.args[0]
            val = p.meta["val"]
            nbytes = stored_nbytes(val.numel(), val.element_size(), p.meta.get("zinf", {}).get("master"))
            if g.target is gather_rows:  # a tile: rows [start, end) of the weight
                nbytes = nbytes // val.shape[0] * (g.args[4] - g.args[3])
            need, hidden, at = read_time(nbytes), 0.0, pos[g]
            held = fetched_bytes(nbytes)

            def fits(n) -> bool:
                free = room(n) if room is not None and held else None
                return free is None or free >= held

            floor = max(floor, pos[p], last_placeholder)
            room_at_gather = fits(g)  # the fetched shard and the gathered weight meet there
            while at - 1 > floor and hidden < need:
                if not room_at_gather or not fits(nodes[at - 1]):
                    held_back += 1
                    break
                at -= 1
                if nodes[at].op == "call_function":
                    hidden += step_time(nodes[at])
            floor = pos[g]
            if at == pos[g]:
                continue
            with graph.inserting_before(nodes[at]):
                h = graph.call_function(fetch_of[g.target], (p, *g.args[1:]))
                h.meta["val"] = _fake_handle(val)
                h.meta["zinf"] = {"kind": "fetch", "name": g.meta["zinf"]["name"], "pid": g.meta["zinf"]["pid"],
                                  "resident_bytes": fetched_bytes(nbytes)}
            with graph.inserting_before(g):
                new = graph.call_function(finish_of[g.target], (p, h, *g.args[1:]))
            new.meta.update(g.meta)
            g.replace_all_uses_with(new)
            graph.erase_node(g)
            changes.append(f"fetch {h.meta['zinf']['name']} {pos[g] - at} nodes ahead")
        graph.lint()
        counts = {"fetches": len(changes)} if changes else {}
        if held_back:
            counts["held back for room"] = held_back
        return PassReport(self.name, tuple(changes), counts)


def _fake_handle(val):
    from torch._guards import detect_fake_mode

    with detect_fake_mode([val]):
        return torch.empty((1,), dtype=torch.int64, device="cpu")


def saved_whole_parameters(fw: fx.GraphModule) -> list[str]:
    """The forward's outputs (saved for backward) that are a gathered parameter, or a chain of
    single-input ops from one (the all-gather, its wait, views, casts): what must never be saved."""
    out = next(iter(fw.graph.find_nodes(op="output")))
    found = []
    for a in out.args[0]:
        n = a
        while isinstance(n, fx.Node) and n.op == "call_function" and not is_gather(n) and len(n.all_input_nodes) == 1:
            n = n.all_input_nodes[0]
        if isinstance(n, fx.Node) and is_gather(n):
            found.append(a.name)
    return found


def is_gather(n: fx.Node) -> bool:
    """A node that reads a managed parameter from its tier (whole, or this rank's shard)."""
    from zinf_compile.runtime.ops import gather, gather_from, gather_rows, gather_rows_from, shard, shard_from

    return n.op == "call_function" and n.target in (gather, gather_from, shard, shard_from, gather_rows,
                                                    gather_rows_from)
