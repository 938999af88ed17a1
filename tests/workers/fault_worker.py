"""A process killed at a chosen point of an NVMe optimizer step or of a checkpoint save, for
tests/test_faults.py:

    python tests/workers/fault_worker.py OFFLOAD_DIR CKPT POINT

Builds `build()`, manages its weights in the NVMe tier (swap folder under OFFLOAD_DIR), takes step 1
(AdamW on `grads(1)`), saves CKPT, gives step 2's gradients, then runs step 2 and saves again with
the test hook pausing at POINT: it prints "paused POINT" and sleeps there until the test kills it.
The test computes the same steps with torch's AdamW (the same functions) to know what step 1 and
step 2 leave.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.nn as nn

HP = dict(lr=1e-2, weight_decay=0.1)
KEY = (1 << 62) + 31  # the worker's engine key (above the backend's 62-bit digests)


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))  # 128 KiB weights: managed


def grads(step: int, model: nn.Module) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=gen) for p in model.parameters()]


def manage(model: nn.Module, offload_dir: str, key: int = KEY) -> None:
    from zinf_compile.runtime.state import STORE, register_engine

    register_engine(key, "nvme", offload_dir, 2, False)
    for name, p in model.named_parameters():
        if p.numel() * p.element_size() >= 64 << 10:
            STORE.manage(STORE.identify(p, name), "nvme", key)


def give_grad(p: torch.Tensor, g: torch.Tensor) -> None:
    """`g` as the gradient of `p`: its .grad if resident, its shard's gradient in the store if
    managed (as a backward would leave it). Shared by the store-level tests (test_optim, test_faults)."""
    from zinf_compile.runtime.state import STORE

    e = STORE.entry(p)
    if e is None:
        p.grad = g.clone()
    else:
        e.write_grad(g.reshape(-1).clone())


def give(model: nn.Module, gs) -> None:
    """One step's gradients `gs`, in the order of model.parameters()."""
    for p, g in zip(model.parameters(), gs):
        give_grad(p, g)


def main(offload_dir: str, ckpt: str, point: str) -> None:
    import zinf_compile.optim as zoptim
    from zinf_compile.checkpoint import save_checkpoint

    model = build()
    manage(model, offload_dir)
    opt = zoptim.optimizer(model, torch.optim.AdamW, chunk_elems=4096, **HP)
    give(model, grads(1, model))
    opt.step()
    opt.zero_grad()
    save_checkpoint(ckpt, model, opt)
    give(model, grads(2, model))

    def pause(name: str) -> None:
        if name == point:
            print(f"paused {name}", flush=True)
            time.sleep(120)

    zoptim.FAULT_HOOK = pause
    opt.step()
    save_checkpoint(ckpt, model, opt)
    print("finished", flush=True)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    main(*sys.argv[1:4])
