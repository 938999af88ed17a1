"""What a managed parameter's `__torch_function__` costs (runtime/access.py), on the compiled step
and on a read outside the graph.

    python -m bench access [--width 2048] [--steps 20] [--tier nvme] [--cold]

  step      a 4-layer MLP (width x width matrices, all managed) trained with zinf: the calls its
            compiled step makes into ManagedParameter.__torch_function__ per step, and what they
            cost (the same calls timed on the class against a plain parameter's)
  read      `p.norm()` of one managed width x width weight (a gather from its tier) against the
            same norm of a resident copy; with --cold the page cache is dropped before each read
            (root only), with the device's O_DIRECT read bandwidth (dd) measured in the same run
  state     model.state_dict() (every managed weight gathered) against the resident model's

Writes <out>/access.json (access-cold.json with --cold).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

from bench import _harness


def _time(fn, n: int) -> float:
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def run(args) -> dict:
    import torch
    import torch.nn as nn

    import zinf_compile
    from zinf_compile.runtime import access
    from zinf_compile.runtime.state import STORE

    torch.manual_seed(0)
    w = args.width
    model = nn.Sequential(*[nn.Linear(w, w) for _ in range(4)])
    ref = nn.Sequential(*[nn.Linear(w, w) for _ in range(4)])
    ref.load_state_dict(model.state_dict())
    root = args.offload_dir or tempfile.mkdtemp(prefix="zinf-bench-access-")
    cm = torch.compile(model, backend="zinf", options={"params": "offload", "offload": args.tier,
                                                         "offload_dir": root})
    opt = zinf_compile.optimizer(cm, torch.optim.AdamW, lr=1e-3)
    x = torch.randn(16, w)

    def step():
        cm(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    managed = [p for p in model.parameters() if STORE.is_managed(p)]
    calls = []
    tf = access.ManagedMixin.__dict__["__torch_function__"].__func__

    def counting(cls, func, types, a=(), k=None):
        calls.append(getattr(func, "__name__", str(func)))
        return tf(cls, func, types, a, k)

    access.ManagedMixin.__torch_function__ = classmethod(counting)
    try:
        step()
    finally:
        access.ManagedMixin.__torch_function__ = classmethod(tf)
    step_s = _time(step, args.steps)
    p, q = managed[0], nn.Parameter(torch.randn(8, 8))
    per_call = {}
    for name, t in (("managed", p), ("plain", q)):
        per_call[name] = _time(lambda: [t._is_view() for _ in range(1000)], 20) / 1000
    out = {"width": w, "tier": args.tier, "managed": len(managed), "step_s": step_s,
           "tf_calls_per_step": len(calls), "tf_call_names": sorted(set(calls)),
           "tf_call_s": per_call, "tf_share_of_step": len(calls) * (per_call["managed"] - per_call["plain"]) / step_s}

    r = ref[0].weight
    def drop():
        if args.cold:
            _harness.drop_caches()
    reads, resident = [], []
    for _ in range(args.reads):
        drop()
        t0 = time.perf_counter()
        with torch.no_grad():
            p.norm()
        reads.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with torch.no_grad():
            r.norm()
        resident.append(time.perf_counter() - t0)
    out["read"] = {"bytes": p.numel() * p.element_size(), "managed_s": statistics.median(reads),
                   "resident_s": statistics.median(resident), "cold": bool(args.cold)}
    drop()
    out["state_dict"] = {"managed_s": _time(model.state_dict, 3), "resident_s": _time(ref.state_dict, 3)}
    if args.cold and args.tier == "nvme":
        out["direct_read_MBps"] = _harness.direct_read_bandwidth(root)
    zinf_compile.reset()
    return out


def main(argv) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench access", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--reads", type=int, default=5)
    ap.add_argument("--tier", choices=("cpu", "nvme"), default="nvme")
    ap.add_argument("--cold", action="store_true", help="drop the page cache before each read (root)")
    ap.add_argument("--offload-dir", default=None)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    result = run(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "access-cold.json" if args.cold else "access.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return 0
