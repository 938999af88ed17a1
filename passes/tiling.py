"""Memory-centric tiling: ZeRO-Infinity's TiledLinear, done by the compiler from the plan.

A matmul that reads a managed parameter gathered whole needs the whole weight on the device at
once, and the one that computes its gradient makes a whole weight-sized gradient. When that does
not fit the budget next to what must stay live, TileMatmuls splits both along the weight's rows (its
first dimension: a contiguous range of the shard, read from the tier without the rest):

    forward   y  = x  @ W.T    split N   tiles concatenated              (exact per element)
    grad x    gx = gy @ W      split K   tiles accumulated in float32   (summation order changes)
    grad W    gW = gy.T @ x    split M   each tile to reduce_grad_rows   (never whole)

Each tile reads `gather_rows(p, start, end)` right before its matmul; Inductor frees it after;
FetchAhead (the plan's fetches) then reads the next tile's rows ahead, under the current tile's compute. An
operand split along M or N of the *other* operand never shrinks the weight, so the split axis of
each matmul is the one that splits the weight's rows; the planner chooses how many tiles.

`tile_matmul` is the rewrite itself, for any mm/addmm/bmm along M, N or K.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.fx as fx

from zinf_compile import ir
from zinf_compile.ir import GatherMeta, ReduceMeta, TileMeta, emit

from .base import Graphs, Pass, PassContext

aten = torch.ops.aten
MATMULS = {aten.mm.default: "mm", aten.addmm.default: "addmm", aten.bmm.default: "bmm"}
AXES = ("M", "N", "K")
_FP32_ACC = (torch.float32, torch.float64)  # dtypes whose K tiles accumulate in place (addmm chain)


def split_bounds(n: int, count: int) -> list[tuple[int, int]]:
    """`count` (at most n) contiguous [start, end) ranges covering [0, n), sizes differing by <= 1."""
    count = max(1, min(int(count), int(n)))
    q, r = divmod(int(n), count)
    out, s = [], 0
    for i in range(count):
        e = s + q + (1 if i < r else 0)
        out.append((s, e))
        s = e
    return out


_emit = emit  # every tile node is made with its fake value


def _operands(node: fx.Node):
    """(bias or None, a, b, beta, alpha) of an mm/addmm/bmm node."""
    if node.target is aten.addmm.default:
        bias, a, b = node.args[:3]
        return bias, a, b, node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    return None, node.args[0], node.args[1], 1, 1


def _slice(graph, x: fx.Node, dim: int, s: int, e: int) -> fx.Node:
    return _emit(graph, aten.slice.Tensor, (x, dim, s, e))


def tile_matmul(graph: fx.Graph, node: fx.Node, axis: str, bounds: list[tuple[int, int]],
                a_tiles: list | None = None, b_tiles: list | None = None, combine: bool = True,
                pid: int | None = None, grad: bool = False) -> list[fx.Node]:
    """Rewrite the mm/addmm/bmm `node` into one matmul per range of `bounds` along `axis`:
    M (rows of a and of the result), N (columns of b and of the result) or K (the contraction).
    `a_tiles`/`b_tiles`: make(i, start, end) -> the node to use as that operand's i-th tile instead
    of a slice of it (a weight's rows read tile by tile), called where the tile's matmul goes, so
    each tile is made just before its use. M/N tiles are concatenated; K tiles accumulate into one float32 sum
    (in place through addmm/baddbmm for float32/64, else summed in float32 and cast back).
    `combine=False` (M/N only) leaves the tiles to the caller: the node's users are untouched
    and the node stays. Returns the tile results (M/N) or [the sum] (K), after `combine`."""
    if node.target not in MATMULS or axis not in AXES:
        raise ValueError(f"cannot tile {node.format_node()} along {axis!r}")
    if axis == "K" and not combine:
        raise ValueError("K tiles are partial sums: they must be combined")
    bias, a, b, beta, alpha = _operands(node)
    kind = MATMULS[node.target]
    d = a.meta["val"].dim()
    out_val = node.meta["val"]
    tiles: list[fx.Node] = []
    with graph.inserting_before(node):
        acc = None
        for i, (s, e) in enumerate(bounds):
            A = a_tiles(i, s, e) if a_tiles else (_slice(graph, a, d - 2, s, e) if axis == "M" else
                                                  _slice(graph, a, d - 1, s, e) if axis == "K" else a)
            B = b_tiles(i, s, e) if b_tiles else (_slice(graph, b, d - 1, s, e) if axis == "N" else
                                                  _slice(graph, b, d - 2, s, e) if axis == "K" else b)
            if axis in ("M", "N"):
                if bias is not None:
                    bv, dim = bias.meta["val"], (0 if axis == "M" else 1)
                    bdim = bv.dim() - 2 + dim  # bias broadcasts against [M, N] from the right
                    bt = _slice(graph, bias, bdim, s, e) if bdim >= 0 and bv.shape[bdim] != 1 else bias
                    y = _emit(graph, aten.addmm.default, (bt, A, B), {"beta": beta, "alpha": alpha}
                              if (beta, alpha) != (1, 1) else {})
                else:
                    y = _emit(graph, node.target, (A, B))
                tiles.append(y)
            elif out_val.dtype in _FP32_ACC:
                if acc is None:
                    acc = (_emit(graph, aten.addmm.default, (bias, A, B), {"beta": beta, "alpha": alpha}
                                 if (beta, alpha) != (1, 1) else {}) if bias is not None
                           else _emit(graph, node.target, (A, B)))
                else:
                    acc_op = aten.baddbmm.default if kind == "bmm" else aten.addmm.default
                    acc = _emit(graph, acc_op, (acc, A, B), {"alpha": alpha} if alpha != 1 else {})
                tiles.append(acc)
            else:
                product = aten.bmm.default if kind == "bmm" else aten.mm.default
                part = _emit(graph, torch.ops.prims.convert_element_type.default,
                             (_emit(graph, product, (A, B)), torch.float32))
                acc = part if acc is None else _emit(graph, aten.add.Tensor, (acc, part))
                tiles.append(acc)
        for i, y in enumerate(tiles):
            ir.mark(y, TileMeta(node.name, kind, axis, i, len(bounds), tuple(bounds[i]), pid, grad))
        if not combine:
            return tiles
        if axis in ("M", "N"):
            out = _emit(graph, aten.cat.default, (tiles, (d - 2) if axis == "M" else (d - 1)))
        elif out_val.dtype in _FP32_ACC:
            out = acc
        else:
            if alpha != 1:
                acc = _emit(graph, aten.mul.Tensor, (acc, alpha))
            if bias is not None:
                b32 = _emit(graph, torch.ops.prims.convert_element_type.default, (bias, torch.float32))
                acc = _emit(graph, aten.add.Tensor, (acc, b32), {"alpha": beta} if beta != 1 else {})
            out = _emit(graph, torch.ops.prims.convert_element_type.default, (acc, out_val.dtype))
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    return [out] if axis == "K" else tiles


# -- the weight's side: which matmuls read a gathered parameter, along which of its dimensions ------

def _is_transpose(n: fx.Node) -> bool:
    """A 2-d transpose: t, transpose(0, 1), permute([1, 0])."""
    if n.op != "call_function":
        return False
    if n.target is aten.t.default:
        return True
    if n.target is aten.transpose.int:
        return sorted(int(x) % 2 for x in n.args[1:3]) == [0, 1] and n.args[0].meta["val"].dim() == 2
    if n.target is aten.permute.default:
        return list(n.args[1]) in ([1, 0], [-1, -2], [1, -2], [-1, 0])
    return False


_CASTS = (torch.ops.prims.convert_element_type.default, aten._to_copy.default)


def _is_cast(n: fx.Node) -> bool:
    """A dtype cast of one tensor (autocast's bf16 copy of a weight)."""
    return n.op == "call_function" and n.target in _CASTS and len(n.all_input_nodes) == 1


def _is_link(n: fx.Node) -> bool:
    """A node between a weight's gather and its matmul that a tile goes through the same way."""
    return _is_transpose(n) or _is_cast(n)


def weight_uses(g: fx.Node) -> list[tuple[fx.Node, fx.Node, str]]:
    """The matmuls reading the gathered weight `g` (2-d) through transposes and casts only:
    (matmul, the operand node it reads, the axis that splits the weight's rows). Other users are
    not listed."""
    out, todo = [], [(g, 0)]
    while todo:
        v, flips = todo.pop()
        for u in v.users:
            if _is_link(u):
                todo.append((u, flips + _is_transpose(u)))
            elif u.op == "call_function" and u.target in (aten.mm.default, aten.addmm.default):
                _, a, b, _, _ = _operands(u)
                if a is v and b is not v:
                    out.append((u, v, "M" if flips % 2 == 0 else "K"))
                elif b is v and a is not v:
                    out.append((u, v, "K" if flips % 2 == 0 else "N"))
    return out


def grad_source(r: fx.Node) -> tuple[fx.Node, str, list] | None:
    """For reduce_grad(gW, p): the matmul that computes gW through transposes and casts only, the
    axis that splits the weight's rows in it, and the casts on the way (from the matmul out);
    None when gW comes otherwise (a sum of two uses' gradients, say) or the matmul's result is
    read by anything else."""
    v, flips, casts = r.args[0], 0, []
    while isinstance(v, fx.Node) and _is_link(v) and len(v.users) == 1:
        if _is_cast(v):
            casts.insert(0, v)
        flips += _is_transpose(v)
        v = v.args[0]
    if not (isinstance(v, fx.Node) and v.target is aten.mm.default and len(v.users) == 1):
        return None
    return v, ("M" if flips % 2 == 0 else "N"), casts


@dataclass(frozen=True)
class Candidate:
    """A managed parameter whose matmuls tiling can split (read off one graph)."""

    pid: int
    name: str
    rows: int
    nbytes: int  # the gathered weight
    uses: tuple = field(default=())  # matmul nodes reading its whole gather
    grads: tuple = field(default=())  # matmul nodes computing its whole gradient
    others: tuple = field(default=())  # names of other readers of the whole gather (they keep it)
    k_bytes: int = 0  # output bytes of its uses split along K: each tile re-reads and re-writes them
    shape: tuple[int, ...] = ()  # the weight's
    axes: tuple = field(default=())  # (matmul node, the axis that splits the weight's rows) per use and grad


def candidates(graph: fx.Graph) -> dict[int, Candidate]:
    """The managed 2-d parameters this graph gathers whole (one rank) or reduces whole, with the
    matmuls tiling would split."""
    from zinf_compile.analysis.sizes import tensor_nbytes
    from zinf_compile.runtime.ops import gather, reduce_grad

    found: dict[int, dict] = {}

    def slot(p: fx.Node) -> dict | None:
        val, z = p.meta.get("val"), ir.param(p)
        if not isinstance(val, torch.Tensor) or val.dim() != 2 or z is None:
            return None
        return found.setdefault(z.pid, {"pid": z.pid, "name": z.name, "rows": int(val.shape[0]),
                                           "nbytes": int(val.numel()) * val.element_size(),
                                           "uses": [], "grads": [], "others": [], "k_bytes": 0,
                                           "shape": tuple(int(x) for x in val.shape), "axes": []})

    for g in graph.find_nodes(op="call_function", target=gather):
        c = slot(g.args[0])
        if c is None:
            continue
        uses = weight_uses(g)
        c["uses"] += [m for m, _, _ in uses]
        c["axes"] += [(m, axis) for m, _, axis in uses]
        c["k_bytes"] += sum(int(tensor_nbytes(m.meta["val"])) for m, _, axis in uses if axis == "K")
        reached = {v for _, v, _ in uses}
        c["others"] += [u.name for v in [g, *reached] for u in v.users
                        if u not in {m for m, _, _ in uses} and not _is_link(u)]
    for r in graph.find_nodes(op="call_function", target=reduce_grad):
        p = r.args[1]
        c = slot(p) if isinstance(p, fx.Node) else None
        src = grad_source(r) if c is not None else None
        if src is not None:
            c["grads"].append(src[0])
            c["axes"].append((src[0], src[1]))
    return {pid: Candidate(c["pid"], c["name"], c["rows"], c["nbytes"], tuple(c["uses"]), tuple(c["grads"]),
                           tuple(c["others"]), c["k_bytes"], c["shape"], tuple(c["axes"]))
            for pid, c in found.items() if c["uses"] or c["grads"]}


def merged_candidates(graphs) -> dict[int, Candidate]:
    """`candidates` of several graphs (the forward's uses and the backward's), merged per weight."""
    import dataclasses

    out: dict[int, Candidate] = {}
    for gm in graphs:
        for pid, c in candidates(gm.graph).items():
            out[pid] = c if pid not in out else dataclasses.replace(
                out[pid], uses=out[pid].uses + c.uses, grads=out[pid].grads + c.grads,
                others=out[pid].others + c.others, k_bytes=out[pid].k_bytes + c.k_bytes,
                axes=out[pid].axes + c.axes)
    return out


@dataclass(frozen=True)
class TileMatmuls(Pass):
    """Split the matmuls of each parameter in `tiles` ((pid, row ranges), from the plan) tile by
    tile: the weight's rows gathered per tile, the gradient's rows reduced per tile."""

    name: ClassVar[str] = "tile-matmuls"
    tiles: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()

    def apply(self, graphs: Graphs, ctx: PassContext) -> Any:
        changes, n_tiles = [], 0
        for gm in graphs.values():
            c, n = self._tile(gm.graph, {pid: list(b) for pid, b in self.tiles})
            changes += c
            n_tiles += n
        return self.report(changes, tiles=n_tiles)

    @staticmethod
    def _tile(graph: fx.Graph, tiles: dict[int, list[tuple[int, int]]]) -> tuple[list[str], int]:
        from zinf_compile.runtime.ops import gather, gather_rows, reduce_grad, reduce_grad_rows

        changes, n_tiles = [], 0
        for g in list(graph.find_nodes(op="call_function", target=gather)):
            p = g.args[0]
            z = ir.param(p)
            bounds = tiles.get(z.pid) if z is not None else None
            if not bounds or p.meta["val"].dim() != 2:
                continue
            for m, v, axis in weight_uses(g):
                chain = []  # the transposes and casts from the gather to the operand, for each tile
                x = v
                while x is not g:
                    chain.insert(0, x)
                    x = x.args[0]

                def rows(i, s, e, p=p, g=g, z=z, chain=chain):
                    t = _emit(graph, gather_rows, (p, *g.args[1:3], s, e))
                    ir.mark(t, GatherMeta(z.pid, z.name, rows=(s, e)))
                    for x in chain:  # the same op on the tile (permute for t: Inductor has no t)
                        t = _transpose(graph, t) if _is_transpose(x) else _emit(graph, x.target, (t, *x.args[1:]),
                                                                                 dict(x.kwargs))
                    return t

                _, a, _, _, _ = _operands(m)
                name = m.name
                if v is a:
                    tile_matmul(graph, m, axis, bounds, a_tiles=rows, pid=z.pid)
                else:
                    tile_matmul(graph, m, axis, bounds, b_tiles=rows, pid=z.pid)
                n_tiles += len(bounds)
                changes.append(f"{name}: {len(bounds)} tiles along {axis}, rows of {z.name} gathered per tile")
            _erase_dead(graph, g)
        for r in list(graph.find_nodes(op="call_function", target=reduce_grad)):
            p = r.args[1]
            z = ir.param(p) if isinstance(p, fx.Node) else None
            bounds = tiles.get(z.pid) if z is not None else None
            src = grad_source(r) if bounds else None
            if src is None:
                continue
            m, axis, casts = src
            name = m.name
            parts = tile_matmul(graph, m, axis, bounds, combine=False, pid=z.pid, grad=True)
            for (s, e), y in zip(bounds, parts):
                w = y
                for x in casts + [None] * (axis == "N"):  # the gradient's casts, then rows first
                    with graph.inserting_after(w):
                        w = _transpose(graph, w) if x is None else _emit(graph, x.target, (w, *x.args[1:]),
                                                                         dict(x.kwargs))
                with graph.inserting_after(w):
                    red = _emit(graph, reduce_grad_rows, (w, p, s, e))
                ir.mark(red, ReduceMeta(z.pid, z.name, getattr(ir.meta(r), "slot", -1), rows=(s, e)))
            graph.erase_node(r)
            _erase_dead(graph, m)
            n_tiles += len(bounds)
            changes.append(f"{name}: gradient of {z.name} in {len(bounds)} tiles along {axis}, each reduced "
                           "into its rows")
        return changes, n_tiles


def _transpose(graph: fx.Graph, x: fx.Node) -> fx.Node:
    # permute, not t: Inductor's graphs are decomposed (it has no lowering for aten.t)
    return _emit(graph, aten.permute.default, (x, [1, 0]))


def _erase_dead(graph: fx.Graph, n: fx.Node) -> None:
    """Once nothing reads n: erase the transposes hanging off n that nothing reads, n, and the
    transposes feeding n that nothing else reads."""
    def dead_below(x: fx.Node) -> None:
        for u in list(x.users):
            if _is_link(u):
                dead_below(u)
                if not u.users:
                    graph.erase_node(u)

    dead_below(n)
    while n is not None and not n.users and n.op == "call_function":
        ins = n.all_input_nodes
        graph.erase_node(n)
        n = ins[0] if len(ins) == 1 and _is_link(ins[0]) else None
