"""A checkpoint saved and loaded by two ranks, for tests/test_faults.py, started by torchrun:

    torchrun --nproc-per-node 2 tests/workers/dist_checkpoint.py OFFLOAD_DIR CKPT OUT

The model of fault_worker.py, its weights sharded over the ranks in the NVMe tier (no compile: the
store takes them over), one AdamW step on the same gradients, then a save. Another model (other
values) loads it; then one rank damages one of its own shard files and a load must fail on every
rank that reads it, leaving that model as it was. Rank 0 writes the outcome to OUT (JSON).
"""
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fault_worker import HP, build, grads, manage  # noqa: E402


def main(offload_dir: str, ckpt: str, out: str) -> None:
    from zinf_compile.checkpoint import CURRENT, full_state_dict, load_checkpoint, save_checkpoint
    from zinf_compile.errors import ZinfError
    from zinf_compile.optim import optimizer
    from zinf_compile.runtime.state import STORE

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = build()
    manage(model, offload_dir)
    opt = optimizer(model, torch.optim.AdamW, chunk_elems=4096, **HP)
    for p, g in zip(model.parameters(), grads(1, model)):
        e = STORE.entry(p)
        if e is None:
            p.grad = g.clone()
        else:
            e.write_grad(e.slice_of(g.reshape(-1)))
    opt.step()
    save_checkpoint(ckpt, model, opt)
    saved = full_state_dict(model)
    torch.manual_seed(5)
    other = build()
    for p in other.parameters():
        torch.nn.init.normal_(p)
    manage(other, offload_dir, key=(1 << 62) + 32)
    other_opt = optimizer(other, torch.optim.AdamW, chunk_elems=4096, **HP)
    load_checkpoint(ckpt, other, other_opt)
    loaded = full_state_dict(other)
    same = all(torch.equal(loaded[k], v) for k, v in saved.items())
    result = {"world": dist.get_world_size(), "loaded_equal": same,
              "sharded": [STORE.entry(p).shard_numel for p in other.parameters() if STORE.entry(p) is not None]}
    version = open(os.path.join(ckpt, CURRENT)).read().split()[0]
    result["files"] = sorted(os.path.relpath(os.path.join(d, f), os.path.join(ckpt, version))
                             for d, _, fs in os.walk(os.path.join(ckpt, version)) for f in fs)
    dist.barrier()
    if rank == 1:  # rank 1's own shard of 2.weight, zeroed
        f = os.path.join(ckpt, version, "rank00001", "t00002.pt")
        open(f, "wb").write(bytes(os.path.getsize(f)))
    dist.barrier()
    before = full_state_dict(other)
    try:
        load_checkpoint(ckpt, other, other_opt)
        err = None
    except ZinfError as e:
        err = str(e)
    after = full_state_dict(other)
    result["damaged_error"] = err
    result["unchanged"] = all(torch.equal(after[k], v) for k, v in before.items())
    errors = [None, None]
    dist.all_gather_object(errors, err)
    if rank == 0:
        result["errors"] = errors
        with open(out, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])
