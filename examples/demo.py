"""`make demo`: train a small GPT on the CPU under a budget smaller than its footprint.

The large parameters are sharded to NVMe (gathered around their uses, fetched ahead; their
gradients and AdamW states live in files and zinf's optimizer streams through them), and the
activations saved for backward that do not fit go to NVMe swap files and come back ahead of their
use. Losses are compared with eager PyTorch, the plan report and pictures are written to --out,
and the swap folder is checked empty at the end.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpt import build  # noqa: E402

import zinf_compile  # noqa: E402  (only for the plans and the report; the backend needs no import)
from zinf_compile.capture import capture  # noqa: E402
from zinf_compile.cost import load_profile  # noqa: E402
from zinf_compile.pipeline import plan_graphs  # noqa: E402
from zinf_compile.report import summary_rows, write_report  # noqa: E402
from zinf_compile.units import format_bytes  # noqa: E402

MODEL = dict(batch=8, seq=128, layers=4, hidden=256, heads=4, vocab=1024)


def train(model, inputs, steps: int, opt) -> tuple[list[float], float]:
    losses, t0 = [], time.perf_counter()
    for _ in range(steps):
        loss = model(*inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="demo-out")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--fraction", type=float, default=0.75, help="budget as a fraction of the unplanned peak")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    print(f"zinf demo: GPT {MODEL}", flush=True)
    graphs, nfo = capture(build, MODEL)
    profile = load_profile("auto", "cpu")
    _, free_plan = plan_graphs(graphs, nfo, 1 << 50, profile, "nvme")
    budget = max(int(free_plan.peak_before * args.fraction), free_plan.lower_bound)
    print(f"  unplanned peak {format_bytes(free_plan.peak_before)}, lower bound "
          f"{format_bytes(free_plan.lower_bound)} -> budget {format_bytes(budget)}", flush=True)

    model, inputs = build(**MODEL)
    ref_model, _ = build(**MODEL)
    eager_losses, eager_s = train(ref_model, inputs, args.steps, torch.optim.AdamW(ref_model.parameters(), lr=1e-3))

    swap_root = tempfile.mkdtemp(prefix="zinf-demo-swap-")
    opts = {"budget": budget, "offload": "nvme", "offload_dir": swap_root, "params": "offload"}
    print(f"  compiling with backend='zinf', options={opts} (Inductor on 2 cores takes a minute)", flush=True)
    compiled = torch.compile(model, backend="zinf", options=opts)
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)
    zinf_losses, zinf_s = train(compiled, inputs, args.steps, opt)

    plans = [p for p in zinf_compile.last_plans() if "backward" in p.graphs]
    os.makedirs(args.out, exist_ok=True)
    files = write_report(plans[-1], args.out, title="zinf demo: small GPT trained under a budget")
    plans[-1].save(os.path.join(args.out, "plan.json"))

    print("\n  step  eager loss   zinf loss")
    for i, (a, b) in enumerate(zip(eager_losses, zinf_losses)):
        print(f"  {i:>4}  {a:.6f}   {b:.6f}")
    same = max(abs(a - b) for a, b in zip(eager_losses, zinf_losses))
    print(f"  largest loss difference vs eager: {same:.2e} (Inductor's fused kernels round differently "
          f"from eager; against Inductor alone zinf is bit-identical, see tests/test_e2e.py)")
    for k, v in summary_rows(plans[-1]):
        print(f"  {k}: {v}")
    print(f"  time for {args.steps} steps: eager {eager_s:.2f} s, zinf {zinf_s:.2f} s (includes compiling)")

    del compiled, model, opt
    from zinf_compile.runtime import close_all

    close_all()
    left = [os.path.join(d, f) for d, _, fs in os.walk(swap_root) for f in fs]
    os.rmdir(swap_root) if os.path.isdir(swap_root) and not os.listdir(swap_root) else None
    print(f"  swap files left behind: {len(left)}")
    print(f"\nreport: {os.path.abspath(files['html'])}")
    print(f"pictures: {os.path.abspath(files['timeline'])}, {os.path.abspath(files['lanes'])}")
    return 0 if not left and same < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
