"""Train a GPT whose parameters, gradients and AdamW states do not fit the budget (ZeRO-Infinity).

    python examples/zero3.py                                  # one process
    torchrun --nproc-per-node 2 examples/zero3.py             # each rank keeps half of everything

Every large parameter lives as a shard in NVMe files (`--offload cpu` for CPU memory), is gathered
around its uses and fetched ahead; zinf's optimizer streams AdamW through the files. The global
batch is split over the ranks (gloo on CPU, NCCL on GPU). At the end a sharded checkpoint is saved
and loaded back, and rank 0 prints the losses and what each rank held.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import build  # noqa: E402

import zinf_compile  # noqa: E402
from zinf_compile.runtime.params import STORE  # noqa: E402
from zinf_compile.units import format_bytes  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--budget", default="64MiB")
    ap.add_argument("--offload", default="nvme", choices=("nvme", "cpu"))
    ap.add_argument("--offload-dir", default=None)
    args = ap.parse_args()
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = f"cuda:{rank % torch.cuda.device_count()}" if torch.cuda.is_available() else "cpu"
    model, (idx, targets) = build(batch=8, seq=128, layers=4, hidden=256, heads=4, vocab=1024, device=device)
    idx, targets = idx.chunk(world)[rank], targets.chunk(world)[rank]
    offload_dir = args.offload_dir or os.path.join(tempfile.gettempdir(), "zinf-zero3")
    compiled = torch.compile(model, backend="zinf", options={
        "budget": args.budget, "offload": args.offload, "offload_dir": offload_dir, "params": "offload"})
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
    losses = []
    for _ in range(args.steps):
        loss = compiled(idx, targets).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean)
        losses.append(mean.item() / world)
    ckpt = os.path.join(offload_dir, "checkpoint")
    zinf_compile.save_checkpoint(ckpt, model, opt)
    zinf_compile.load_checkpoint(ckpt, model, opt)
    if rank == 0:
        entries = STORE.entries()
        print(f"ranks {world}; {len(entries)} parameters managed in {args.offload}: "
              f"{format_bytes(sum(e.nbytes for e in entries))} whole, "
              f"{format_bytes(sum(e.shard_nbytes for e in entries))} of shards on each rank")
        print("losses (mean over ranks): " + ", ".join(f"{x:.6f}" for x in losses))
        print(f"checkpoint saved and loaded back: {ckpt}")
    if world > 1:
        dist.barrier()  # every rank has read the checkpoint
    if rank == 0:
        import shutil

        shutil.rmtree(ckpt, ignore_errors=True)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
