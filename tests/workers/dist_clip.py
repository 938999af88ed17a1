"""Gradient clipping over ranks, for tests/test_grads.py, started by torchrun:

    torchrun --nproc-per-node N tests/workers/dist_clip.py OUT.pt TIER OFFLOAD_DIR

One forward and backward of the model of dist_train.py (odd sizes: padded shards) on this rank's
half of one global batch, every large parameter sharded; then the inf norm (zinf_compile.total_norm)
and torch's own clip_grad_norm_ (which zinf makes count the shards). Rank 0 saves both norms and
every whole gradient after clipping (shards gathered over ranks, padding dropped).
"""
import sys

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.runtime.state import STORE

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dist_train import build  # noqa: E402

MAX_NORM = 0.05


def main(out: str, tier: str, offload_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x, y = torch.randn(32, 65), torch.randn(32, 65)
    model = build()
    compiled = torch.compile(model, backend="zinf",
                             options={"params": "offload", "offload": tier, "offload_dir": offload_dir})
    torch.nn.functional.mse_loss(compiled(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
    inf = zinf_compile.total_norm(model.parameters(), float("inf"))
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    grads = {}
    for name, p in model.named_parameters():
        e = STORE.entry(p)
        if e is None:
            grads[name] = p.grad.clone()
            continue
        parts = [torch.empty(e.shard_numel, dtype=e.shard_dtype) for _ in range(world)]
        dist.all_gather(parts, e.read_grad().clone())
        grads[name] = torch.cat(parts)[: e.numel].view(e.shape)
    if rank == 0:
        torch.save({"world": world, "norm": norm, "inf": inf, "grads": grads,
                    "managed": [e.name for e in STORE.entries()]}, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
