"""Human units for the report: bytes, seconds, and the unit of a byte axis."""
from __future__ import annotations

from zinf_compile.units import format_bytes

__all__ = ["format_bytes", "format_seconds", "byte_unit"]

_BYTE_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def format_seconds(s: float) -> str:
    """Seconds as "1.50 s", "12.30 ms" or "4.00 µs" (two decimals)."""
    if s == 0:
        return "0 s"
    a = abs(s)
    if a >= 1:
        return f"{s:.2f} s"
    if a >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.2f} µs"


def byte_unit(largest: float) -> tuple[str, int]:
    """The unit (name, scale) in which to draw an axis whose largest value is `largest` bytes."""
    for unit, scale in _BYTE_UNITS:
        if largest >= scale:
            return unit, scale
    return "B", 1
