"""Byte units, defined once: GB = 10**9 bytes, GiB = 2**30 bytes.

Vendors quote GPU memory capacity in binary units written "GB" (an "80GB" H100 has 80 GiB of
HBM) and bandwidth in decimal GB/s (3.35 TB/s = 3.35e12 bytes/s). The catalog stores capacity in
bytes and bandwidth in GB/s; only renderers turn numbers into human text.
"""

from __future__ import annotations

import re

from gpuwise.errors import GpuwiseError

KB, MB, GB, TB = 10**3, 10**6, 10**9, 10**12
KiB, MiB, GiB, TiB = 2**10, 2**20, 2**30, 2**40

_UNITS = {
    "b": 1, "": 1,
    "kb": KB, "mb": MB, "gb": GB, "tb": TB,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
    "k": KB, "m": MB, "g": GB, "t": TB,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(text: str) -> int:
    """Parse a size such as "24GB", "24 GiB", "512MiB" or plain bytes "1024" into bytes.

    >>> parse_bytes("24GiB")
    25769803776
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise GpuwiseError(
            f"cannot read the size {text!r}",
            hint="write a number and a unit, e.g. 24GB (10^9 bytes) or 24GiB (2^30 bytes)",
        )
    value = float(match.group(1)) * _UNITS[unit]
    if value >= 2**63:
        raise GpuwiseError(f"the size {text!r} is too large", hint="give a size below 8 EiB, e.g. 80GB")
    return round(value)


def human_bytes(n: float | None, *, binary: bool = True) -> str:
    """Format bytes for people: binary units by default ("80.0 GiB"), decimal on request."""
    if n is None:
        return "-"
    base, names = (1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB")) if binary else (
        1000, ("B", "kB", "MB", "GB", "TB", "PB"))
    value, i = float(n), 0
    while abs(value) >= base and i < len(names) - 1:
        value /= base
        i += 1
    if i == 0:
        return f"{int(value)} B"
    return f"{value:.0f} {names[i]}" if value == int(value) else f"{value:.1f} {names[i]}"
