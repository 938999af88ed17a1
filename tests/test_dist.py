"""Two ranks (gloo, started with torchrun) against one process on the same global batch.

Each rank keeps half of every managed parameter, its gradient and its optimizer states; losses and
the trained parameters must match the single-process run. Not bit for bit: the mean over ranks of
two half-batch gradients rounds differently from one gradient of the whole batch (measured
differences ~1e-9 on gradients of ~1e-3), so losses match to rtol 1e-5. AdamW divides by the root
of the squared-gradient average, which turns that rounding into updates of up to ~lr on the few
elements whose gradient is almost zero: measured 30 of 33,000 elements off by 4e-6..6e-5 after 3
steps at lr 1e-2. Parameters are checked to atol 1e-4, with 99.5% of elements within 1e-6.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "dist_train.py")


def torchrun(nproc: int, out: str, tier: str, offload_dir: str, *extra: str) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--standalone", WORKER, out, tier, offload_dir, *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, offload_root):
    tmp = tmp_path_factory.mktemp("dist")
    out = {}
    for n, gather in ((1, ()), (2, ()), ("1-bf16", ("bfloat16",)), ("2-bf16", ("bfloat16",))):
        d = os.path.join(offload_root, f"dist{n}")
        out[n] = torchrun(int(str(n)[0]), str(tmp / f"w{n}.json"), "nvme", d, *gather)
        out[n]["state"] = torch.load(str(tmp / f"w{n}.json.pt"))
        out[n]["left"] = [f for _, _, fs in os.walk(d) for f in fs] if os.path.exists(d) else []
    return out


@pytest.mark.parametrize("gather", ["", "-bf16"], ids=["float32", "bfloat16-gathers"])
def test_two_ranks_match_one_process(runs, gather):
    """gather_dtype="bfloat16": each rank gathers its shard's bf16 copy and all-gathers it widened."""
    one, two = runs[f"1{gather}"] if gather else runs[1], runs[f"2{gather}"] if gather else runs[2]
    assert one["gathers_from"] == two["gathers_from"] == (["torch.bfloat16"] if gather else ["torch.float32"])
    assert (one["losses"] != runs[1]["losses"]) == bool(gather)  # the rounded weights change the losses
    assert two["world"] == 2 and one["world"] == 1
    assert one["managed"] == two["managed"] and len(one["managed"]) == 2
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=0)
    assert one["losses"][-1] < one["losses"][0]  # it trains
    off = total = 0
    for k, v in one["state"].items():
        torch.testing.assert_close(two["state"][k], v, rtol=0, atol=1e-4, msg=k)
        off += int(((two["state"][k] - v).abs() > 1e-6).sum())
        total += v.numel()
    assert off <= 0.005 * total, (off, total)


def test_each_rank_holds_half(runs):
    whole = runs[1]["shard_bytes"][0]
    per_rank = runs[2]["shard_bytes"]
    assert len(per_rank) == 2 and per_rank[0] == per_rank[1]
    assert whole / 2 < per_rank[0] <= whole / 2 + 2 * 4  # odd sizes: one element of padding per parameter


def test_two_ranks_gather_and_reduce_with_functional_collectives_in_the_graph(runs):
    c = runs[2]["collectives"]
    assert "_c10d_functional.all_gather_into_tensor.default" in c["forward"]
    assert "_c10d_functional.all_gather_into_tensor.default" in c["backward"]  # gathered again, not saved
    assert "_c10d_functional.reduce_scatter_tensor.default" in c["backward"]
    assert "_c10d_functional.all_reduce.default" in c["backward"]  # the resident biases' gradients
    assert runs[1]["collectives"] == {"forward": [], "backward": []}  # one rank: none at all
    assert runs[2]["saved_whole"] == [] and runs[1]["saved_whole"] == []


def test_no_files_left(runs):
    assert all(r["left"] == [] for r in runs.values())
