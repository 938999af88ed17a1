"""Offloaded training of a GPT-style model: `python -m bench params` with examples/gpt.py's GPT,
page cache warm and dropped before each step (cold), side by side.

    python -m bench training [--layers 8] [--hidden 1024] [--batch 4] [--seq 256] [--budget 448MiB]
                             [--repeats 3] [--contenders auto] [--device auto] [--regimes warm,cold]

Parameters + gradients + AdamW states (4 x 118M parameters x 4 bytes = 1.76 GiB) are 4.0x the
448 MiB budget (a plan needs 416 MiB at least: the graph's lower bound); the 1024 tokens per step
make 5-7 s of compute on 2 cores, against 2-3 s of file traffic at page-cache speed (measured), so
transfers can hide under compute. One repeat by default. Contenders: everything resident
(Inductor + torch.optim.AdamW) and zinf with the NVMe tier; on a GPU (`--device auto` picks it where
there is one) zinf with the CPU tier too. On a CPU device that tier is the same RAM, frees nothing,
and no plan fits this budget with it (measured: the lower bound is then 865 MiB), so it is not a
contender there unless named. Measures and checks as bench params (its docstring).

Regimes: `warm` is bench params as it is (its bound uses the page cache's bandwidth); `cold` runs
the same with the page cache dropped before each timed step (root; `_harness.COLD_ENV`), and its
bound is max(compute, bytes zinf moves per step / the disk's direct read bandwidth, `dd iflag=direct
bs=16M` measured in the same run). Writes <out>/training-<regime>.json (bench params' record) and
<out>/training.json (the regimes side by side).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from bench import _harness, params

GPT = dict(model="gpt", layers=8, hidden=1024, heads=16, batch=4, seq=256, vocab=8192, budget="448MiB")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv:
        return params.main(argv, prog="training", defaults=GPT)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--regimes", default="warm,cold")
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    known, rest = ap.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:
        print(__doc__)
        return params.main(rest, prog="training", defaults=GPT)
    regimes = [r for r in known.regimes.split(",") if r]
    if set(regimes) - {"warm", "cold"}:
        raise SystemExit(f"--regimes: expected warm and/or cold, got {known.regimes!r}")
    if "cold" in regimes and not _harness.drop_caches():
        raise SystemExit("the cold regime drops the page cache before each step: run as root, or --regimes warm")
    out, codes = {}, []
    for regime in regimes:
        print(f"-- {regime} regime", flush=True)
        before = os.environ.get(_harness.COLD_ENV)
        os.environ[_harness.COLD_ENV] = "1" if regime == "cold" else "0"
        try:
            codes.append(params.main([*rest, "--out", known.out, "--name", f"training-{regime}"], prog="training",
                                     defaults=GPT))
        finally:
            if before is None:
                os.environ.pop(_harness.COLD_ENV, None)
            else:
                os.environ[_harness.COLD_ENV] = before
        with open(os.path.join(known.out, f"training-{regime}.json")) as f:
            record = json.load(f)
        direct = (_harness.direct_read_bandwidth(tempfile.gettempdir(), mib=512) or 0) * 1e6
        out[regime] = _regime(record, regime, direct)
    with open(os.path.join(known.out, "training.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(_table(out))
    return max(codes) if codes else 0


def _regime(record: dict, regime: str, direct_Bps: float) -> dict:
    """One regime's step times, bytes moved per step and bound: the transfer at the page cache's
    read and write rates (warm, as bench params computes it) or at the disk's direct read rate
    (cold: every byte moved goes to or comes from the disk)."""
    s = record["summary"]
    z, r = s.get("zinf-nvme"), s.get("resident")
    res = dict(bandwidth=dict(record["bandwidth"], direct_read_Bps=direct_Bps),
               step_s={k: v["step_s"] for k, v in s.items()})
    if z is None:
        return res
    moved = z["read_per_step"] + z["written_per_step"]
    if regime == "cold":
        transfer = moved / direct_Bps if direct_Bps else None
    else:
        transfer = z["read_per_step"] / record["bandwidth"]["read_Bps"] + \
            z["written_per_step"] / record["bandwidth"]["write_Bps"]
    res.update(read_per_step=z["read_per_step"], written_per_step=z["written_per_step"], transfer_s=transfer)
    if r is not None and transfer is not None:
        bound = max(r["step_s"], transfer)
        res.update(compute_s=r["step_s"], bound_s=bound, zinf_vs_bound=z["step_s"] / bound,
                   zinf_within_1_3x_bound=z["step_s"] <= 1.3 * bound)
    return res


def _table(out: dict) -> str:
    lines = [f"{'regime':7} {'contender':11} {'s/step':>8}"]
    for regime, r in out.items():
        for name, t in r["step_s"].items():
            lines.append(f"{regime:7} {name:11} {t:>8.2f}")
        if "bound_s" in r:
            lines.append(f"{regime:7} zinf moved {(r['read_per_step'] + r['written_per_step']) / 1e9:.2f} GB/step "
                         f"(read {r['read_per_step'] / 1e9:.2f}); bound max(compute {r['compute_s']:.2f} s, "
                         f"transfer {r['transfer_s']:.2f} s) = {r['bound_s']:.2f} s; zinf / bound "
                         f"{r['zinf_vs_bound']:.2f}x (direct read {r['bandwidth']['direct_read_Bps'] / 1e9:.2f} GB/s)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
