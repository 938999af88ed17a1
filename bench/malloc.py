"""What pinning glibc's mmap threshold costs: the same allocation-heavy loop (28 matmul+ReLU
activations of 8 MiB kept per iteration, as a forward pass keeps them) with glibc's defaults and
with MALLOC_MMAP_THRESHOLD_=131072 (what zinf sets on a CPU device), alternately, each in a fresh
subprocess; reports the median ratio.

    python -m bench malloc [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

WORKER = r"""
import time, torch
torch.set_num_threads(2)
x = torch.randn(16384, 128); w = torch.randn(128, 128)
def step():
    acts, h = [], x
    for _ in range(28):
        h = torch.relu(h @ w); acts.append(h)
for _ in range(2): step()
t = time.perf_counter()
for _ in range(5): step()
print((time.perf_counter() - t) / 5)
"""


def run(env_extra: dict[str, str]) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(env_extra)
    out = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench malloc")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join("bench", "results"), help="where malloc.json goes")
    args = ap.parse_args(argv)
    default, pinned = [], []
    for _ in range(args.repeats):  # alternate, so that load on the machine hits both alike
        default.append(run({}))
        pinned.append(run({"MALLOC_MMAP_THRESHOLD_": "131072"}))
    ratio = statistics.median(p / d for p, d in zip(pinned, default))
    print(f"seconds per iteration: glibc defaults {statistics.median(default):.3f}, "
          f"threshold pinned {statistics.median(pinned):.3f}; median ratio pinned/defaults {ratio:.2f}x")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "malloc.json")
    with open(path, "w") as f:
        json.dump({"benchmark": "malloc", "command": "python -m bench malloc " + " ".join(argv or []),
                   "defaults_s": default, "pinned_s": pinned, "ratio_median": ratio}, f, indent=1)
    print(f"wrote {path}")
    return 0
