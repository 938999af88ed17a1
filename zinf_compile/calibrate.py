"""`zinf calibrate`: measure this machine's compute and copy rates into a DeviceProfile."""
from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from zinf_compile.cost import BUILTIN, DeviceProfile

GB = 10**9


def _best(fn, repeats: int = 3, before=None) -> float:
    best = float("inf")
    for _ in range(repeats):
        if before is not None:
            before()
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
    progress(f"swap file write/read {mib} MiB in {offload_dir or tempfile.gettempdir()}: buffered, cold, O_DIRECT")
    disk = disk_bandwidths(offload_dir, mib)
    progress("  " + ", ".join(f"{k} {v / GB:.2f} GB/s" for k, v in disk.items() if v))
    # a buffered run's files stay in the page cache while they fit (planner.direct_io): it reads
    # what it wrote at the warm rate; a direct run reads the disk every time
    r, w = disk["buffered_read_warm"], disk["buffered_write"]
    base = BUILTIN["cpu"] if dev.type == "cpu" else BUILTIN["h100-80gb"]
    capacity = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else _ram()
    return DeviceProfile("local", dev.type, capacity, flops, mem_bw, d2h, h2d, r, w, base.collective_bw,
                         disk["direct_read"] or 0.0)


def disk_bandwidths(offload_dir: str | None = None, mib: int = 256) -> dict[str, float | None]:
    """Bytes/s of zinf's own engine on a `mib` MiB swap file in `offload_dir`: buffered writes
    (to the page cache) and reads (warm: from it; cold: the file's pages dropped first, which
    needs no root: posix_fadvise(DONTNEED) on the file after an fsync), and O_DIRECT reads and
    writes (None where the file system refuses O_DIRECT)."""
    from zinf_compile.runtime.engine import OffloadEngine

    root = tempfile.mkdtemp(prefix="zinf-calibrate-", dir=offload_dir)
    nbytes = mib << 20
    data = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    out: dict[str, float | None] = {}
    try:
        for direct in (False, True):
            eng = OffloadEngine(0, "nvme", root, 4, direct)
            try:
                if direct and not eng.direct:
                    out.update(direct_read=None, direct_write=None)
                    continue
                _, fd = eng.swap.acquire("calibration probe")
                buf = eng.host_empty(nbytes, torch.uint8)
                buf.copy_(data)

                def write():
                    eng.write_file(fd, buf)
                    os.fsync(fd)

                def evict():
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

                w = nbytes / _best(write, 2)
                cold = nbytes / _best(lambda: eng.read_file(fd, buf), 2, before=evict)
                if direct:
                    out.update(direct_read=cold, direct_write=w)
                else:
                    warm = nbytes / _best(lambda: eng.read_file(fd, buf), 2)
                    out.update(buffered_write=w, buffered_read_warm=warm, buffered_read_cold=cold)
            finally:
                eng.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _ram() -> int:
    import psutil

    return int(psutil.virtual_memory().total)
