"""Process memory readings for the benchmarks (Linux): VmRSS, VmHWM, and the two resets.

    trim()          glibc malloc_trim(0): hand freed heap pages back, so they are not counted
    rss()           VmRSS of this process, bytes
    reset_hwm()     write "5" to /proc/self/clear_refs: VmHWM restarts from the current VmRSS
    hwm()           VmHWM, bytes: the highest VmRSS since the last reset

A measurement is `trim(); base = rss(); reset_hwm(); <work>; growth = hwm() - base`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os


@functools.lru_cache(None)
def _libc():
    return ctypes.CDLL("libc.so.6")


def trim() -> bool:
    """glibc's malloc_trim(0); True when some memory was released."""
    return bool(_libc().malloc_trim(0))


def glibc_version() -> str:
    try:
        f = _libc().gnu_get_libc_version
        f.restype = ctypes.c_char_p
        return f().decode()
    except (AttributeError, OSError):
        return "unknown"


def status() -> dict[str, int]:
    """The kB fields of /proc/self/status, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if len(parts) == 2 and parts[1] == "kB":
                out[key] = int(parts[0]) * 1024
    return out


def rss() -> int:
    return status()["VmRSS"]


def hwm() -> int:
    s = status()
    return s.get("VmHWM", s["VmRSS"])  # gVisor's /proc has no VmHWM: the current RSS then


def reset_hwm() -> None:
    """Reset the peak resident set size (Linux >= 4.0): VmHWM becomes the current VmRSS."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def baseline() -> int:
    """Trim the heap, read VmRSS, reset VmHWM; returns the VmRSS read."""
    trim()
    base = rss()
    reset_hwm()
    return base


def can_measure() -> str | None:
    """None when this process can take the readings, else why not."""
    if not os.path.exists("/proc/self/clear_refs"):
        return "no /proc/self/clear_refs (not Linux?)"
    try:
        _libc().malloc_trim
    except (AttributeError, OSError) as e:
        return f"no glibc malloc_trim: {e}"
    try:
        reset_hwm()
    except OSError as e:
        return f"cannot reset VmHWM: {e}"
    return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def mallinfo() -> dict[str, int] | None:
    """glibc's mallinfo2 (all arenas), bytes: `heap` (brk/arena space, resident or not), `mmapped`
    (large blocks in their own mappings), `in_use` (allocated heap bytes), `free` (free heap bytes:
    resident until trimmed once touched). None when this glibc has no mallinfo2 (< 2.33)."""
    try:
        f = _libc().mallinfo2
    except AttributeError:
        return None
    f.restype = _MallInfo2
    m = f()
    return {"heap": m.arena, "mmapped": m.hblkhd, "in_use": m.uordblks, "free": m.fordblks}
