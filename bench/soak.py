"""Soak: does a long run hold its resources flat, and do models that come and go leave nothing?

    python -m bench soak [--steps 200] [--models 20] [--model-steps 3] [--every 10]
                         [--layers 2] [--hidden 256] [--batch 4] [--seq 64] [--out DIR]

Two contenders, each in a fresh process:

  zinf      phase 1: examples/gpt.py's GPT with every parameter managed in the NVMe tier and zinf's
            AdamW (states in files), trained --steps steps; every --every steps it reads the
            process's RSS (VmRSS), open files, OS threads and the bytes in its swap folder.
            phase 2: --models models one after another, each compiled with its own option set
            (its own swap folder, budget and tiling switch, so its own engine), trained
            --model-steps steps, dropped, `torch._dynamo.reset()`; the same readings after each.
  inductor  both phases under plain Inductor with torch.optim.AdamW (phase 2 alternating an
            Inductor option, with Inductor's FX graph cache and AOTAutograd's cache off, so each
            model compiles anew as each of zinf's does: with them on, every model after the second
            was a cache hit, which leaves less behind than a compile): phase 1's losses zinf's must
            equal, phase 2's RSS growth per model the baseline of what compiling leaves in a process.

Each reading trims the heap first (malloc_trim), so RSS counts what is held, not what the heap
kept of freed memory. Flat means: from the first reading after warm-up (a tenth of the readings)
to the last, open files, threads and swap bytes do not grow, and RSS grows by less than 5% in
phase 1 and by no more per model than Inductor's own phase 2 plus 0.25 MiB. Writes
<out>/soak.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from bench import _harness

DEFAULTS = dict(steps=200, models=20, model_steps=3, every=10, layers=2, hidden=256, batch=4, seq=64)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _reading(swap_root: str) -> dict:
    from bench import _rss

    _rss.trim()  # freed heap pages handed back first: RSS then counts what is held, not the heap's history
    status = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            status[k] = v.strip()
    swap = 0
    for d, _, fs in os.walk(swap_root):
        for name in fs:
            try:
                swap += os.path.getsize(os.path.join(d, name))
            except OSError:
                pass  # removed while we walked
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir("/proc/self/fd")),
            "threads": int(status["Threads"]), "swap_bytes": swap}


def _model(args, seed: int = 0):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import build

    model, (idx, targets) = build(batch=args.batch, seq=args.seq, layers=args.layers, hidden=args.hidden,
                                  heads=4, vocab=512, seed=seed)
    return model, idx, targets


def worker(args) -> dict:
    import gc

    import torch

    torch.set_num_threads(1)
    model, idx, targets = _model(args)
    if args.worker == "inductor":
        cm = torch.compile(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    else:
        import zinf_compile

        opts = {"params": "offload", "offload": "nvme", "offload_dir": os.path.join(args.offload_dir, "main")}
        cm = torch.compile(model, backend="zinf", options=opts)
        opt = zinf_compile.optimizer(cm, torch.optim.AdamW, lr=1e-3)
    losses, readings = [], []
    for step in range(args.steps):
        loss = cm(idx, targets).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        if args.worker == "zinf" and (step + 1) % args.every == 0:
            readings.append({"step": step + 1, **_reading(args.offload_dir)})
    out = {"losses": losses, "readings": readings}
    zinf = args.worker == "zinf"
    if zinf:
        import zinf_compile
        from zinf_compile.runtime.state import RUNTIME

    del cm, opt, model, loss  # the last loss's autograd graph holds the compiled function
    torch._dynamo.reset()
    gc.collect()
    if not zinf:  # each model compiles anew, as zinf's do (their option sets differ): no cache hit
        import torch._functorch.config

        torch._functorch.config.enable_autograd_cache = False
    models = []
    for i in range(args.models):
        m, idx, targets = _model(args, seed=i + 1)
        if zinf:
            opts = {"params": "offload", "offload": "nvme", "budget": f"{90 - i}%", "tiling": ("auto", "off")[i % 2],
                    "offload_dir": os.path.join(args.offload_dir, f"model{i}")}
            cm = torch.compile(m, backend="zinf", options=opts)
            opt = zinf_compile.optimizer(cm, torch.optim.AdamW, lr=1e-3)
        else:
            cm = torch.compile(m, options={"max_autotune": False, "epilogue_fusion": i % 2 == 0,
                                           "fx_graph_cache": False})
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        for _ in range(args.model_steps):
            cm(idx, targets).loss.backward()
            opt.step()
            opt.zero_grad()
        del cm, opt, m
        torch._dynamo.reset()
        gc.collect()
        models.append({"model": i + 1, "engines": len(RUNTIME.engines.values()) if zinf else 0,
                       **_reading(args.offload_dir)})
    out["models"] = models
    return out


def _growth(readings: list[dict]) -> tuple[dict, dict, dict]:
    start = readings[max(1, len(readings) // 10) - 1]
    last = readings[-1]
    return start, last, {k: last[k] - start[k] for k in ("rss_mib", "fds", "threads", "swap_bytes")}


def flat(readings: list[dict], baseline: list[dict] | None = None) -> dict:
    """Growth from the first reading after warm-up to the last, and whether that is flat: RSS
    within 5% (or, against `baseline`'s readings, no more per reading than it plus 0.25 MiB)."""
    start, last, growth = _growth(readings)
    ok = growth["fds"] <= 0 and growth["threads"] <= 0 and growth["swap_bytes"] <= 0
    out = {"from": start, "to": last, "growth": growth}
    if baseline is None:
        ok = ok and growth["rss_mib"] < 0.05 * start["rss_mib"]
    else:
        n = len(readings) - readings.index(start) - 1
        per, base = growth["rss_mib"] / max(1, n), _growth(baseline)[2]["rss_mib"] / max(1, n)
        out.update(rss_mib_per_model=per, baseline_rss_mib_per_model=base)
        ok = ok and per <= base + 0.25
    out["flat"] = ok
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench soak", description=__doc__.split("\n\n")[0])
    _harness.add_options(ap, DEFAULTS)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results"))
    args = ap.parse_args(argv)
    if args.worker:
        return _harness.run_worker(args, worker)
    keys = list(DEFAULTS)
    runs = {}
    for name in ("inductor", "zinf"):
        print(f"{name} ...", flush=True)
        runs[name] = _harness.run("bench.soak", name, _harness.as_argv(args, keys), timeout=7200, threads=1)[0]
    z, ind = runs["zinf"], runs["inductor"]
    diff = max(abs(a - b) for a, b in zip(z["losses"], ind["losses"]))
    res = {"args": {k: getattr(args, k) for k in keys}, "max_loss_diff": diff,
           "losses_equal": z["losses"] == ind["losses"], "first_last_loss": [z["losses"][0], z["losses"][-1]],
           "training": flat(z["readings"]), "models": flat(z["models"], baseline=ind["models"]),
           "engines_after_each_model": [m["engines"] for m in z["models"]],
           "files_left": z["files_left"], "readings": z["readings"], "model_readings": z["models"]}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "soak.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(f"losses: zinf vs Inductor max |diff| {diff:.3g} over {args.steps} steps "
          f"(equal: {res['losses_equal']}); loss {z['losses'][0]:.4f} -> {z['losses'][-1]:.4f}")
    for phase in ("training", "models"):
        g = res[phase]["growth"]
        print(f"{phase:9s} flat={res[phase]['flat']}: RSS {g['rss_mib']:+.1f} MiB, open files {g['fds']:+d}, "
              f"threads {g['threads']:+d}, swap bytes {g['swap_bytes']:+d}")
    m = res["models"]
    print(f"RSS per model compiled and dropped: zinf {m['rss_mib_per_model']:.2f} MiB, "
          f"Inductor alone {m['baseline_rss_mib_per_model']:.2f} MiB")
    print(f"engines after each model: {res['engines_after_each_model']}; files left at exit: {len(z['files_left'])}")
    print(f"wrote {os.path.join(args.out, 'soak.json')}")
    return 0 if res["training"]["flat"] and res["models"]["flat"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
