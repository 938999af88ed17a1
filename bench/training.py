"""Offloaded training of a GPT-style model: `python -m bench params` with examples/gpt.py's GPT.

    python -m bench training [--layers 8] [--hidden 1024] [--batch 4] [--seq 256] [--budget 448MiB]
                             [--repeats 3] [--contenders auto] [--device auto]

Parameters + gradients + AdamW states (4 x 118M parameters x 4 bytes = 1.76 GiB) are 4.0x the
448 MiB budget (a plan needs 416 MiB at least: the graph's lower bound); the 1024 tokens per step
make 5-7 s of compute on 2 cores, against 2-3 s of file traffic at page-cache speed (measured), so
transfers can hide under compute. One repeat by default. Contenders: everything resident
(Inductor + torch.optim.AdamW) and zinf with the NVMe tier; on a GPU (`--device auto` picks it where
there is one) zinf with the CPU tier too. On a CPU device that tier is the same RAM, frees nothing,
and no plan fits this budget with it (measured: the lower bound is then 865 MiB), so it is not a
contender there unless named. Measures and checks as bench params (its docstring).
"""
from __future__ import annotations

import sys

from bench import params

GPT = dict(model="gpt", layers=8, hidden=1024, heads=16, batch=4, seq=256, vocab=8192, budget="448MiB")


def main(argv: list[str] | None = None) -> int:
    return params.main(argv, prog="training", defaults=GPT)


if __name__ == "__main__":
    sys.exit(main())
