"""A training run for the multi-rank tests, started by torchrun:

    torchrun --nproc-per-node N tests/workers/dist_train.py OUT.json TIER OFFLOAD_DIR [GATHER_DTYPE]

Trains a small model for a few steps on one global batch split over the ranks (gloo), with every
large parameter sharded (params="offload") and zinf's optimizer; rank 0 writes the losses (the mean
over ranks), the resident parameter bytes per rank and the final full state dict to OUT.json/.pt.
"""
import json
import sys

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.passes.verifier import saved_whole_parameters
from zinf_compile.runtime.state import STORE


def build():
    torch.manual_seed(0)
    # odd element counts (65 x 257 = 16705): the shards of 2 ranks are padded
    return torch.nn.Sequential(torch.nn.Linear(65, 257), torch.nn.GELU(), torch.nn.Linear(257, 65))


def main(out: str, tier: str, offload_dir: str, gather_dtype: str | None = None, steps: int = 3) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1)
    x, y = torch.randn(32, 65), torch.randn(32, 65)
    model = torch.compile(build(), backend="zinf",
                          options={"params": "offload", "offload": tier, "offload_dir": offload_dir,
                                   "gather_dtype": gather_dtype})
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-2)
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    losses = []
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    shard_bytes = sum(e.shard_nbytes for e in STORE.entries())
    per_rank = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(per_rank, torch.tensor([shard_bytes]))
    state = zinf_compile.full_state_dict(model)
    rec = [r for r in zinf_compile.compiles() if "backward" in r.plan.graphs][-1]
    collectives = {role: sorted({str(n.target) for n in rec.graphs[role].graph.nodes if "c10d" in str(n.target)})
                   for role in ("forward", "backward")}
    if rank == 0:
        torch.save(state, out + ".pt")
        with open(out, "w") as f:
            json.dump({"world": world, "losses": losses, "shard_bytes": [int(t) for t in per_rank],
                       "managed": [e.name for e in STORE.entries()], "collectives": collectives,
                       "gathers_from": sorted({str(e.read_dtype) for e in STORE.entries()}),
                       "saved_whole": saved_whole_parameters(rec.graphs["forward"])}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
