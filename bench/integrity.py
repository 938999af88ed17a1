"""What the swap records' checksums cost: the digest's throughput, the engine's file I/O, and a warm
streamed inference forward and training step, with checksums on and off side by side.

    python -m bench integrity [--layers 4] [--hidden 768] [--batch 2] [--seq 128] [--vocab 8192]
                              [--steps 3] [--repeats 2] [--mib 256] [--parts crc,io,infer,train]

Every record zinf writes to an NVMe swap file (a parameter's shard, its gradient, an optimizer
state, an offloaded activation) carries an xxh3-64 digest per 256 KiB block, checked on every read and
mapping (zinf_compile/runtime/engine.py). Parts, all in one run:

    crc    the engine's digest (xxh3-64) and zlib.crc32 (its predecessor, for reference) over a
           `--mib` buffer in 256 KiB blocks: one thread, and the I/O pool's 4 threads at once
    io     one engine per mode writing a `--mib` file (write_file), reading it back (read_file) and
           mapping it whole (map_file, then summed so every page is touched); page cache warm;
           best of 5, modes alternated
    infer  examples/gpt.py's GPT with every weight streamed from the NVMe tier (params="offload"),
           torch.no_grad forwards; one warm-up, `--steps` timed
    train  the same model training: forward, backward, zinf's AdamW over the NVMe tier (the
           shards, gradients and both states read and written each step); two warm-ups (the
           second is the first with states), `--steps` timed

infer and train run each mode (options={"checksums": True / False}) in a fresh process,
alternated `--repeats` times; the median step time of each mode is reported with the overhead
on/off - 1. Outputs and losses of the two modes must be equal (the checks change nothing they
compute with). The page cache is warm (the files fit).
Writes <out>/integrity.json.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from bench import _harness

MiB = 2**20
DEFAULTS = dict(layers=4, hidden=768, heads=12, batch=2, seq=128, vocab=8192, steps=3, threads=2, seed=0)
MODES = ("on", "off")


def _model(args):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
    from gpt import build

    return build(batch=args.batch, seq=args.seq, layers=args.layers, hidden=args.hidden, heads=args.heads,
                 vocab=args.vocab, seed=args.seed)


def worker(args) -> dict:
    """One (part, mode) contender: "infer-on", "train-off", ..."""
    import torch

    import zinf_compile

    part, mode = args.worker.split("-")
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)  # the modes' losses compared bit for bit
    model, (idx, targets) = _model(args)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": "nvme",
                                                         "offload_dir": args.offload_dir,
                                                         "checksums": mode == "on"})
    if part == "infer":
        def step():
            with torch.no_grad():
                return float(cm(idx).logits.double().sum())
        warmup = 1
    else:
        opt = zinf_compile.optimizer(model, torch.optim.AdamW, lr=1e-3)

        def step():
            loss = cm(idx, targets).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            return float(loss)
        warmup = 2
    res = _harness.measure_steps(step, warmup=warmup, steps=args.steps)
    from zinf_compile.runtime.state import RUNTIME

    assert all(e.checksums == (mode == "on") for e in RUNTIME.engines.values())
    return dict(res, weights=weights)


def _crc(mib: int) -> dict:
    """Throughput of the engine's block digest (xxh3-64), and of zlib.crc32 (what it replaced) for
    reference, over `mib` MiB in BLOCK_BYTES blocks: one thread, and the I/O pool's 4 at once."""
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from zinf_compile.runtime.engine import BLOCK_BYTES, _digest

    buf = np.random.default_rng(0).integers(0, 256, mib * MiB, dtype=np.uint8)
    blocks = [buf[k:k + BLOCK_BYTES] for k in range(0, buf.size, BLOCK_BYTES)]

    def best(fn, n=5):
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return buf.size / min(times)

    out = dict(block_bytes=BLOCK_BYTES, cpus=os.cpu_count())
    with ThreadPoolExecutor(4) as pool:
        for name, fn in (("digest", _digest), ("crc32", zlib.crc32)):
            def one(part, fn=fn):
                for b in part:
                    fn(b)
            quarters = [blocks[i::4] for i in range(4)]
            out[name] = dict(one_thread_Bps=best(lambda: one(blocks)),
                             four_threads_Bps=best(lambda: list(pool.map(one, quarters))))
    return out


def _io(mib: int) -> dict:
    """write_file / read_file / map_file of one `mib` file per engine, checksums on and off."""
    import torch

    from zinf_compile.runtime.engine import OffloadEngine

    folder = tempfile.mkdtemp(prefix="zinf-bench-integrity-")
    data = torch.randn(mib * MiB // 4)
    engines = {}
    for i, mode in enumerate(MODES):
        e = OffloadEngine(9_000_000 + i, "nvme", os.path.join(folder, mode), 4, False)
        e.checksums = mode == "on"
        _, fd = e.swap.acquire("bench record")
        engines[mode] = (e, fd, torch.empty_like(data))
    times = {m: {"write": [], "read": [], "map": []} for m in MODES}
    try:
        for rep in range(5):
            for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
                e, fd, back = engines[mode]
                t0 = time.perf_counter()
                e.write_file(fd, data)
                t1 = time.perf_counter()
                e.read_file(fd, back)
                t2 = time.perf_counter()
                mapped = e.map_file(fd, 0, data.numel(), torch.float32)
                mapped.view(torch.int32).sum()  # every page touched, as the graph's reads would
                t3 = time.perf_counter()
                del mapped
                times[mode]["write"].append(t1 - t0)
                times[mode]["read"].append(t2 - t1)
                times[mode]["map"].append(t3 - t2)
                assert torch.equal(back, data)
    finally:
        for e, _, _ in engines.values():
            e.close()
        os.rmdir(folder)
    nbytes = data.numel() * 4
    out = {m: {k: nbytes / min(v) for k, v in t.items()} for m, t in times.items()}
    out["overhead"] = {k: min(times["on"][k]) / min(times["off"][k]) - 1 for k in ("write", "read", "map")}
    out["bytes"] = nbytes
    return out


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog="python -m bench integrity", description=__doc__.split("\n")[0])
    _harness.add_options(ap, DEFAULTS)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--parts", default="crc,io,infer,train")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--out", default=os.path.join("bench", "results"))
    args = ap.parse_args(argv)
    if args.worker:
        return _harness.run_worker(args, worker)
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - {"crc", "io", "infer", "train"}:
        raise SystemExit(f"--parts: expected some of crc,io,infer,train, got {args.parts!r}")
    out: dict = {"args": {k: getattr(args, k) for k in (*DEFAULTS, "repeats", "mib")}}
    if "crc" in parts:
        out["crc"] = _crc(args.mib)
        for name in ("digest", "crc32"):
            r = out["crc"][name]
            print(f"{'xxh3-64 (the engine)' if name == 'digest' else 'zlib.crc32 (reference)'}: "
                  f"{r['one_thread_Bps'] / 1e9:.2f} GB/s one thread, {r['four_threads_Bps'] / 1e9:.2f} GB/s "
                  f"four threads ({out['crc']['cpus']} cpus)", flush=True)
    if "io" in parts:
        out["io"] = r = _io(args.mib)
        for k in ("write", "read", "map"):
            print(f"io {k:5}: on {r['on'][k] / 1e9:6.2f} GB/s, off {r['off'][k] / 1e9:6.2f} GB/s, "
                  f"overhead {100 * r['overhead'][k]:+.0f}%", flush=True)
    keys = list(DEFAULTS)
    for part in (p for p in ("infer", "train") if p in parts):
        names = [f"{part}-{m}" for m in MODES]
        runs = _harness.alternate(names, names, args.repeats, lambda n: _harness.run(
            "bench.integrity", n, _harness.as_argv(args, keys), args.timeout, args.threads))
        by = {m: [r for r in runs if r["contender"] == f"{part}-{m}"] for m in MODES}
        med = {m: _median([t for r in by[m] for t in r["step_s"]]) for m in MODES}
        losses = {m: by[m][0]["losses"] for m in MODES}
        rec = dict(step_s=med, overhead=med["on"] / med["off"] - 1, same_results=losses["on"] == losses["off"],
                   moved_per_step=by["on"][0]["moved_per_step"], weights=by["on"][0]["weights"],
                   all_step_s={m: [r["step_s"] for r in by[m]] for m in MODES})
        out[part] = rec
        moved = (rec["moved_per_step"]["read"] + rec["moved_per_step"]["written"]) / 1e6
        print(f"{part}: on {med['on']:.3f} s/step, off {med['off']:.3f} s/step, overhead "
              f"{100 * rec['overhead']:+.1f}% ({moved:.0f} MB moved per step; results equal: "
              f"{rec['same_results']})", flush=True)
        if not rec["same_results"]:
            print(f"  results differ: {losses}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "integrity.json"), "w") as f:
        json.dump(out, f, indent=1)
    return 0 if all(out[p]["same_results"] for p in ("infer", "train") if p in out) else 1


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


if __name__ == "__main__":
    sys.exit(main())
