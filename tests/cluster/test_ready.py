"""Ready means ready (issue 23): a process that says ``ready`` compiles nothing afterwards, a
slow start is waited for while it works and given up once it stalls, and compiled kernels live
in a per-user cache outside the installed package."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from netdam.cluster import launch
from netdam.cluster.launch import ClusterStartError
from netdam.kernels import cache_dir
from netdam.shell import startup

TESTS = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_nothing_compiles_after_a_process_is_ready() -> None:
    """After the launcher's warm-up (what every node and switch process also runs before its
    ``ready`` line), every opcode and status of the fuzzer's worlds, the node tests' control
    exchanges and collectives of every dtype need no new kernel specialization: a node that
    compiled one on its first REGISTER answered after the switch had given up (ALLOC refused
    with TIMEOUT on a busy machine)."""
    out = subprocess.run(
        [sys.executable, str(TESTS / "late_specializations.py")],
        cwd=TESTS,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _sleeper(code: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)


@pytest.mark.slow
def test_start_waits_for_a_process_that_keeps_working(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A process busy for longer than the stall limit (a compile on a loaded machine) is waited
    for, not declared failed."""
    monkeypatch.setattr(startup, "STALL_S", 0.6)
    proc = _sleeper(
        "import time\nend = time.monotonic() + 2.0\nwhile time.monotonic() < end: pass\n"
        "print('ready control_port=4242', flush=True)\ntime.sleep(30)"
    )
    try:
        start = time.monotonic()
        assert launch._wait_ready([proc], [[(0, ("127.0.0.1", 1))]], [tmp_path / "log"]) == {
            0: 4242
        }
        assert time.monotonic() - start >= 1.5
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_start_gives_up_on_a_process_that_stalls(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A process that uses no CPU and says nothing fails the start, named, after the stall limit."""
    monkeypatch.setattr(startup, "STALL_S", 1.0)
    proc = _sleeper("import time; time.sleep(60)")
    try:
        start = time.monotonic()
        with pytest.raises(
            ClusterStartError, match=r"used no CPU for 1 s: node rank 0 at 127.0.0.1:1 "
        ):
            launch._wait_ready([proc], [[(0, ("127.0.0.1", 1))]], [tmp_path / "log"])
        assert time.monotonic() - start < 10
    finally:
        proc.kill()
        proc.wait()


def test_kernel_cache_is_outside_the_package() -> None:
    folder = cache_dir.kernel_cache_dir()
    package = Path(cache_dir.__file__).resolve().parent
    assert package not in folder.parents
    assert not list(package.glob("__pycache__/*.nb[ic]")), (
        "numba wrote cache files into the package"
    )
    assert list(folder.glob("*.nbi")), f"no cache index in {folder}"
    assert stat.S_IMODE(folder.stat().st_mode) & 0o077 == 0


def _cache_dir_in_child(env: dict[str, str]) -> tuple[str, str]:
    code = (
        "import logging, sys; logging.basicConfig(stream=sys.stderr)\n"
        "from netdam.kernels import cache_dir; print(cache_dir.kernel_cache_dir())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip(), out.stderr


def test_cache_root_follows_netdam_cache_dir_and_keys_by_sources(tmp_path: Path) -> None:
    where, _ = _cache_dir_in_child({"NETDAM_CACHE_DIR": str(tmp_path / "c")})
    path = Path(where)
    assert path.parent == tmp_path / "c"
    assert path.name.startswith("kernels-") and cache_dir.sources_digest() in path.name
    assert stat.S_IMODE((tmp_path / "c").stat().st_mode) == 0o700


def test_cache_dir_others_can_write_is_not_loaded(tmp_path: Path) -> None:
    """numba's cache files are pickles it runs: a folder another user can write is refused, with
    one warning naming the fix, and this process compiles into a private folder instead."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    where, err = _cache_dir_in_child({"NETDAM_CACHE_DIR": str(shared)})
    assert Path(where).parent != shared and "netdam-kernels-" in where
    assert "others may write to it" in err and "NETDAM_CACHE_DIR" in err
    assert not any(shared.iterdir())


def test_only_the_most_recently_used_caches_are_kept(tmp_path: Path) -> None:
    root = tmp_path / "c"
    root.mkdir(mode=0o700)
    others = [root / f"kernels-0.0.{i}-{i:016d}-numba0.0" for i in range(cache_dir.KEEP + 1)]
    for age, other in enumerate(others):  # others[0] used most recently
        other.mkdir(mode=0o700)
        os.utime(other, (time.time() - 100 * (age + 1),) * 2)
    ours, _ = _cache_dir_in_child({"NETDAM_CACHE_DIR": str(root)})
    kept = sorted(p.name for p in root.iterdir())
    assert kept == sorted([Path(ours).name, *(o.name for o in others[: cache_dir.KEEP - 1])])


def test_another_install_of_the_same_sources_loads_the_cached_kernels(tmp_path: Path) -> None:
    """A second venv or a fresh clone of the same sources: its files are newer and elsewhere, and
    it loads what this one compiled instead of compiling again (numba keys by file time)."""
    copy = tmp_path / "elsewhere"
    package = Path(cache_dir.__file__).resolve().parents[1]
    shutil.copytree(package, copy / "netdam", copy_function=shutil.copy)  # new mtimes
    code = (
        "import netdam; from netdam.kernels import cache_dir, f16\n"
        f"assert netdam.__file__.startswith({str(copy)!r}), netdam.__file__\n"
        "print(cache_dir.kernel_cache_dir())\n"
        "print(sum(f16.f16_bits_to_f32.stats.cache_hits.values()),"
        " sum(f16.f16_bits_to_f32.stats.cache_misses.values()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PYTHONPATH": str(copy)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.split("\n")
    assert out[0] == str(cache_dir.kernel_cache_dir())
    assert out[1] == "1 0", out


@pytest.mark.slow
def test_a_node_answers_the_first_register_sent_the_moment_its_cluster_file_exists(
    tmp_path: Path,
) -> None:
    """SPEC.md 8.1, "When a node answers": before, a first REGISTER right after start got no
    reply within a 1 s retry budget. The file is written once every node is ready: one try of
    50 ms is enough, at the data port and at the management port."""
    from netdam.cluster.control import ControlClient
    from netdam.protocol.constants import REGISTER_ANYWHERE, Opcode, Rights
    from netdam.protocol.packet import Packet
    from netdam.protocol.payloads import pack_key_rights

    with launch.start_cluster(1, memory=1 << 20, cluster_path=tmp_path / "c.toml") as cluster:
        node = cluster.info.nodes[0]
        with ControlClient.for_cluster(cluster.info) as client:
            for endpoint in (node.endpoint, node.control_endpoint):
                register = Packet(
                    Opcode.REGISTER,
                    rkey=cluster.info.admin_key,
                    addr=REGISTER_ANYWHERE,
                    aux_addr=4096,
                    length=8,
                    payload=pack_key_rights(0, int(Rights.READ)),
                )
                reply = client.request(endpoint, register, timeout=0.05, retries=0)
                assert reply.opcode == Opcode.ACK and reply.addr == 0
                client.deregister(endpoint, reply.rkey)


def test_kernels_compile_aside_only_on_a_cold_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On a cold cache the engine's clock and the switch's own kernels compile in a second
    process (on the other core) while the launcher compiles the node's datapath; the switch's
    warm-up waits for it. What the cache holds is left out; a second call starts nothing."""
    started: list[list[str]] = []

    class FakeCompile:
        def __init__(self, argv: list[str], **_: object) -> None:
            started.append(argv)
            self.waited = False

        def poll(self) -> int | None:
            return 0 if self.waited else None

        def wait(self) -> int:
            self.waited = True
            return 0

    monkeypatch.setattr(launch.subprocess, "Popen", FakeCompile)
    monkeypatch.setattr(cache_dir, "kernel_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(launch, "_WARMED", set())
    monkeypatch.setattr(launch, "_ASIDE", [])
    launch.compile_kernels_aside()
    launch.compile_kernels_aside()  # already compiling: not a second process
    assert len(started) == 1 and started[0][0] == sys.executable
    code = started[0][-1]
    assert launch.ASIDE_CLOCK in code
    assert all(module in code for module in launch.SWITCH_ONLY_KERNELS)
    # The node's datapath chain is not imported aside: it would compile twice on 2 cores.
    assert "netdam.kernels.serve" not in code and "netdam.kernels.datapath" not in code
    aside = launch._ASIDE[0]
    launch._join_aside()
    assert aside.waited and launch._ASIDE == []

    (tmp_path / "node-kernels.built").touch()  # the node's cached: the switch's only
    launch._ASIDE.append(aside)  # ended, never joined: reaped, and the cache looked at again
    launch.compile_kernels_aside()
    assert len(started) == 2 and launch.ASIDE_CLOCK not in started[1][-1]
    assert launch._ASIDE[0] is not aside
    launch._join_aside()
    launch.compile_kernels_aside(switch=False)  # a cluster without a switch: nothing left
    (tmp_path / "switch_path._serve-1.py311.nbi").touch()  # cached now
    launch.compile_kernels_aside()
    assert len(started) == 2


def test_the_compile_aside_compiles_nothing_of_the_datapath_chain() -> None:
    """What the second process imports compiles nothing of the node's datapath chain (else both
    cores compile the same kernels and nothing is won): the engine's clock and the switch's own
    kernels, not the datapath or the serve loop."""
    code = (
        "import json, sys; "
        + launch.ASIDE_CLOCK
        + "; import "
        + ", ".join(launch.SWITCH_ONLY_KERNELS)
        + "; print(json.dumps(sorted(m for m in sys.modules if m.startswith('netdam.kernels.'))))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    loaded = set(json.loads(out.stdout.strip().splitlines()[-1]))
    assert "netdam.kernels.collective" in loaded
    assert not loaded & {"netdam.kernels.datapath", "netdam.kernels.serve"}, loaded
