"""`zinf calibrate`: measure this machine's compute and copy rates into a DeviceProfile."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from zinf_compile.cost import BUILTIN, DeviceProfile

GB = 10**9


def _best(fn, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def calibrate(offload_dir: str | None = None, device: str = "cpu", progress=print, mib: int = 256) -> DeviceProfile:
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = 2048 if dev.type == "cpu" else 8192
    a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
    progress(f"matmul {n}x{n} fp32")
    t = _best(lambda: (a @ b, sync()))
    flops = 2 * n**3 / t
    nbytes = mib << 20
    x = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    progress(f"device memory copy {mib} MiB")
    mem_bw = 2 * nbytes / _best(lambda: (y.copy_(x), sync()))
    d2h = h2d = mem_bw
    if dev.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        d2h = nbytes / _best(lambda: (host.copy_(x), sync()))
        h2d = nbytes / _best(lambda: (x.copy_(host), sync()))
    root = tempfile.mkdtemp(prefix="zinf-calibrate-", dir=offload_dir)
    try:
        path = os.path.join(root, "probe.bin")
        data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).numpy()
        progress(f"NVMe write/read {mib} MiB in {root}")

        def write():
            with open(path, "wb", buffering=0) as f:
                f.write(memoryview(data))
                os.fsync(f.fileno())

        def read():
            with open(path, "rb", buffering=0) as f:
                f.readinto(memoryview(data))

        w = nbytes / _best(write, 2)
        r = nbytes / _best(read, 2)  # page cache included: what a prefetch of a fresh write sees
    finally:
        shutil.rmtree(root, ignore_errors=True)
    base = BUILTIN["cpu"] if dev.type == "cpu" else BUILTIN["h100-80gb"]
    capacity = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else _ram()
    return DeviceProfile("local", dev.type, capacity, flops, mem_bw, d2h, h2d, r, w, base.collective_bw)


def _ram() -> int:
    import psutil

    return int(psutil.virtual_memory().total)
