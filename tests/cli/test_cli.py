"""CLI conventions: every subcommand has --help, --json prints one object, exit codes."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from netdam.cli.main import build_parser, main
from netdam.protocol.constants import Opcode
from netdam.protocol.packet import Packet


def _all_command_paths() -> list[list[str]]:
    paths: list[list[str]] = []

    def walk(parser: argparse.ArgumentParser, prefix: list[str]) -> None:
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    paths.append(prefix + [name])
                    walk(sub, prefix + [name])

    walk(build_parser(), [])
    return paths


def test_every_subcommand_has_help(capsys: pytest.CaptureFixture[str]) -> None:
    paths = _all_command_paths()
    assert ["demo"] in paths and ["decode"] in paths and ["model"] in paths
    for path in paths:
        with pytest.raises(SystemExit) as info:
            main(path + ["--help"])
        assert info.value.code == 0
        assert "usage: netdam " + " ".join(path) in capsys.readouterr().out


@pytest.mark.slow
def test_demo_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--nodes", "3", "--count", "5003", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is True and result["nodes"] == 3 and result["bytes"] == 5003 * 4
    assert result["allreduce"]["ranks_identical"] is True
    assert result["allreduce"]["equals_reference"] is True
    assert result["pool"]["fetch_add_counter"] == result["pool"]["fetch_add_expected"]


# One non-f32 dtype through the whole demo; every dtype goes through `netdam allreduce` in
# tests/host/test_allreduce.py (the suite keeps under 5 minutes on 2 cores).
@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f16"])
def test_demo_dtypes(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--nodes", "2", "--count", "4099", "--dtype", dtype, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["allreduce"]["equals_reference"] is True


@pytest.mark.slow
def test_demo_text_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--nodes", "2", "--size", "64KiB"]) == 0
    out = capsys.readouterr().out
    assert (
        out.startswith("netdam demo: OK") and "node processes and a switch on loopback UDP" in out
    )


def test_usage_errors_exit_2_with_json(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--size", "64MB", "--json"])
    assert info.value.code == 2
    result = json.loads(capsys.readouterr().out)
    assert result["ok"] is False and "write 64MiB" in result["error"]
    with pytest.raises(SystemExit) as info:  # checked at parse time, like every value
        main(["demo", "--nodes", "1", "--json"])
    assert info.value.code == 2
    assert "--nodes: 1 is out of range: give 2..64" in json.loads(capsys.readouterr().out)["error"]


def test_usage_error_without_json_names_the_fix(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["demo", "--size", "1.5MiB"])
    assert info.value.code == 2
    assert "invalid size '1.5MiB'" in capsys.readouterr().err


#: In a fresh process: build the parser, import what `up` and `down` import, and seal a control
#: request as `stats` sends it; print the sealed bytes and whether numba was loaded.
_NO_KERNELS = """
import sys
from netdam.cli.main import build_parser
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import LocalCluster
from netdam.protocol.constants import Opcode
from netdam.protocol.packet import Packet

build_parser()
with ControlClient(admin_key=77, client_id=5, admin_tag_key=bytes(range(16))) as client:
    sealed = client.encode(Packet(Opcode.COUNTERS, rkey=77, client_id=5, txn_id=9))
print(sealed.hex(), "numba" in sys.modules)
"""


def test_commands_that_need_no_kernel_load_neither_numba_nor_the_kernels() -> None:
    """`netdam --version`, every parser, `up`, `down` and `stats` need no compiled kernel: loading
    numba and the kernels cost each of them ~1.5 s of start-up (`netdam --version` took 2.2 s).
    A control request is then sealed by the plain-Python reference, to the same bytes the
    compiled sealer gives (this process has the kernels loaded)."""
    from netdam.cluster.control import ControlClient

    out = subprocess.run(
        [sys.executable, "-c", _NO_KERNELS], capture_output=True, text=True, timeout=60, check=True
    )
    sealed_hex, numba_loaded = out.stdout.split()
    assert numba_loaded == "False", "a command that needs no kernel loaded numba"
    with ControlClient(admin_key=77, client_id=5, admin_tag_key=bytes(range(16))) as client:
        compiled = client.encode(Packet(Opcode.COUNTERS, rkey=77, client_id=5, txn_id=9))
    assert "netdam.kernels.tag" in sys.modules and bytes.fromhex(sealed_hex) == compiled
