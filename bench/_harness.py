"""What the benchmarks share: each contender in a fresh process (`python -m bench.NAME --worker
CONTENDER ...`) that writes its result as JSON, and the options that carry it there."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time


def env(threads: int) -> dict:
    """The workers' environment: this checkout importable, `threads` OpenMP threads."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = root + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    return dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONPATH=path, TOKENIZERS_PARALLELISM="false")


def add_options(ap: argparse.ArgumentParser, defaults: dict) -> None:
    """--KEY for each default (underscores as dashes), and the hidden worker options."""
    for k, v in defaults.items():
        ap.add_argument(f"--{k.replace('_', '-')}", dest=k, type=type(v), default=v)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--offload-dir", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)


def as_argv(args, keys) -> list[str]:
    """The options that give a worker the same values as `args` for `keys`."""
    out: list[str] = []
    for k in keys:
        out += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    return out


def run(module: str, name: str, argv: list[str], timeout: int, threads: int, count_files: bool = True,
        worker: str | None = None, ranks: int = 1, env_extra: dict | None = None) -> list[dict]:
    """Run contender `name` of `module` in fresh processes with their own swap folder: `worker`
    (default `name`) in one process, or in `ranks` under torchrun (--standalone), with `env_extra`
    set in their environment; the result of each rank, with the processes' wall time and the
    files they left in that folder (`count_files`)."""
    tmp = tempfile.mkdtemp(prefix=f"zinf-{module.replace('.', '-')}-")
    out = os.path.join(tmp, "result.json")
    args = ["--worker", worker or name, "--offload-dir", os.path.join(tmp, "swap"), "--result", out, *argv]
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
               "--module", module, *args]
    else:
        cmd = [sys.executable, "-m", module, *args]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env={**env(threads), **(env_extra or {})}, capture_output=True, text=True,
                          timeout=timeout)
    wall = time.perf_counter() - t0
    left = [f for _, _, fs in os.walk(os.path.join(tmp, "swap")) for f in fs] if count_files else []
    try:
        files = [_result_path(out, r, ranks) for r in range(ranks)]
        if proc.returncode != 0 or not all(os.path.exists(f) for f in files):
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-4000:]}")
        results = []
        for f in files:
            with open(f) as fh:
                results.append(json.load(fh))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for r in results:
        r.update(contender=name, process_wall_s=wall, files_left=left)
    return results


def _result_path(out: str, rank: int, ranks: int) -> str:
    return out if ranks == 1 else f"{out}.rank{rank}"  # torchrun interleaves the ranks' stdout: a file each


def serve(args, worker) -> int | None:
    """In a worker process: run worker(args), write its result (a file per rank under torchrun),
    return 0; else None."""
    if not args.worker:
        return None
    res = worker(args)
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    with open(_result_path(args.result, int(os.environ.get("RANK", "0")), ranks), "w") as f:
        json.dump(res, f)
    return 0


def alternate(names: list[str], known, repeats: int, run_one, after_repeat=None) -> list[dict]:
    """Each of `names` (checked against `known`) run by run_one(name) -> [result, ...], `repeats`
    times, the order rotated each repeat so no contender always runs first or after the same one;
    after_repeat() after each. Every result, in the order run."""
    for n in names:
        if n not in known:
            raise SystemExit(f"unknown contender {n!r}; expected some of {', '.join(known)}")
    runs: list[dict] = []
    for r in range(repeats):
        for n in names[r % len(names):] + names[:r % len(names)]:
            print(f"[{r + 1}/{repeats}] {n} ...", flush=True)
            runs += run_one(n)
        if after_repeat is not None:
            after_repeat()
    return runs


def device(name: str) -> str:
    """The device a benchmark runs on: "auto" is CUDA where torch sees one, else the CPU."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device here")
    return name


class Meter:
    """This process's memory on its device, as the benchmarks read it. On a CPU device: VmRSS with
    the heap trimmed first, and VmHWM for the peak (bench/_rss.py). On CUDA: torch's caching
    allocator, memory_allocated and max_memory_allocated (what a plan's budget bounds there; the
    process's host RSS is reported beside it)."""

    def __init__(self, dev: str) -> None:
        self.cuda = dev.startswith("cuda")

    def now(self) -> int:
        """What is held now (after a gc; the heap trimmed on a CPU)."""
        import gc

        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return torch.cuda.memory_allocated()
        from bench import _rss

        _rss.trim()
        return _rss.rss()

    def baseline(self) -> int:
        """now(), then the peak restarts from it."""
        held = self.now()
        if self.cuda:
            import torch

            torch.cuda.reset_peak_memory_stats()
        else:
            from bench import _rss

            _rss.reset_hwm()
        return held

    def peak(self) -> int:
        """The most held since the last baseline()."""
        if self.cuda:
            import torch

            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated()
        from bench import _rss

        return _rss.hwm()

    def host_peak(self) -> int:
        from bench import _rss

        return _rss.hwm()


def engine_bytes() -> dict:
    """Bytes zinf's offload engines have read and written in this process so far."""
    from zinf_compile.runtime.state import RUNTIME

    out = {"read": 0, "written": 0}
    for e in RUNTIME.engines.values():
        out["read"] += e.stats["bytes_read"]
        out["written"] += e.stats["bytes_written"]
    return out


def engines_direct() -> bool:
    """Whether any of this process's NVMe engines has O_DIRECT swap files."""
    from zinf_compile.runtime.state import RUNTIME

    return any(e.direct for e in RUNTIME.engines.values())


# set (to "1") in a benchmark's environment: measure_steps drops the page cache before each timed
# step, so the workers of benchmarks that share a parent (bench params) run cold without new options
COLD_ENV = "ZINF_BENCH_COLD"


def measure_steps(step, warmup: int, steps: int, meter: Meter | None = None) -> dict:
    """Run step() `warmup` times, then (memory read and its peak reset: `meter`, VmRSS by default)
    `steps` times timed. Returns the losses step() returned (a float: it waits for the device), the
    warm-up and step times, the memory held after the warm-up, the peak over the timed steps and
    the bytes zinf's engines moved per timed step."""
    meter = meter or Meter("cpu")
    losses, warm, times = [], [], []
    for _ in range(warmup):
        t0 = time.perf_counter()
        losses.append(step())
        warm.append(time.perf_counter() - t0)
    engines = engine_bytes()
    after_warmup = meter.baseline()
    cold = os.environ.get(COLD_ENV) == "1"
    for _ in range(steps):
        if cold and not drop_caches():
            raise SystemExit("the cold regime drops the page cache before each step: it needs root")
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    peak = meter.peak()
    moved = {k: (v - engines.get(k, 0)) / max(1, steps) for k, v in engine_bytes().items()}
    return dict(losses=losses, warmup_s=warm, step_s=times, held_after_warmup=after_warmup, peak=peak,
                moved_per_step=moved)


def drop_caches() -> bool:
    """Drop the page cache (root only): the next read of a swap file comes from the disk. False
    where this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def direct_read_bandwidth(folder: str, mib: int = 256) -> float | None:
    """MB/s of `dd iflag=direct bs=16M` reading a fresh `mib` MiB file in `folder` (the disk the
    offload folder is on, past the page cache); None where dd or O_DIRECT is not available."""
    import re
    import subprocess

    path = os.path.join(folder, "zinf-dd-probe.bin")
    try:
        with open(path, "wb") as f:
            for _ in range(mib):
                f.write(os.urandom(1 << 20))
        os.sync()
        p = subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=16M", "iflag=direct"],
                           capture_output=True, text=True, timeout=600)
        m = re.search(r"(\d+) bytes .* copied, ([\d.]+) s", p.stderr)
        return int(m.group(1)) / float(m.group(2)) / 1e6 if m and p.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None
    finally:
        if os.path.exists(path):
            os.remove(path)


def run_worker(args, worker, needs_dir: bool = True) -> int:
    """A benchmark's `--worker` entry: one contender, its result served to the parent (`--result`)
    or printed as JSON when run by hand; a swap folder made (and removed) when the contender
    `needs_dir` and none was given."""
    own = needs_dir and not args.offload_dir  # run by hand: make (and remove) a swap folder
    if own:
        args.offload_dir = tempfile.mkdtemp(prefix="zinf-bench-")
    try:
        if args.result:
            return serve(args, worker)
        print(json.dumps(worker(args)), flush=True)
        return 0
    finally:
        if own:
            shutil.rmtree(args.offload_dir, ignore_errors=True)


def disk_usage(path: str) -> int:
    """Bytes allocated on disk under `path` (st_blocks: a sparse file counts what it holds)."""
    total = 0
    for dirpath, _, filenames in os.walk(path):
        for name in filenames:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:  # removed meanwhile
                pass
    return total
