"""The installed numba lies in the range the UDP intrinsics are known to work with (issue 14).

netdam/kernels/udp_io.py generates LLVM for libc calls through numba internals
(``numba.core.cgutils``, ``@intrinsic``), which change between numba releases without notice. A
numba outside the tested range must fail here, by name, rather than later as a strange compile
error or a wrong datagram count.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numba

from netdam.kernels.udp_io import NUMBA_TESTED

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]


def _version(text: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", text).groups()
    return int(major), int(minor)


def _dotted(v: tuple[int, int]) -> str:
    return f"{v[0]}.{v[1]}"


def test_numba_is_a_tested_version() -> None:
    low, high = NUMBA_TESTED
    found = _version(numba.__version__)
    assert low <= found < high, (
        f"numba {numba.__version__} is outside the range netdam's UDP intrinsics are tested with "
        f"(>={_dotted(low)},<{_dotted(high)}; netdam/kernels/udp_io.py uses numba internals): "
        f"install numba>={_dotted(low)},<{_dotted(high)}, or run the suite on this numba and widen "
        "NUMBA_TESTED and pyproject's bound together"
    )


def test_pyproject_pins_the_same_range() -> None:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [spec] = [d for d in deps if d.startswith("numba")]
    low, high = NUMBA_TESTED
    assert spec == f"numba>={_dotted(low)},<{_dotted(high)}", spec
