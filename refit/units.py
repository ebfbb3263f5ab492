"""Byte units and the one formatter every human-readable size in refit goes through."""

from __future__ import annotations

KiB = 2**10
MiB = 2**20
GiB = 2**30


def fmt_bytes(n: float) -> str:
    """Binary units, one decimal: ``fmt_bytes(3 * 2**30) == "3.0 GiB"``; whole bytes below 1 KiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
