"""Managed parameters read and written outside the graph over ranks, for tests/test_access.py,
started by torchrun:

    torchrun --nproc-per-node N tests/workers/dist_access.py OUT TIER OFFLOAD_DIR

The model of dist_train.py (odd sizes: padded shards), every large parameter sharded, one training
step on this rank's half of one global batch. Then on every rank (each read a collective):
model.state_dict() and p.norm() of every parameter; load_state_dict of another model's state (same
on every rank) and this rank's shard of each managed parameter as it then is; a compiled step's loss
(the mean over ranks) on the loaded values; copy.deepcopy(model)'s output on the whole batch. Each
rank saves what it saw to OUT.<rank>.pt.
"""
import copy
import sys

import torch
import torch.distributed as dist

import zinf_compile
from zinf_compile.runtime.state import STORE

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from dist_train import build  # noqa: E402

LOADED_SEED = 5  # the state loaded mid-training: build()'s model initialised from this seed


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(1)
    return torch.randn(32, 65), torch.randn(32, 65)


def loaded_state() -> dict[str, torch.Tensor]:
    model = build()
    torch.manual_seed(LOADED_SEED)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    return model.state_dict()


def main(out: str, tier: str, offload_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = batch()
    xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
    model = build()
    compiled = torch.compile(model, backend="zinf",
                             options={"params": "offload", "offload": tier, "offload_dir": offload_dir})
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-2)

    def step() -> float:
        loss = torch.nn.functional.mse_loss(compiled(xs), ys)
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        return mean.item() / world

    first = step()
    managed = [n for n, p in model.named_parameters() if STORE.is_managed(p)]
    state = {k: v.clone() for k, v in model.state_dict().items()}  # every rank reads: gathered values
    norms = {n: p.norm() for n, p in model.named_parameters()}
    full = {k: v.clone() for k, v in zinf_compile.full_state_dict(model).items()}  # zinf's own gather
    model.load_state_dict(loaded_state())  # refills this rank's shards
    shards = {n: (STORE.entry(p).read_shard().clone(), STORE.entry(p).shard_range())
              for n, p in model.named_parameters() if STORE.is_managed(p)}
    after_load = step()
    twin = copy.deepcopy(model)  # every rank: plain parameters with the values after that step
    with torch.no_grad():
        twin_out = twin(x)
    torch.save({"world": world, "rank": rank, "managed": managed, "first": first, "state": state, "norms": norms,
                "full": full, "shards": shards, "after_load": after_load, "twin_out": twin_out,
                "twin_state": twin.state_dict(), "state_after": model.state_dict(),
                "twin_plain": all(type(p) is torch.nn.Parameter for p in twin.parameters())}, f"{out}.{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
