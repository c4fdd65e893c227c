"""Keys stay secret on the host: never on a node's command line (``ps`` shows argv to every
local user), files that hold keys are mode 0600 from creation, key files readable by others
are refused with the fix (issue 17)."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from netdam.cluster.clusterfile import derive
from netdam.cluster.launch import start_cluster
from netdam.cluster.secrets_io import (
    KeyFileError,
    key_pipe,
    parse_admin_keys,
    parse_key,
    read_admin_key_file,
    read_key_fd,
    read_key_file,
    write_private,
)

NODE = [sys.executable, "-m", "netdam", "node", "--bind", "127.0.0.1:0", "--memory", "1MiB"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.slow
def test_launched_nodes_get_the_key_through_a_pipe_not_argv(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Started node processes (not forked ones: the suite forks, launch.fork_node_processes)."""
    from netdam.cluster import launch

    monkeypatch.setattr(launch, "_FORK", [False])
    with start_cluster(2, memory=1 << 20, nics_per_process=1) as cluster:
        key = cluster.info.admin_key
        for proc in cluster.processes:
            argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
            text = b" ".join(argv).decode()
            assert "--admin-key-fd" in text and "--admin-key " not in text
            for spelling in (hex(key), f"0x{key:08x}", str(key)):
                assert spelling not in text, "the admin key is on a node's command line"
        assert _mode(cluster.path) == 0o600  # the cluster file holds the key


def test_private_files_are_0600_from_creation(tmp_path: Path) -> None:
    target = tmp_path / "cluster.toml"
    target.write_text("old")
    target.chmod(0o644)
    old_umask = os.umask(0)  # the most permissive umask: the mode must not depend on it
    try:
        write_private(target, "admin_key = 1\n")
    finally:
        os.umask(old_umask)
    assert _mode(target) == 0o600 and target.read_text() == "admin_key = 1\n"
    assert [p.name for p in tmp_path.iterdir()] == ["cluster.toml"]  # no temporary file left


def test_key_files_and_descriptors(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("0x5eed\n")
    key_file.chmod(0o600)
    assert read_key_file(key_file) == 0x5EED
    key_file.chmod(0o640)
    with pytest.raises(KeyFileError, match="chmod 600"):
        read_key_file(key_file)
    with pytest.raises(KeyFileError, match="not found"):
        read_key_file(tmp_path / "missing")
    assert read_key_fd(key_pipe(0xDEADBEEF)) == (0xDEADBEEF, b"")
    # The admin tag key travels beside the admin key (SPEC.md 2.6, "Control tags").
    tag_key = bytes(range(1, 17))
    assert read_key_fd(key_pipe(0xDEADBEEF, tag_key)) == (0xDEADBEEF, tag_key)
    key_file.write_text(f"0x5eed {tag_key.hex()}\n")
    key_file.chmod(0o600)
    assert read_admin_key_file(key_file) == (0x5EED, tag_key)
    for bad, message in (
        (f"0x5eed {bytes(16).hex()}", "not all zero"),
        ("0x5eed abc", "32 hex digits"),
        ("1 2 3", "3 words"),
    ):
        with pytest.raises(KeyFileError, match=message):
            parse_admin_keys(bad, "test")
    for bad, message in (
        ("zero", "not a key"),
        ("0", "1..2\\^32-1"),
        (str(1 << 32), "1..2\\^32-1"),
    ):
        with pytest.raises(KeyFileError, match=message):
            parse_key(bad, "test")


@pytest.mark.parametrize(
    ("extra", "mode", "message"),
    [
        (["--admin-key", "0x1234"], None, "--admin-key would show the key to every local user"),
        (["--admin-key-file", "{key}"], 0o644, "chmod 600"),
    ],
)
def test_node_refuses_keys_others_can_read(
    tmp_path: Path,
    extra: list[str],
    mode: int | None,
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """In this process: the refusal comes before the node binds or starts anything."""
    from netdam.cli.main import main

    key_file = tmp_path / "key"
    key_file.write_text("0x1234\n")
    if mode is not None:
        key_file.chmod(mode)
    argv = [
        *NODE[3:],
        "--shm-dir",
        str(tmp_path),
        *(a.replace("{key}", str(key_file)) for a in extra),
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.slow
def test_node_reads_its_key_from_a_private_file(tmp_path: Path) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("0x5eed\n")
    key_file.chmod(0o600)
    argv = [*NODE, "--shm-dir", str(tmp_path), "--admin-key-file", str(key_file)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("ready ") and line.strip().endswith(f"admin_key={0x5EED}"), line
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_node_takes_both_keys_from_a_private_cluster_file(tmp_path: Path) -> None:
    """`netdam node --admin-key-file c.toml` (README, several hosts): the admin key and the admin
    tag key of the file's group key, from a file no one else can read."""
    from argparse import Namespace

    from netdam.cli.cluster import _admin_keys
    from netdam.cli.common import CommandError
    from netdam.cluster.clusterfile import ClusterFile, NodeEntry, write_cluster

    path = tmp_path / "c.toml"
    info = ClusterFile(
        name="nd",
        admin_key=0x5EED,
        mtu=9000,
        group_key="ab" * 16,
        nodes=(NodeEntry(rank=0, address="127.0.0.1", port=7744),),
    )
    write_cluster(info, path)
    args = Namespace(admin_key=None, admin_key_file=path, admin_key_fd=None)
    assert _admin_keys(args) == (0x5EED, info.admin_tag_key) and len(info.admin_tag_key) == 16
    path.chmod(0o644)
    with pytest.raises(CommandError, match="chmod 600"):
        _admin_keys(args)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=32),
    st.lists(
        st.one_of(st.integers(-(2**70), 2**70), st.text(max_size=8), st.booleans()), max_size=4
    ),
)
def test_a_derived_value_is_the_hash_of_the_secret_and_its_parts_joined(
    secret: bytes, parts: list[int | str]
) -> None:
    """derive builds what it hashes in two steps (the leading parts once per secret, cached):
    the same bytes as the plain formula, whatever the parts (True is not 1)."""
    plain = hashlib.sha256(secret + b"\x00" + ":".join(str(p) for p in parts).encode()).digest()
    assert derive(secret, *parts) == plain
    assert derive(secret, *parts) == plain  # from the cache
