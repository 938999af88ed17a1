"""Cold shard reads through zinf's engine, the way a streamed forward does them: a focused
microbenchmark for the I/O engine (issue 15), minutes rather than the inference benchmark's tens.

    python -m bench diskio [--layers 6] [--repeats 2] [--dir /tmp] [--out bench/results/diskio.json]
                           [--quick]

Writes a set of shard files shaped like a Llama-1.1B's layers (per layer: q and o 2048x2048, k and v
2048x256, gate, up and down 2048x5632, fp32; 6 layers ~1 GiB) through an OffloadEngine, once for a
buffered engine and once for an O_DIRECT one, then drops the page cache (root) before every
measurement and reads them all in layer order, as a forward consumes them:

    engine-direct / engine-buffered   submit_read of each file into a fresh host buffer
                      (engine.host_empty, as a fetch does), `ahead` files in flight before the one
                      being consumed is waited for; varying the engine's request size (CHUNK_BYTES)
                      and its I/O threads, checksums on and off
    mapped            map_file of each file `ahead` of its use (what a CPU gather of a buffered file
                      does), then every page read (a sum), checksums on and off
    preadv-direct / preadv-buffered   one thread, os.preadv of 16 MiB into a reused aligned buffer
    dd                `dd iflag=direct bs=16M` of each file in turn (the bound's bandwidth)

Reports GB/s per configuration (median of `repeats`, and the spread), with `uptime`'s load before
and after: the machine is shared, and only runs side by side compare.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
import time

SHAPES = (("q", 2048, 2048), ("k", 256, 2048), ("v", 256, 2048), ("o", 2048, 2048),
          ("gate", 5632, 2048), ("up", 5632, 2048), ("down", 2048, 5632))
MiB = 1 << 20


def _load() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _drop() -> None:
    from bench._harness import drop_caches

    if not drop_caches():
        raise SystemExit("bench diskio: dropping the page cache needs root")


def _write_set(engine, layers: int):
    import torch

    files = []
    g = torch.Generator().manual_seed(0)
    for layer in range(layers):
        for name, rows, cols in SHAPES:
            t = torch.randn(rows * cols, generator=g)
            fno, fd = engine.swap.acquire(f"layer {layer} {name}")
            engine.write_file(fd, t)
            files.append((fd, t.numel(), os.path.join(engine.swap.path, f"swap-{fno}.bin"), (rows, cols)))
    os.fsync(files[0][0])
    return files


def _use(t, shape, compute: bool) -> None:
    """What the forward does with a weight: a matmul of 128 tokens with it (`compute`)."""
    import torch

    if compute:
        x = _X.get(shape[1])
        if x is None:
            x = _X[shape[1]] = torch.randn(_TOKENS[0], shape[1])
        torch.mm(x, t.view(shape).t())


_X: dict = {}
_TOKENS = [32]


def _stream(engine, files, ahead: int, compute: bool = False) -> None:
    """Read every file in order through submit_read, `ahead` files in flight beyond the one waited."""
    import torch

    pending = []
    nxt = 0
    for i in range(len(files)):
        while nxt < len(files) and nxt <= i + ahead:
            fd, numel = files[nxt][:2]
            buf = engine.host_empty(numel, torch.float32)
            pending.append((buf, engine.submit_read(fd, buf)))
            nxt += 1
        buf, futures = pending.pop(0)
        for f in futures:
            f.result()
        _use(buf, files[i][3], compute)


def _mapped(engine, files, ahead: int, compute: bool = False, deferred: bool = False) -> None:
    """map_file each file `ahead` of its use (or submit_map, its checks joined at the use:
    `deferred`), then read every page of it."""
    from zinf_compile.runtime.engine import _join

    pending = []
    nxt = 0
    import torch

    for i in range(len(files)):
        while nxt < len(files) and nxt <= i + ahead:
            fd, numel = files[nxt][:2]
            if deferred:
                pending.append(engine.submit_map(fd, 0, numel, torch.float32))
            else:
                pending.append((engine.map_file(fd, 0, numel, torch.float32), []))
            nxt += 1
        t, futures = pending.pop(0)
        _join(futures)
        if compute:
            _use(t, files[i][3], True)
        else:
            float(t.view(torch.int32)[::1024].sum())  # a read of every page (one int per 4 KiB)


def _preadv(fds, sizes, request: int) -> None:
    import mmap

    buf = mmap.mmap(-1, request)
    mv = memoryview(buf)
    for fd, size in zip(fds, sizes):
        off = 0
        while off < size:
            n = min(request, size - off)
            got = os.preadv(fd, [mv[:n]], off)
            off += got


def _dd(paths) -> None:
    for p in paths:
        subprocess.run(["dd", f"if={p}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True,
                       capture_output=True)


def _measure(fn, nbytes: int, repeats: int) -> dict:
    rates = []
    for _ in range(repeats):
        _drop()
        t0 = time.perf_counter()
        fn()
        rates.append(nbytes / (time.perf_counter() - t0) / 1e9)
    return {"GBps": statistics.median(rates), "runs": [round(r, 3) for r in rates]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench diskio", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--out", default=None, help="JSON file for the results")
    p.add_argument("--quick", action="store_true", help="the engine's default request size and threads only")
    p.add_argument("--tokens", type=int, default=32, help="rows of the matmul with each weight (overlap)")
    p.add_argument("--only", default="", help="comma-separated kinds: engine,mapped,preadv,dd,overlap")
    args = p.parse_args(argv)

    from zinf_compile.runtime import engine as eng_mod

    _TOKENS[0] = args.tokens
    only = set(args.only.split(",")) if args.only else {"engine", "mapped", "reuse", "preadv", "dd", "overlap"}
    import torch

    torch.set_num_threads(2)
    folder = tempfile.mkdtemp(prefix="zinf-diskio-", dir=args.dir)
    results = {"load_before": _load(), "layers": args.layers, "rows": []}
    default_chunk = eng_mod.CHUNK_BYTES
    engines = {}
    try:
        for direct in (True, False):
            e = eng_mod.OffloadEngine(0, "nvme", folder, 4, direct)
            engines[direct] = (e, _write_set(e, args.layers))
        files = engines[True][1]
        nbytes = sum(f[1] * 4 for f in files)
        results["bytes"] = nbytes
        print(f"{len(files)} files, {nbytes / 1e9:.2f} GB per set; load {results['load_before']}", flush=True)

        def row(kind, **kw):
            fn = kw.pop("fn")
            r = {"kind": kind, **kw, **_measure(fn, nbytes, args.repeats)}
            results["rows"].append(r)
            desc = " ".join(f"{k}={v}" for k, v in kw.items())
            print(f"{kind:16s} {desc:55s} {r['GBps']:.2f} GB/s  {r['runs']}", flush=True)

        if "dd" in only:
            paths = [f[2] for f in files]
            row("dd", request_MiB=16, fn=lambda: _dd(paths))
            from bench._harness import direct_read_bandwidth

            one = [direct_read_bandwidth(folder) for _ in range(args.repeats)]
            results["rows"].append({"kind": "dd-256MiB-file", "GBps": statistics.median(one) / 1e3,
                                    "runs": [round(x / 1e3, 3) for x in one]})
            print(f"{'dd-256MiB-file':16s} {'(the inference bench probe)':55s} {results['rows'][-1]['GBps']:.2f} GB/s"
                  f"  {results['rows'][-1]['runs']}", flush=True)
        if "preadv" in only:
            for direct in (True, False):
                e, fs = engines[direct]
                fds, sizes = [f[0] for f in fs], [f[1] * 4 for f in fs]
                row("preadv-" + ("direct" if direct else "buffered"), request_MiB=16,
                    fn=lambda fds=fds, sizes=sizes: _preadv(fds, sizes, 16 * MiB))
        if "engine" in only:
            grid = [(default_chunk // MiB, 4, 1)] if args.quick else \
                [(c, t, a) for c in (1, 4, 16, 64) for t in (1, 2, 4, 8) for a in (1,)] + \
                [(16, 4, 0), (16, 4, 2), (16, 8, 2), (4, 8, 2)]
            for direct in (True, False):
                e, fs = engines[direct]
                for checksums in (True, False):
                    for chunk, threads, ahead in grid:
                        if not checksums and (chunk, threads, ahead) not in (
                                (16, 4, 1), (4, 4, 1), (4, 8, 1), (16, 8, 1), (4, 8, 2), (default_chunk // MiB, 4, 1)):
                            continue
                        eng_mod.CHUNK_BYTES = chunk * MiB
                        e.checksums = checksums
                        if e._pool is not None:
                            e._pool.shutdown()
                        e._pool = None
                        e.io_threads = threads
                        row("engine-" + ("direct" if direct else "buffered"), request_MiB=chunk, threads=threads,
                            ahead=ahead, checksums=checksums, fn=lambda e=e, fs=fs, a=ahead: _stream(e, fs, a))
                    eng_mod.CHUNK_BYTES = default_chunk
        if "mapped" in only:
            e, fs = engines[False]
            for checksums, checks in ((True, "map_file"), (True, "submit_map"), (False, "-")):
                e.checksums = checksums  # map_file checks on the calling thread; submit_map in pieces, joined at the use
                row("mapped", ahead=1, checksums=checksums, checks=checks,
                    fn=lambda e=e, fs=fs, d=checks == "submit_map": _mapped(e, fs, 1, deferred=d))
        if "reuse" in only:
            e, fs = engines[True]
            for rep in range(args.repeats):
                for checksums in (True, False):
                    for reuse in (False, True):
                        e.checksums = checksums
                        e.buffers.per_size = 2 if reuse else 0
                        row("engine-direct", request_MiB=default_chunk // MiB, threads=4, ahead=1,
                            checksums=checksums, reuse=reuse, fn=lambda e=e, fs=fs: _stream(e, fs, 1))
        if "overlap" in only:
            # the forward's shape of work: each weight's matmul while the next weights are read
            resident = [torch.randn(f[1]) for f in files]
            t0 = time.perf_counter()
            for w, f in zip(resident, files):
                _use(w, f[3], True)
            compute_s = time.perf_counter() - t0
            del resident
            results["compute_s"] = compute_s
            print(f"compute alone (weights in memory): {compute_s:.2f} s = {nbytes / compute_s / 1e9:.2f} GB/s",
                  flush=True)
            variants = [("direct", True, "reuse"), ("direct", True, "fresh"), ("direct", False, "reuse"),
                        ("mapped", True, "map_file"), ("mapped", True, "deferred"),
                        ("mapped", False, "-")]
            for rep in range(args.repeats):  # alternately, not one after the other
                for how, checksums, variant in variants:
                    e, fs = engines[how == "direct"]
                    e.checksums = checksums
                    e.buffers.per_size = 0 if variant == "fresh" else 2
                    if how == "direct":
                        fn = lambda e=e, fs=fs: _stream(e, fs, 1, True)
                    else:
                        fn = lambda e=e, fs=fs, d=variant == "deferred": _mapped(e, fs, 1, True, d)
                    _drop()
                    t0 = time.perf_counter()
                    fn()
                    s_ = time.perf_counter() - t0
                    results["rows"].append({"kind": "overlap-" + how, "checksums": checksums, "variant": variant,
                                            "rep": rep, "s": s_, "GBps": nbytes / s_ / 1e9})
                    print(f"overlap-{how:7s} checksums={checksums!s:5s} {variant:8s} rep {rep}: {s_:.2f} s "
                          f"({nbytes / s_ / 1e9:.2f} GB/s)", flush=True)
    finally:
        eng_mod.CHUNK_BYTES = default_chunk
        for e, _ in engines.values():
            e.close()
        shutil.rmtree(folder, ignore_errors=True)
    results["load_after"] = _load()
    print(f"load before {results['load_before']}, after {results['load_after']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
