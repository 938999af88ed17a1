"""One linear layer larger than the memory budget, trained with memory-centric tiling.

    python examples/tiled.py                      # width 16384: a 1 GiB weight under a 512 MiB budget
    python examples/tiled.py --width 2048 --budget 48MiB --steps 3
    zinf plan examples/tiled.py:build --budget 512MiB --params offload --offload nvme

The big layer's weight lives in the NVMe tier; the plan splits its matmuls (forward, gradient of
the input, gradient of the weight) into tiles of its rows, each read from the tier ahead of use and
dropped after. zinf's AdamW streams the weight's optimizer states through memory in chunks.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class OneBig(nn.Module):
    """inp (small) -> big (width x width) -> head (small): the big weight dominates everything."""

    def __init__(self, d_in: int = 256, width: int = 16384, d_out: int = 16):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.big = nn.Linear(width, width)
        self.head = nn.Linear(width, d_out)

    def forward(self, x, y):
        return F.cross_entropy(self.head(F.gelu(self.big(F.gelu(self.inp(x))))), y)


def build(batch: int = 64, d_in: int = 256, width: int = 16384, d_out: int = 16, seed: int = 0):
    """The model and one batch (for `zinf plan`)."""
    torch.manual_seed(seed)
    model = OneBig(d_in, width, d_out)
    return model, (torch.randn(batch, d_in), torch.randint(0, d_out, (batch,)))


def main(argv=None) -> None:
    import zinf_compile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=16384)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--budget", default="512MiB")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--offload-dir", default=None)
    args = ap.parse_args(argv)
    model, (x, y) = build(args.batch, width=args.width)
    big = model.big.weight
    print(f"big weight {tuple(big.shape)}: {big.numel() * big.element_size() / 2**20:.0f} MiB, "
          f"budget {args.budget}", flush=True)
    opts = {"budget": args.budget, "offload": "nvme", "params": "offload"}
    if args.offload_dir:
        opts["offload_dir"] = args.offload_dir
    compiled = torch.compile(model, backend="zinf", options=opts)
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-4)
    for step in range(args.steps):
        t0 = time.perf_counter()
        loss = compiled(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}: loss {loss.item():.6f} ({time.perf_counter() - t0:.1f} s)", flush=True)
    plan = zinf_compile.last_plans(1)[0]
    for t in plan.tiles:
        print(f"tiled {t.graph} {t.op}: {t.count} tiles along {t.axis} of {t.param}"
              f"{' (its gradient)' if t.grad else ''}, weight tile {t.tile_shape}")
    print(f"plan: peak {plan.peak_after / 2**20:.1f} MiB under a budget of {plan.budget / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
