"""Byte quantities: parse what people write ("300MB", "1.5GiB") and print them back."""
from __future__ import annotations

import re

from zinf_compile.errors import ZinfConfigError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: object, what: str = "budget") -> int:
    """An int, or a string such as "300MB", "2GiB", "1.5 gb", into a positive byte count."""
    if isinstance(value, bool):
        raise ZinfConfigError(f"{what}: expected a size such as '300MB' or '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = _PATTERN.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ZinfConfigError(
                f"{what}: cannot parse {value!r}; write a size such as '300MB', '2GiB' or 1048576"
            )
        n = int(float(m.group(1)) * _UNITS[unit])
    else:
        raise ZinfConfigError(f"{what}: expected a size such as '300MB' or '2GiB', got {value!r}")
    if n <= 0:
        raise ZinfConfigError(f"{what}: must be positive, got {value!r}")
    return n


def format_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"
