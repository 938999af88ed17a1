"""Offloaded training of a GPT-style model: `python -m bench params` with examples/gpt.py's GPT,
page cache warm and dropped before each step (cold), side by side.

    python -m bench training [--layers 8] [--hidden 1024] [--batch 4] [--seq 256] [--budget 448MiB]
                             [--repeats 3] [--contenders auto] [--device auto] [--regimes warm,cold]
                             [--modes step,in-backward-sync,in-backward-overlap]

Parameters + gradients + AdamW states (4 x 118M parameters x 4 bytes = 1.76 GiB) are 4.0x the
448 MiB budget (a plan needs 416 MiB at least: the graph's lower bound); the 1024 tokens per step
make 5-7 s of compute on 2 cores, against 2-3 s of file traffic at page-cache speed (measured), so
transfers can hide under compute. One repeat by default. Contenders: everything resident
(Inductor + torch.optim.AdamW) and zinf with the NVMe tier, stepped in step() and in the backward
(`zinf-nvme-ib`, bench params' docstring); on a GPU (`--device auto` picks it where
there is one) zinf with the CPU tier too. On a CPU device that tier is the same RAM, frees nothing,
and no plan fits this budget with it (measured: the lower bound is then 865 MiB), so it is not a
contender there unless named. Measures and checks as bench params (its docstring).

Regimes: `warm` is bench params as it is (its bound uses the page cache's bandwidth); `cold` runs
the same with the page cache dropped before each timed step (root; `_harness.COLD_ENV`), and its
bound is max(compute, bytes zinf moves per step / the disk's direct read bandwidth, `dd iflag=direct
bs=16M` measured in the same run). Writes <out>/training-<regime>.json (bench params' record) and
<out>/training.json (the regimes side by side).

Optimizer modes (`--modes`, first; `--modes ''` skips them, `--regimes ''` runs only them): bytes
read from and written to the swap files per training step, and seconds per step, side by side in
one run, of the NVMe tier stepped in step() (`step`: each gradient written to its file in the
backward and read back by the step) and in the backward (`zinf_compile.optimizer(...,
step_in_backward=True)`, the gradient never reaches its file), there either inside the reduce, the
backward waiting (`in-backward-sync`: overlap=False), or on the optimizer's worker thread while the
backward computes (`in-backward-overlap`: the default). The model (MODES below) is a GPT with
GPT-2's tied embedding/head, `params="offload"` so every 2-d weight is an NVMe shard, AdamW, shards
large enough (hidden 512: 1-4M elements each) that the optimizer is a visible share of the step,
compute on MODES["threads"] = 1 torch thread so the worker has the other core. Each mode in a fresh
process, the order rotated per repeat (`--repeats`, 1 by default): 2 warm-up steps (the first
compiles and counts each gradient's reduces, so the second already steps in backward), then 3
measured; per step the forward, backward and opt.step() are timed apart; s/step is the median over
every measured step of every repeat. Then, in the in-backward-overlap processes only, MODES["pairs"]
pairs of steps with overlap off and on (`opt.overlap`, alternate order): the same process under the
same load, so their per-pair ratio is the least noisy comparison of the two on a shared machine. The bytes are exact counts of the engine's reads and writes;
times on a shared machine are indicative (ratios within one run are what counts). It checks that
all modes compute the same losses and parameters bit for bit, that in-backward saves exactly one
write and one read of every managed gradient per step, and that both in-backward modes move the
same bytes. Writes <out>/training-modes.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from bench import _harness, params

GPT = dict(model="gpt", layers=8, hidden=1024, heads=16, batch=4, seq=256, vocab=8192, budget="448MiB")
# the optimizer modes' model: 2 blocks of 512, 8192-token vocabulary (tied), 10.5M parameters; 1 thread
MODES = dict(layers=2, hidden=512, heads=8, batch=4, seq=64, vocab=8192, lr=1e-3, warmup=2, steps=3, threads=1,
             pairs=6)
MODE_NAMES = ("step", "in-backward-sync", "in-backward-overlap")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in argv and argv[argv.index("--worker") + 1].startswith("mode-"):
        return _mode_main(argv)
    if "--worker" in argv:
        return params.main(argv, prog="training", defaults=GPT)
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--regimes", default="warm,cold")
    ap.add_argument("--modes", default=",".join(MODE_NAMES))
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
    modes = [m for m in known.modes.split(",") if m]
    if set(modes) - set(MODE_NAMES):
        raise SystemExit(f"--modes: expected some of {', '.join(MODE_NAMES)}, got {known.modes!r}")
    if modes:
        repeats = _option(rest, "--repeats", 1)
        codes.append(_modes(modes, known.out, repeats))
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
    if regimes:
        with open(os.path.join(known.out, "training.json"), "w") as f:
            json.dump(out, f, indent=1)
        print(_table(out))
    return max(codes) if codes else 0


def _option(argv: list[str], name: str, default: int) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


# -- optimizer modes: bytes per step with the NVMe tier stepped in step() or in the backward ----------
def _mode_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench training (mode worker)")
    for k, v in MODES.items():
        ap.add_argument(f"--{k}", type=type(v), default=v)
    ap.add_argument("--worker")
    ap.add_argument("--offload-dir")
    ap.add_argument("--result")
    return _harness.run_worker(ap.parse_args(argv), _mode_worker)


def _mode_worker(args) -> dict:
    """One optimizer mode (`--worker mode-step`, `mode-in-backward-sync` or `mode-in-backward-overlap`)
    in this process."""
    import zlib

    import torch

    import zinf_compile
    from zinf_compile.checkpoint import full_state_dict
    from zinf_compile.runtime.state import STORE

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import build

    model, (idx, tgt) = build(batch=args.batch, seq=args.seq, layers=args.layers, hidden=args.hidden,
                              heads=args.heads, vocab=args.vocab, seed=0, tie=True)
    options = {"params": "offload", "offload": "nvme", "offload_dir": args.offload_dir}
    fn = torch.compile(model, backend="zinf", options=options)
    mode = args.worker[len("mode-"):]
    opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=args.lr, step_in_backward=mode != "step",
                                 overlap=mode == "in-backward-overlap")
    counts, phases = [], []

    def step() -> float:
        t0 = time.perf_counter()
        loss = fn(idx, tgt).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        phases.append(dict(forward_s=t1 - t0, backward_s=t2 - t1, opt_step_s=time.perf_counter() - t2))
        counts.append(dict(opt.last_step_counts))
        return float(loss.detach())

    m = _harness.measure_steps(step, args.warmup, args.steps)
    sd = full_state_dict(fn)
    crc = 0
    for k in sorted(sd):
        crc = zlib.crc32(sd[k].detach().contiguous().view(torch.uint8).numpy().tobytes(), crc)
    entries = STORE.entries()
    paired = []  # in-backward-overlap's process: then steps with overlap off and on, alternately
    for k in range(args.pairs if mode == "in-backward-overlap" else 0):
        t = {}
        for overlap in ((False, True) if k % 2 == 0 else (True, False)):
            opt.overlap = overlap
            t0 = time.perf_counter()
            step()
            t[overlap] = time.perf_counter() - t0
        paired.append(dict(sync_s=t[False], overlap_s=t[True]))
    return dict(mode=mode, paired=paired, losses=m["losses"], loss_bits=[float.hex(x) for x in m["losses"]],
                params_crc32=crc, step_s=m["step_s"], moved_per_step=m["moved_per_step"], counts=counts,
                phases=phases[args.warmup:], threads=torch.get_num_threads(),
                queue=dict(peak_bytes=opt._queue.peak, waits=opt._queue.waits),
                managed=len(entries), shard_bytes=sum(e.shard_nbytes for e in entries),
                param_numel=sum(p.numel() for p in model.parameters()))


def _modes(names: list[str], out_dir: str, repeats: int) -> int:
    """Each mode in fresh processes, alternately; the bytes side by side. 1 when a check fails."""
    argv = _harness.as_argv(argparse.Namespace(**MODES), MODES)
    runs = _harness.alternate([f"mode-{n}" for n in names], [f"mode-{n}" for n in MODE_NAMES], repeats,
                              lambda n: _harness.run("bench.training", n, argv, 1800, MODES["threads"]))
    summary = {}
    for n in names:
        rs = [r for r in runs if r["mode"] == n]
        moved = rs[0]["moved_per_step"]
        summary[n] = dict(read_per_step=moved["read"], written_per_step=moved["written"],
                          step_s=statistics.median(s for r in rs for s in r["step_s"]),
                          **{k: statistics.median(p[k] for r in rs for p in r["phases"])
                             for k in ("forward_s", "backward_s", "opt_step_s")},
                          repeats=len(rs), queue_waits=rs[0]["queue"]["waits"],
                          queue_peak_bytes=rs[0]["queue"]["peak_bytes"],
                          stepped_in_backward=rs[0]["counts"][-1]["in_backward"],
                          stepped_in_step=rs[0]["counts"][-1]["in_step"], managed=rs[0]["managed"],
                          shard_bytes=rs[0]["shard_bytes"], param_numel=rs[0]["param_numel"],
                          loss_bits=rs[0]["loss_bits"], params_crc32=rs[0]["params_crc32"],
                          bytes_same_every_repeat=all(r["moved_per_step"] == rs[0]["moved_per_step"] for r in rs))
    pairs = [p for r in runs for p in r.get("paired", ())]
    if pairs:  # the same process, the same load: overlap off and on in alternate steps
        summary["in-backward-overlap"]["paired"] = dict(
            pairs=len(pairs), sync_s=statistics.median(p["sync_s"] for p in pairs),
            overlap_s=statistics.median(p["overlap_s"] for p in pairs),
            overlap_vs_sync=statistics.median(p["overlap_s"] / p["sync_s"] for p in pairs))
    checks = {"bytes_same_every_repeat": all(s["bytes_same_every_repeat"] for s in summary.values())}
    s0 = next(iter(summary.values()))
    checks.update(same_losses=all(s["loss_bits"] == s0["loss_bits"] for s in summary.values()),
                  same_params=all(s["params_crc32"] == s0["params_crc32"] for s in summary.values()))
    ib = [summary[n] for n in ("in-backward-sync", "in-backward-overlap") if n in summary]
    if ib:
        checks["all_stepped_in_backward"] = all(b["stepped_in_backward"] == b["managed"] and b["stepped_in_step"] == 0
                                                for b in ib)
    if len(ib) == 2:
        checks["overlap_moves_the_same_bytes"] = all(ib[0][k] == ib[1][k]
                                                     for k in ("read_per_step", "written_per_step"))
        checks["overlap_vs_sync_step_s"] = ib[1]["step_s"] / ib[0]["step_s"]
    if "step" in summary and ib:
        a, b = summary["step"], ib[0]
        grads = a["shard_bytes"]  # every managed gradient: the shard's size
        checks.update(
            read_saved_is_one_gradient_read=a["read_per_step"] - b["read_per_step"] == grads,
            written_saved_is_one_gradient_write=a["written_per_step"] - b["written_per_step"] == grads,
            moved_ratio=(b["read_per_step"] + b["written_per_step"]) / (a["read_per_step"] + a["written_per_step"]))
        for n in ("in-backward-sync", "in-backward-overlap"):
            if n in summary:
                checks[f"{n}_vs_step_step_s"] = summary[n]["step_s"] / a["step_s"]
    ok = all(v for v in checks.values() if isinstance(v, bool))
    record = dict(model=dict(MODES, model="gpt", tie=True, params="offload", offload="nvme", optimizer="AdamW"),
                  summary=summary, checks=checks, runs=runs, ok=ok)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "training-modes.json"), "w") as f:
        json.dump(record, f, indent=1)
    print(_modes_table(summary, checks))
    return 0 if ok else 1


def _modes_table(summary: dict, checks: dict) -> str:
    s0 = next(iter(summary.values()))
    lines = [f"optimizer modes: GPT {s0['param_numel'] / 1e6:.1f}M parameters, {s0['managed']} NVMe shards of "
             f"{s0['shard_bytes'] / 1e6:.1f} MB; bytes per training step (exact), time indicative "
             f"(medians over {s0['repeats']} processes x their measured steps)",
             f"{'mode':20} {'read MB':>8} {'written MB':>10} {'total MB':>9} {'s/step':>7} {'fwd s':>6} "
             f"{'bwd s':>6} {'step() s':>8} {'stepped in bw':>14}"]
    for n, s in summary.items():
        lines.append(f"{n:20} {s['read_per_step'] / 1e6:>8.2f} {s['written_per_step'] / 1e6:>10.2f} "
                     f"{(s['read_per_step'] + s['written_per_step']) / 1e6:>9.2f} {s['step_s']:>7.3f} "
                     f"{s['forward_s']:>6.3f} {s['backward_s']:>6.3f} {s['opt_step_s']:>8.3f} "
                     f"{s['stepped_in_backward']:>8}/{s['managed']}")
    pa = summary.get("in-backward-overlap", {}).get("paired")
    if pa:
        lines.append(f"paired, in the overlap processes (alternate steps, {pa['pairs']} pairs): sync {pa['sync_s']:.3f} "
                     f"s, overlap {pa['overlap_s']:.3f} s; median per-pair ratio overlap/sync {pa['overlap_vs_sync']:.3f}")
    lines.append("checks: " + ", ".join(f"{k}={round(v, 3) if isinstance(v, float) else v}" for k, v in checks.items()))
    return "\n".join(lines)


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
    ib = s.get("zinf-nvme-ib")
    if ib is not None:  # stepped in backward: the same run's bytes and time beside zinf-nvme's
        res["in_backward"] = dict(read_per_step=ib["read_per_step"], written_per_step=ib["written_per_step"],
                                  step_s_vs_zinf_nvme=ib["step_s"] / z["step_s"])
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
        if "in_backward" in r:
            ib = r["in_backward"]
            lines.append(f"{regime:7} zinf-nvme-ib moved {(ib['read_per_step'] + ib['written_per_step']) / 1e9:.2f} "
                         f"GB/step; step time {ib['step_s_vs_zinf_nvme']:.2f}x zinf-nvme's")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
