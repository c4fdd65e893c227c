"""Architecture rules checked by reading imports (code-models.md 7.2): sans-I/O cores, numba
only in kernels, scapy only where dissection happens."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
IO_MODULES = {"socket", "asyncio", "selectors", "threading", "time", "asyncio_dgram", "subprocess"}
#: Sans-I/O cores: protocol logic that takes datagrams and `now` and returns datagrams and events.
CORES = [
    "protocol/constants.py",
    "protocol/packet.py",
    "protocol/errors.py",
    "netdam/core/node.py",
    "netdam/core/fabric.py",
    "netdam/core/faults.py",
    "netdam/core/events.py",
    "protocol/counters.py",
    "switch/core.py",
    "switch/addrmap.py",
    "switch/faults.py",
]


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_cores_do_no_io() -> None:
    for rel in CORES:
        assert not imports_of(ROOT / rel) & IO_MODULES, rel


def test_numba_only_in_kernels() -> None:
    for path in list((ROOT / "netdam").rglob("*.py")) + list((ROOT / "protocol").rglob("*.py")) + list((ROOT / "switch").rglob("*.py")):
        if "kernels" in path.parts:
            continue
        assert "numba" not in imports_of(path), path


def test_scapy_imported_lazily() -> None:
    """scapy at module level only in the scapy layer; everything else imports it inside functions."""
    for path in list((ROOT / "netdam").rglob("*.py")) + list((ROOT / "protocol").rglob("*.py")) + list((ROOT / "switch").rglob("*.py")):
        if path.name == "scapy_layer.py":
            continue
        tree = ast.parse(path.read_text())
        top = {
            n.module.split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom) and n.module
        }
        top |= {
            a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names
        }
        assert "scapy" not in top, path
