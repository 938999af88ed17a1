"""The `zinf::` custom ops the passes insert. Each has a fake impl so graphs trace and compile.

    offload(x, engine, dim_order)                      -> handle   (x leaves the device)
    prefetch(h, engine, device)                        -> handle   (the read starts)
    wait(h, engine, dtype, device, dim_order)          -> tensor   (the read is joined)

A handle is an int64 tensor shaped like the tensor it stands for, with all strides 0 (one element
in memory): see engine.py.
"""
from __future__ import annotations

import torch

from zinf_compile.runtime.engine import get_engine, inverse_order

_lib = torch.library.Library("zinf", "DEF")
_lib.define("offload(Tensor x, int engine, int[] dim_order) -> Tensor")
_lib.define("prefetch(Tensor h, int engine, Device device) -> Tensor")
_lib.define("wait(Tensor h, int engine, ScalarType dtype, Device device, int[] dim_order) -> Tensor")


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


offload = torch.ops.zinf.offload.default
prefetch = torch.ops.zinf.prefetch.default
wait = torch.ops.zinf.wait.default
ZINF_OPS = (offload, prefetch, wait)
