"""Byte sizes as people write them: `12GiB`, `800MB`, `1.5G`, `4096` (plain bytes).

Binary units (KiB, MiB, GiB, TiB) are powers of 1024; decimal ones (KB, MB, GB, TB) powers
of 1000; a bare K, M, G or T is taken as binary, as `ulimit`, Docker and Kubernetes'
`Gi` readers expect of memory. Case and a space before the unit do not matter.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "kb": 10**3,
    "m": 1 << 20, "mib": 1 << 20, "mb": 10**6,
    "g": 1 << 30, "gib": 1 << 30, "gb": 10**9,
    "t": 1 << 40, "tib": 1 << 40, "tb": 10**12,
}  # fmt: skip
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """Bytes in `text`; ValueError saying what is accepted otherwise."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{text!r} is not a size: give bytes or a number with a unit, e.g. 12GiB, 800MB"
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_size(n: int) -> str:
    """`n` bytes for a log line or a message: 1.5 GiB, 300.0 MiB, 12 KiB, 10 B."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n >> 10} KiB" if abs(n) >= 1024 else f"{n} B"
