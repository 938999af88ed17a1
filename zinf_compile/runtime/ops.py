"""The `zinf::` custom ops the passes insert. Each has a fake impl so graphs trace and compile.

    offload(x, engine, dim_order)                      -> handle   (x leaves the device)
    prefetch(h, engine, device)                        -> handle   (the read starts)
    wait(h, engine, dtype, device, dim_order)          -> tensor   (the read is joined)
    gather(p, engine, tier)                            -> tensor   (a managed parameter, whole)
    reduce_grad(g, p)                                  -> empty    (g into p's gradient shard)
    fetch(p, engine, tier)                             -> handle   (p's shard read starts)
    gather_from(p, h, engine, tier)                    -> tensor   (gather, from the fetched shard)
    gather_rows(p, engine, tier, start, end)           -> tensor   (rows [start, end) of p: a tile)
    fetch_rows(p, engine, tier, start, end)            -> handle   (the tile's read starts)
    gather_rows_from(p, h, engine, tier, start, end)   -> tensor   (the tile, from the fetch)
    reduce_grad_rows(g, p, start, end)                 -> empty    (g: the gradient of those rows)

A handle is an int64 tensor shaped like the tensor it stands for, with all strides 0 (one element
in memory): see engine.py.
"""
from __future__ import annotations

import torch

from zinf_compile.runtime.engine import inverse_order
from zinf_compile.runtime.state import STORE, get_engine

_lib = torch.library.Library("zinf", "DEF")
_lib.define("offload(Tensor x, int engine, int[] dim_order) -> Tensor")
_lib.define("prefetch(Tensor h, int engine, Device device) -> Tensor")
_lib.define("wait(Tensor h, int engine, ScalarType dtype, Device device, int[] dim_order) -> Tensor")
# gather is pure for the graph (the same parameter gives the same value), so the partitioner may
# recompute it in the backward; reduce_grad returns nothing and must never be removed.
# A parameter is found by its storage; one the store does not manage yet (another instance of a
# model whose compiled graph Dynamo reuses) is taken over on first use, into `tier` via `engine`.
_lib.define("gather(Tensor p, int engine, str tier) -> Tensor")
# reduce_grad returns an empty tensor that nothing reads (the backward returns None in its place)
_lib.define("reduce_grad(Tensor g, Tensor p) -> Tensor")
# fetch starts reading a parameter's shard ahead of its gather; gather_from finishes it
_lib.define("fetch(Tensor p, int engine, str tier) -> Tensor")
_lib.define("gather_from(Tensor p, Tensor h, int engine, str tier) -> Tensor")
# Over several ranks the graph itself all-gathers and reduce-scatters (functional collectives
# Inductor knows): shard returns this rank's padded flat shard on the device, store_grad takes this
# rank's reduce-scattered sum of the gradient.
_lib.define("shard(Tensor p, int engine, str tier) -> Tensor")
_lib.define("shard_from(Tensor p, Tensor h, int engine, str tier) -> Tensor")
_lib.define("store_grad(Tensor part, Tensor p) -> Tensor")
# Memory-centric tiling: rows [start, end) of a parameter (a contiguous range of its shard), read
# without the rest; a tile's gradient goes into the same rows of the gradient shard.
_lib.define("gather_rows(Tensor p, int engine, str tier, int start, int end) -> Tensor")
_lib.define("fetch_rows(Tensor p, int engine, str tier, int start, int end) -> Tensor")
_lib.define("gather_rows_from(Tensor p, Tensor h, int engine, str tier, int start, int end) -> Tensor")
_lib.define("reduce_grad_rows(Tensor g, Tensor p, int start, int end) -> Tensor")


def _fake_handle(shape) -> torch.Tensor:
    return torch.empty((1,), dtype=torch.int64, device="cpu").expand(*shape) if len(shape) else torch.empty(
        (), dtype=torch.int64, device="cpu"
    )


@torch.library.impl(_lib, "offload", "CompositeExplicitAutograd")
def _offload(x: torch.Tensor, engine_key: int, dim_order: list[int]) -> torch.Tensor:
    return get_engine(engine_key).offload(x, list(dim_order))


@torch.library.register_fake("zinf::offload", lib=_lib)
def _offload_fake(x, engine_key, dim_order):
    return _fake_handle(x.shape)


@torch.library.impl(_lib, "prefetch", "CompositeExplicitAutograd")
def _prefetch(h: torch.Tensor, engine_key: int, device: torch.device) -> torch.Tensor:
    return get_engine(engine_key).prefetch(h, device)


@torch.library.register_fake("zinf::prefetch", lib=_lib)
def _prefetch_fake(h, engine_key, device):
    return _fake_handle(h.shape)


@torch.library.impl(_lib, "wait", "CompositeExplicitAutograd")
def _wait(h, engine_key, dtype, device, dim_order):
    return get_engine(engine_key).wait(h, device, list(dim_order))


@torch.library.register_fake("zinf::wait", lib=_lib)
def _wait_fake(h, engine_key, dtype, device, dim_order):
    stored_shape = [h.shape[d] for d in dim_order]
    return torch.empty(stored_shape, dtype=dtype, device=device).permute(inverse_order(dim_order))


@torch.library.impl(_lib, "gather", "CompositeExplicitAutograd")
def _gather(p, engine, tier):
    return STORE.gather(p, engine, tier)


def _whole_fake(p, *_):
    """gather, gather_from: the whole parameter, fresh and contiguous."""
    return torch.empty_like(p, memory_format=torch.contiguous_format)


def _no_result_fake(x, *_):
    """reduce_grad, store_grad, reduce_grad_rows: an empty tensor nothing reads."""
    return x.new_empty((0,))


torch.library.register_fake("zinf::gather", _whole_fake, lib=_lib)


@torch.library.impl(_lib, "reduce_grad", "CompositeExplicitAutograd")
def _reduce_grad(g, p):
    STORE.reduce_grad(p, g)
    return g.new_empty((0,))


torch.library.register_fake("zinf::reduce_grad", _no_result_fake, lib=_lib)


@torch.library.impl(_lib, "fetch", "CompositeExplicitAutograd")
def _fetch(p, engine, tier):
    return STORE.fetch(p, engine, tier)


def _ticket_fake(*_):
    """fetch, fetch_rows: a one-element int64 handle on the CPU."""
    return torch.empty((1,), dtype=torch.int64, device="cpu")


torch.library.register_fake("zinf::fetch", _ticket_fake, lib=_lib)


@torch.library.impl(_lib, "gather_from", "CompositeExplicitAutograd")
def _gather_from(p, h, engine, tier):
    return STORE.gather_from(p, h, engine, tier)


torch.library.register_fake("zinf::gather_from", _whole_fake, lib=_lib)


def _shard_fake(p, *_):
    from zinf_compile.runtime.params import world

    n = -(-p.numel() // world()[1])
    return p.new_empty((n,))


@torch.library.impl(_lib, "shard", "CompositeExplicitAutograd")
def _shard(p, engine, tier):
    return STORE.local_shard(p, engine, tier)


torch.library.register_fake("zinf::shard", _shard_fake, lib=_lib)


@torch.library.impl(_lib, "shard_from", "CompositeExplicitAutograd")
def _shard_from(p, h, engine, tier):
    return STORE.local_shard(p, engine, tier, handle=h)


torch.library.register_fake("zinf::shard_from", _shard_fake, lib=_lib)


@torch.library.impl(_lib, "store_grad", "CompositeExplicitAutograd")
def _store_grad(part, p):
    STORE.store_grad(p, part)
    return part.new_empty((0,))


torch.library.register_fake("zinf::store_grad", _no_result_fake, lib=_lib)


def _rows_fake(p, *args):
    """gather_rows, gather_rows_from: rows [start, end) of the parameter, fresh and contiguous."""
    start, end = args[-2:]
    return p.new_empty((end - start, *p.shape[1:]))


@torch.library.impl(_lib, "gather_rows", "CompositeExplicitAutograd")
def _gather_rows(p, engine, tier, start, end):
    return STORE.gather(p, engine, tier, rows=(start, end))


torch.library.register_fake("zinf::gather_rows", _rows_fake, lib=_lib)


@torch.library.impl(_lib, "fetch_rows", "CompositeExplicitAutograd")
def _fetch_rows(p, engine, tier, start, end):
    return STORE.fetch(p, engine, tier, rows=(start, end))


torch.library.register_fake("zinf::fetch_rows", _ticket_fake, lib=_lib)


@torch.library.impl(_lib, "gather_rows_from", "CompositeExplicitAutograd")
def _gather_rows_from(p, h, engine, tier, start, end):
    return STORE.gather_from(p, h, engine, tier, rows=(start, end))


torch.library.register_fake("zinf::gather_rows_from", _rows_fake, lib=_lib)


@torch.library.impl(_lib, "reduce_grad_rows", "CompositeExplicitAutograd")
def _reduce_grad_rows(g, p, start, end):
    STORE.reduce_grad(p, g, rows=(start, end))
    return g.new_empty((0,))


torch.library.register_fake("zinf::reduce_grad_rows", _no_result_fake, lib=_lib)


offload = torch.ops.zinf.offload.default
prefetch = torch.ops.zinf.prefetch.default
wait = torch.ops.zinf.wait.default
gather = torch.ops.zinf.gather.default
reduce_grad = torch.ops.zinf.reduce_grad.default
fetch = torch.ops.zinf.fetch.default
gather_from = torch.ops.zinf.gather_from.default
shard = torch.ops.zinf.shard.default
shard_from = torch.ops.zinf.shard_from.default
store_grad = torch.ops.zinf.store_grad.default
gather_rows = torch.ops.zinf.gather_rows.default
fetch_rows = torch.ops.zinf.fetch_rows.default
gather_rows_from = torch.ops.zinf.gather_rows_from.default
reduce_grad_rows = torch.ops.zinf.reduce_grad_rows.default
torch.fx.node.has_side_effect(reduce_grad)
torch.fx.node.has_side_effect(store_grad)
torch.fx.node.has_side_effect(reduce_grad_rows)
ZINF_OPS = (offload, prefetch, wait, gather, reduce_grad, fetch, gather_from, shard, shard_from, store_grad,
            gather_rows, fetch_rows, gather_rows_from, reduce_grad_rows)
REDUCES = (reduce_grad, store_grad, reduce_grad_rows)  # a gradient into its shard: returns nothing read
