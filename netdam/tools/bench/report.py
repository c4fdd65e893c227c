"""What the benchmarks' reports share: where the numbers were measured, and the pool's table of
phases (``bench pool`` and ``bench pool --async`` print the same columns)."""

from __future__ import annotations

import os
import platform
from importlib import metadata
from typing import Any

import numpy as np


def package_version(dist: str) -> str | None:
    """The installed version of distribution *dist*, or None."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info() -> dict[str, Any]:
    """Where the numbers were measured: cores, kernel, Python, numpy and numba."""
    return {
        "cores": os.cpu_count(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "numba": package_version("numba"),
    }


def phase_table(results: dict[str, dict[str, Any]], wrong: bool = False) -> list[str]:
    """Header and one line per phase: ops/s, p50/p99 us, timeouts (and wrong READs)."""
    lines = [
        f"  {'phase':<20}{'ops/s':>12}{'p50 us':>9}{'p99 us':>9}{'timeouts':>10}"
        + (f"{'wrong':>7}" if wrong else "")
    ]
    for name, r in results.items():
        p50 = "-" if r["p50_us"] is None else f"{r['p50_us']:.0f}"
        p99 = "-" if r["p99_us"] is None else f"{r['p99_us']:.0f}"
        lines.append(
            f"  {name:<20}{r['ops']:>12,.0f}{p50:>9}{p99:>9}{r['timeouts']:>10}"
            + (f"{r['mismatches']:>7}" if wrong else "")
        )
    return lines
