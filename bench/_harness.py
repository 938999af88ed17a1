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


def run(module: str, name: str, argv: list[str], timeout: int, threads: int, count_files: bool = True) -> dict:
    """Run contender `name` of `module` in a fresh process with its own swap folder; its result,
    with the process's wall time and the files it left in that folder (`count_files`)."""
    tmp = tempfile.mkdtemp(prefix=f"zinf-{module.replace('.', '-')}-")
    out = os.path.join(tmp, "result.json")
    cmd = [sys.executable, "-m", module, "--worker", name, "--offload-dir", os.path.join(tmp, "swap"),
           "--result", out, *argv]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env(threads), capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    left = [f for _, _, fs in os.walk(os.path.join(tmp, "swap")) for f in fs] if count_files else []
    try:
        if proc.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{(proc.stderr or proc.stdout)[-4000:]}")
        with open(out) as f:
            r = json.load(f)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    r.update(contender=name, process_wall_s=wall, files_left=left)
    return r


def serve(args, worker) -> int | None:
    """In a worker process: run worker(args), write its result, return 0; else None."""
    if not args.worker:
        return None
    res = worker(args)
    with open(args.result, "w") as f:
        json.dump(res, f)
    return 0


def measure_steps(step, warmup: int, steps: int) -> dict:
    """Run step() `warmup` times, then (heap trimmed, VmRSS read, VmHWM reset) `steps` times
    timed. Returns the losses step() returned, the warm-up and step times, VmRSS after the
    warm-up, VmHWM over the timed steps and the bytes zinf's engines moved per timed step."""
    import gc

    from bench import _rss
    from bench.params import _engine_bytes

    losses, warm, times = [], [], []
    for _ in range(warmup):
        t0 = time.perf_counter()
        losses.append(step())
        warm.append(time.perf_counter() - t0)
    engines = _engine_bytes()
    gc.collect()
    after_warmup = _rss.baseline()  # trim, VmRSS, reset VmHWM
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(step())
        times.append(time.perf_counter() - t0)
    peak = _rss.hwm()
    moved = {k: (v - engines.get(k, 0)) / max(1, steps) for k, v in _engine_bytes().items()}
    return dict(losses=losses, warmup_s=warm, step_s=times, rss_after_warmup=after_warmup, peak=peak,
                moved_per_step=moved)
