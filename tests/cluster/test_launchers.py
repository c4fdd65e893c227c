"""Launchers and multi-host clusters: launcher environments (torchrun, OpenMPI, Slurm), the
rendezvous (core and TCP shell), `netdam node` under launcher variables, the mpirun example,
and `netdam up --cluster FILE` starting only this host's part of a hand-written file."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import netdam
from netdam.api import ProcessGroup
from netdam.api import all_reduce as api_all_reduce
from netdam.cli.main import build_parser, main
from netdam.cluster.clusterfile import load_cluster, parse_cluster
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import is_local_address
from netdam.cluster.launcher_env import (
    LaunchError,
    node_bind,
    resolve_launch,
    slurm_first_host,
    wants_rendezvous,
)
from netdam.cluster.rendezvous import (
    Answer,
    Gathering,
    LineReader,
    Member,
    RendezvousConflict,
    RendezvousError,
    answer_message,
    decode_message,
    error_message,
    gather,
    join,
    member_message,
    parse_answer,
    parse_member,
)
from netdam.protocol.constants import ReduceOp
from netdam.tools.allreduce import reference_chain_allreduce

ROOT = Path(__file__).resolve().parents[2]
#: Variables of every launcher: stripped from the environment of the processes tests start.
LAUNCHER_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_JOB_ID",
    "NETDAM_MASTER_ADDR",
    "NETDAM_MASTER_PORT",
)


def alive(pid: int) -> bool:
    """Running (a zombie child of ours does not count)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    with socket.socket(socket.AF_INET, kind) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, **extra}


# ------------------------------------------------------------------ launcher environments


def test_torchrun_environment() -> None:
    env = {
        "RANK": "2",
        "WORLD_SIZE": "3",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }
    spec = resolve_launch(env, rank=None, world_size=None, master=None)
    assert (spec.rank, spec.world_size, spec.local_rank, spec.master) == (
        2,
        3,
        1,
        ("10.0.0.1", 29500),
    )
    assert spec.source.startswith("torchrun")
    # Under torchrun its own store holds MASTER_PORT: ours is the next one.
    agent = resolve_launch(
        {**env, "TORCHELASTIC_USE_AGENT_STORE": "True"}, rank=None, world_size=None, master=None
    )
    assert agent.master == ("10.0.0.1", 29501)


def test_openmpi_environment_needs_a_master() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    }
    with pytest.raises(LaunchError, match="--master HOST:PORT.*NETDAM_MASTER_ADDR"):
        resolve_launch(env, rank=None, world_size=None, master=None)
    spec = resolve_launch(
        {**env, "NETDAM_MASTER_ADDR": "h0", "NETDAM_MASTER_PORT": "4000"},
        rank=None,
        world_size=None,
        master=None,
    )
    assert (spec.rank, spec.world_size, spec.local_rank, spec.master) == (1, 4, 1, ("h0", 4000))
    flag = resolve_launch(env, rank=None, world_size=None, master="h1:5000")
    assert flag.master == ("h1", 5000) and flag.source.startswith("OpenMPI")
    host_only = resolve_launch(env, rank=None, world_size=None, master="h1")
    assert host_only.master == ("h1", 29544)


def test_slurm_environment() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_ID": "123456",
        "SLURM_JOB_NODELIST": "node[07-09,11],gpu1",
    }
    spec = resolve_launch(env, rank=None, world_size=None, master=None)
    assert (spec.rank, spec.world_size, spec.local_rank) == (3, 4, 1)
    assert spec.master == ("node07", 20000 + 3456)
    assert resolve_launch(
        {**env, "NETDAM_MASTER_PORT": "7000"}, rank=None, world_size=None, master=None
    ).master == ("node07", 7000)


@pytest.mark.parametrize(
    ("nodelist", "first"),
    [("a,b,c", "a"), ("node01", "node01"), ("n[3-4]", "n3"), ("x-[010,012]", "x-010")],
)
def test_slurm_simple_nodelists(nodelist: str, first: str) -> None:
    assert slurm_first_host({"SLURM_JOB_NODELIST": nodelist}) == first


def test_slurm_complex_nodelist_names_the_fix() -> None:
    with pytest.raises(LaunchError, match="NETDAM_MASTER_ADDR=.*scontrol show hostnames"):
        slurm_first_host({"SLURM_JOB_NODELIST": "rack[1-2]-node[01-04]"})


def test_flags_override_the_environment() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "3", "MASTER_ADDR": "h", "MASTER_PORT": "9"}
    both = resolve_launch(env, rank=0, world_size=2, master=None)
    assert (both.rank, both.world_size, both.source) == (0, 2, "--rank/--world-size")
    one = resolve_launch(env, rank=2, world_size=None, master=None)
    assert (one.rank, one.world_size) == (2, 3) and "--rank" in one.source
    # Flags for both: a broken environment does not matter.
    assert resolve_launch({"RANK": "x"}, rank=0, world_size=1, master=None).master is None


def test_conflicting_launchers_are_an_error() -> None:
    env = {
        "RANK": "1",
        "WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "3",
        "MASTER_ADDR": "h",
    }
    with pytest.raises(
        LaunchError,
        match=r"RANK=1, WORLD_SIZE=3 \(torchrun\) disagrees with OMPI_COMM_WORLD_RANK=2",
    ):
        resolve_launch(env, rank=None, world_size=None, master=None)
    agree = {**env, "OMPI_COMM_WORLD_RANK": "1"}
    assert resolve_launch(agree, rank=None, world_size=None, master=None).rank == 1


def test_slurm_around_mpirun_is_not_a_conflict() -> None:
    """mpirun inside an allocation: Slurm's variables describe the batch step, mpirun's decide."""
    env = {
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "4",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "NETDAM_MASTER_ADDR": "h",
    }
    spec = resolve_launch(env, rank=None, world_size=None, master=None)
    assert (spec.rank, spec.world_size) == (2, 4) and spec.source.startswith("OpenMPI")


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "1"}, "RANK is set but WORLD_SIZE is not"),
        ({"SLURM_NTASKS": "2"}, "SLURM_NTASKS is set but SLURM_PROCID is not"),
        ({"RANK": "one", "WORLD_SIZE": "2"}, "RANK='one' is not a non-negative integer"),
        ({"RANK": "3", "WORLD_SIZE": "3", "MASTER_ADDR": "h"}, "rank 3 with world size 3"),
        ({}, "no rank and world size"),
    ],
)
def test_bad_environments_name_the_fix(env: dict[str, str], message: str) -> None:
    with pytest.raises(LaunchError, match=message):
        resolve_launch(env, rank=None, world_size=None, master=None)


def test_world_of_one_needs_no_master() -> None:
    assert (
        resolve_launch(
            {"RANK": "0", "WORLD_SIZE": "1"}, rank=None, world_size=None, master=None
        ).master
        is None
    )


def test_when_a_node_joins_a_rendezvous() -> None:
    assert wants_rendezvous({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, None, False)
    assert wants_rendezvous({}, "h:1", False) and wants_rendezvous(
        {"NETDAM_MASTER_ADDR": "h"}, None, False
    )
    # --members given (netdam up's nodes): as before, whatever the environment says.
    assert not wants_rendezvous({"RANK": "0", "WORLD_SIZE": "2"}, "h:1", True)
    # MASTER_ADDR alone is often left over in a torch shell.
    assert not wants_rendezvous({"MASTER_ADDR": "h", "MASTER_PORT": "1"}, None, False)


def test_node_bind_ports() -> None:
    assert node_bind(None, 2) == ("auto", 7746)
    assert node_bind(("auto", 0), 5) == ("auto", 0)
    assert node_bind(("10.0.0.1", 9000), 1) == ("10.0.0.1", 9001)
    with pytest.raises(LaunchError, match="lower --bind port"):
        node_bind(("10.0.0.1", 65535), 1)


def test_node_help_documents_precedence_and_variables() -> None:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    text = sub.choices["node"].format_help()
    for name in (
        "RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_JOB_NODELIST",
        "NETDAM_MASTER_ADDR",
        "NETDAM_MASTER_PORT",
        "--rank / --world-size (each overrides",
    ):
        assert name in text, name


def test_node_with_conflicting_variables_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "3",
        "OMPI_COMM_WORLD_RANK": "2",
        "OMPI_COMM_WORLD_SIZE": "3",
    }.items():
        monkeypatch.setenv(key, value)
    assert main(["node", "--bind", "127.0.0.1:0"]) == 2
    assert "disagrees with OMPI_COMM_WORLD_RANK=2" in capsys.readouterr().err


# ------------------------------------------------------------------------ rendezvous core


def member(
    rank: int, world: int = 3, port: int | None = None, pid: int = 0, mtu: int = 9000
) -> Member:
    return Member(
        rank=rank,
        world_size=world,
        address="127.0.0.1",
        port=port or 7000 + rank,
        control_port=8000 + rank,
        pid=pid or 100 + rank,
        memory_file=f"/dev/shm/m{rank}.mem",
        memory_bytes=1 << 20,
        mtu=mtu,
        host="h",
    )


def test_gathering_completes_in_rank_order() -> None:
    core = Gathering(3, deadline=10.0)
    for rank in (2, 0, 1):
        assert not core.complete
        core.add(member(rank))
    assert core.complete and core.missing() == []
    answer = core.answer("c", 77)
    assert [m.rank for m in answer.members] == [0, 1, 2] and answer.admin_key == 77
    info = answer.cluster_file()
    assert info.endpoints == [("127.0.0.1", 7000), ("127.0.0.1", 7001), ("127.0.0.1", 7002)]
    assert info.nodes[2].memory_file == "/dev/shm/m2.mem" and info.nodes[1].control_port == 8001


def test_gathering_timeout_names_the_missing_ranks() -> None:
    core = Gathering(4, deadline=5.0, master="port 29544", timeout_s=5.0)
    core.add(member(0, 4))
    core.add(member(2, 4))
    core.check(4.9)  # not yet
    with pytest.raises(RendezvousError, match=r"2 of 4 ranks never reported \(ranks 1, 3\)"):
        core.check(5.0)


def test_gathering_rejects_a_duplicate_rank_and_names_both() -> None:
    core = Gathering(3, deadline=10.0)
    core.add(member(1, pid=41))
    core.add(member(1, pid=41))  # the same report again: harmless
    with pytest.raises(
        RendezvousConflict,
        match=r"rank 1 reported twice: by 127.0.0.1:7001 \(pid 41 on h\) and by 127.0.0.1:7009 \(pid 42 on h\)",
    ):
        core.add(member(1, port=7009, pid=42))


def test_loopback_addresses_across_hosts_are_refused() -> None:
    core = Gathering(3, deadline=10.0)
    core.add(member(0))  # 127.0.0.1 on host h
    with pytest.raises(
        RendezvousConflict,
        match="rank 0 reports loopback address 127.0.0.1 but ranks run on several hosts",
    ):
        core.add(Member(1, 3, "10.0.0.2", 7001, host="h2"))
    core.add(member(1))  # the same host: loopback is fine


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (member(1, port=7000), "ranks 0 and 1 both report 127.0.0.1:7000"),
        (member(1, world=4), "has world size 4, rank 0 has 3"),
        (member(1, mtu=1500), "has --mtu 1500, rank 0 has 9000"),
        (member(5, world=3), "outside 0..2"),
    ],
)
def test_gathering_conflicts(bad: Member, message: str) -> None:
    core = Gathering(3, deadline=10.0)
    core.add(member(0))
    with pytest.raises(RendezvousConflict, match=message):
        core.add(bad)


def test_withdrawn_rank_may_report_again() -> None:
    core = Gathering(2, deadline=10.0)
    core.add(member(0, 2))
    core.add(member(1, 2, pid=5))
    core.withdraw(1)
    assert core.missing() == [1]
    core.add(member(1, 2, pid=6))  # a restarted process: no conflict
    assert core.complete


def test_messages_round_trip_and_foreign_lines_are_refused() -> None:
    reader = LineReader()
    data = member_message(member(1))
    assert reader.feed(data[:10]) == []
    (line,) = reader.feed(data[10:])
    assert parse_member(decode_message(line)) == member(1)
    answer = Answer("c", 5, 9000, (member(0, 2), member(1, 2)))
    assert parse_answer(answer_message(answer).rstrip()) == answer
    with pytest.raises(RendezvousConflict, match="rank 0 ended the rendezvous: boom"):
        parse_answer(error_message("boom", 2))
    with pytest.raises(RendezvousError, match="not a netdam-rendezvous/1 message"):
        decode_message(b'{"hello": 1}')
    with pytest.raises(RendezvousError, match="'port' missing or not int"):
        parse_member({"member": {**member(1).__dict__, "port": "7000"}})


# ------------------------------------------------------------------- rendezvous over TCP


def _join_in_thread(
    port: int, who: Member, timeout: float, results: dict[int, object]
) -> threading.Thread:
    def run() -> None:
        try:
            results[who.rank] = join(("127.0.0.1", port), who, timeout)
        except RendezvousError as exc:
            results[who.rank] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_tcp_rendezvous_answers_everyone() -> None:
    port = free_port()
    results: dict[int, object] = {}
    threads = [
        _join_in_thread(port, member(r), 10.0, results) for r in (2, 1)
    ]  # before rank 0 listens
    time.sleep(0.2)
    answer = gather(port, member(0), 10.0, name="c", admin_key=99)
    for thread in threads:
        thread.join(5)
    assert results[1] == answer and results[2] == answer
    assert answer.endpoints == (("127.0.0.1", 7000), ("127.0.0.1", 7001), ("127.0.0.1", 7002))


def test_tcp_rendezvous_of_processes_hosting_several_nics() -> None:
    """A process hosting NICs 2 and 3 reports both on one connection; rank 0's process brings
    0 and 1; everyone gets all four. A process that goes before the answer takes its NICs with
    it: they are missing again, named."""
    port = free_port()
    results: dict[int, object] = {}

    def join_both() -> None:
        try:
            results[2] = join(("127.0.0.1", port), [member(2, 4), member(3, 4)], 10.0)
        except RendezvousError as exc:
            results[2] = exc

    thread = threading.Thread(target=join_both, daemon=True)
    thread.start()
    answer = gather(port, [member(0, 4), member(1, 4)], 10.0, name="c", admin_key=9)
    thread.join(5)
    assert results[2] == answer and [m.rank for m in answer.members] == [0, 1, 2, 3]
    # Withdrawn together: the connection that reported 2 and 3 closes before 4 and 5 report.
    port = free_port()
    reporter = threading.Thread(
        target=lambda: _report_and_hang_up(port, [member(2, 6), member(3, 6)]), daemon=True
    )
    reporter.start()
    with pytest.raises(RendezvousError, match=r"4 of 6 ranks never reported \(ranks 2, 3, 4, 5\)"):
        gather(port, [member(0, 6), member(1, 6)], 1.0, name="c", admin_key=9)
    reporter.join(5)


def _report_and_hang_up(port: int, members: list[Member]) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
                sock.sendall(b"".join(member_message(m) for m in members))
                time.sleep(0.2)
            return
        except OSError:
            time.sleep(0.05)


def test_tcp_rendezvous_timeout_tells_rank_0_and_the_others() -> None:
    port = free_port()
    results: dict[int, object] = {}
    thread = _join_in_thread(port, member(1), 10.0, results)
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"1 of 3 ranks never reported \(ranks 2\)"):
        gather(port, member(0), 0.5, name="c", admin_key=1)
    assert time.monotonic() - start < 3
    thread.join(5)
    assert isinstance(results[1], RendezvousError) and "ranks 2" in str(results[1])


def test_tcp_rendezvous_duplicate_rank_fails_everyone() -> None:
    port = free_port()
    results: dict[int, object] = {}
    first = _join_in_thread(port, member(1, pid=1), 10.0, results)
    time.sleep(0.1)
    server: dict[str, object] = {}

    def serve() -> None:
        try:
            server["answer"] = gather(port, member(0), 10.0, name="c", admin_key=1)
        except RendezvousError as exc:
            server["error"] = exc

    rank0 = threading.Thread(target=serve, daemon=True)
    rank0.start()
    first.join(0.5)  # rank 1 reported; rank 0 waits for rank 2
    other: dict[int, object] = {}
    second = _join_in_thread(port, member(1, port=7010, pid=2), 10.0, other)
    rank0.join(5)
    second.join(5)
    first.join(5)
    assert isinstance(server.get("error"), RendezvousConflict), server
    assert "rank 1 reported twice" in str(server["error"])
    assert isinstance(other[1], RendezvousConflict) and isinstance(results[1], RendezvousConflict)


def test_join_names_an_unreachable_master() -> None:
    with pytest.raises(
        RendezvousError, match=r"could not reach rank 0's rendezvous at 127.0.0.1:\d+"
    ):
        join(("127.0.0.1", free_port()), member(1), 0.3)


# ------------------------------------------------------------------ real node processes


def _start_nodes(envs: list[dict[str, str]], args: list[str]) -> list[subprocess.Popen[str]]:
    return [
        subprocess.Popen(
            [sys.executable, "-m", "netdam", "node", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for env in envs
    ]


def _wait_file(path: Path, procs: list[subprocess.Popen[str]], timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise AssertionError(f"a node exited: {dead[0].returncode} {dead[0].communicate()[1]}")
        assert time.monotonic() < deadline, "no cluster file"
        time.sleep(0.05)


def _stop(procs: list[subprocess.Popen[str]]) -> list[int]:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    return [proc.wait(timeout=20) for proc in procs]


@pytest.mark.slow
def test_torchrun_style_nodes_form_a_cluster_and_all_reduce(tmp_path: Path) -> None:
    """Three `netdam node` with torchrun's variables (rank 0 last, so the others wait for it);
    rank 0 writes the cluster file; a host all-reduces through it, checked against numpy."""
    path = tmp_path / "cluster.toml"
    port = free_port()
    envs = [
        clean_env(
            RANK=str(r),
            WORLD_SIZE="3",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        for r in (2, 1, 0)
    ]
    procs = _start_nodes(envs, ["--bind", "auto:0", "--memory", "4MiB", "--cluster", str(path)])
    try:
        _wait_file(path, procs)
        info = load_cluster(path)
        assert [n.rank for n in info.nodes] == [0, 1, 2]
        assert {n.pid for n in info.nodes} == {p.pid for p in procs}
        assert all(Path(n.memory_file).exists() and n.control_port for n in info.nodes)
        with ControlClient.for_cluster(info) as client:
            for node in info.nodes:
                client.counters(node.control_endpoint)  # one admin key on every node: rank 0's
            pings = [client.ping(n.endpoint)[0] for n in info.nodes]
        assert [(p["rank"], p["world_size"]) for p in pings] == [(0, 3), (1, 3), (2, 3)]
        rng = np.random.default_rng(7)
        inputs = [rng.standard_normal(3000).astype(np.float32) for _ in range(3)]
        buffers = [x.copy() for x in inputs]
        # Rank 0 the way a host process joins (netdam.init); ranks 1 and 2 from this process too.
        groups = [netdam.init(path, rank=0), ProcessGroup(info, 1), ProcessGroup(info, 2)]
        try:
            works = [api_all_reduce(buffers[0], async_op=True)]
            works += [
                api_all_reduce(b, group=g, async_op=True)
                for b, g in zip(buffers[1:], groups[1:], strict=True)
            ]
            for work in works:
                work.wait()
        finally:
            netdam.destroy_process_group()
            for group in groups[1:]:
                group.close()
        expected = reference_chain_allreduce(inputs, ReduceOp.SUM)
        assert all(b.tobytes() == expected.tobytes() for b in buffers)
        np.testing.assert_allclose(
            buffers[0], inputs[0] + inputs[1] + inputs[2], rtol=1e-5, atol=1e-5
        )
    finally:
        codes = _stop(procs)
    assert codes == [0, 0, 0]
    assert not any(Path(n.memory_file).exists() for n in info.nodes)


@pytest.mark.slow
def test_launched_processes_host_several_nics_each(tmp_path: Path) -> None:
    """Two `netdam node --nics-per-process 2` with torchrun's variables: a cluster of 4 NICs,
    two per process (ranks 0-1 in launcher rank 0's, 2-3 in rank 1's), all-reducing exactly."""
    path = tmp_path / "cluster.toml"
    port = free_port()
    envs = [
        clean_env(
            RANK=str(r),
            WORLD_SIZE="2",
            LOCAL_RANK=str(r),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        for r in (1, 0)
    ]
    args = ["--bind", "auto:0", "--memory", "4MiB", "--cluster", str(path)]
    procs = _start_nodes(envs, [*args, "--nics-per-process", "2"])
    try:
        _wait_file(path, procs)
        info = load_cluster(path)
        assert [n.rank for n in info.nodes] == [0, 1, 2, 3]
        by_pid = {p.pid: r for p, r in zip(procs, (1, 0), strict=True)}
        assert [by_pid[n.pid] for n in info.nodes] == [0, 0, 1, 1]
        with ControlClient.for_cluster(info) as client:
            pings = [client.ping(n.endpoint)[0] for n in info.nodes]
        assert [(p["rank"], p["world_size"]) for p in pings] == [(r, 4) for r in range(4)]
        rng = np.random.default_rng(11)
        inputs = [rng.standard_normal(5000).astype(np.float32) for _ in range(4)]
        buffers = [x.copy() for x in inputs]
        groups = [ProcessGroup(info, r) for r in range(4)]
        try:
            works = [
                api_all_reduce(b, group=g, async_op=True)
                for b, g in zip(buffers, groups, strict=True)
            ]
            for work in works:
                assert work is not None
                work.wait()
        finally:
            for group in groups:
                group.close()
        expected = reference_chain_allreduce(inputs, ReduceOp.SUM)
        assert all(b.tobytes() == expected.tobytes() for b in buffers)
    finally:
        codes = _stop(procs)
    assert codes == [0, 0]
    assert not any(Path(n.memory_file).exists() for n in info.nodes)
    # The hosts' arena lock files went with the memory (a stopped node leaves nothing in shm).
    assert not any(Path(f"{n.memory_file}.arena.lock").exists() for n in info.nodes)


@pytest.mark.slow
def test_a_missing_rank_fails_the_node_with_exit_3(tmp_path: Path) -> None:
    """Rank 0 of 2 alone (mpirun-style variables, --master): it names rank 1, exits 3, and leaves
    no memory file behind."""
    env = clean_env(OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2")
    (proc,) = _start_nodes(
        [env],
        [
            "--bind",
            "auto:0",
            "--memory",
            "64KiB",
            "--master",
            f"127.0.0.1:{free_port()}",
            "--rendezvous-timeout",
            "1",
            "--shm-dir",
            str(tmp_path),
        ],
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert "1 of 2 ranks never reported (ranks 1): are they running" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("script", ["launch_torchrun.sh", "launch_mpirun.sh", "launch_slurm.sh"])
def test_launcher_examples_parse(script: str) -> None:
    text = (ROOT / "examples" / script).read_text()
    assert text.startswith("#!/usr/bin/env bash\n") and "allreduce_once_formed" in text
    common = (ROOT / "examples" / "launch_common.sh").read_text()  # sourced by every script
    assert "netdam allreduce --cluster" in common.replace("$NETDAM", "netdam")
    result = subprocess.run(
        ["bash", "-n", str(ROOT / "examples" / script)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("mpirun") is None,
    reason="mpirun (OpenMPI) is not installed: apt-get install openmpi-bin",
)
def test_mpirun_example(tmp_path: Path) -> None:
    env = clean_env(
        NETDAM=f"{sys.executable} -m netdam",
        RDV_PORT=str(free_port()),
        NODES="3",
        TMPDIR=str(tmp_path),
    )
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "launch_mpirun.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "allreduce chain OK: 3 nodes" in result.stdout
    assert (
        result.stderr.count("from OpenMPI mpirun (OMPI_COMM_WORLD_RANK, OMPI_COMM_WORLD_SIZE)") == 3
    )
    assert "stopped 3 nodes" in result.stdout


# ------------------------------------------------------------- netdam up --cluster FILE

REMOTE = "10.255.255.1"


def hand_written(path: Path, ports: tuple[int, int]) -> None:
    path.write_text(f"""# two nodes here, one on another host
[cluster]
name = "hand-{os.getpid()}"
admin_key = 0x1234567

[[nodes]]
rank = 0
address = "127.0.0.1"
port = {ports[0]}

[[nodes]]
rank = 1
address = "{REMOTE}"
port = 7744
memory_bytes = 1048576

[[nodes]]
rank = 2
address = "127.0.0.1"
port = {ports[1]}
""")


@pytest.mark.slow
@pytest.mark.skipif(is_local_address(REMOTE), reason=f"{REMOTE} is an address of this host")
def test_up_starts_exactly_the_local_nodes_of_a_hand_written_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert is_local_address("127.0.0.1")
    path = tmp_path / "c.toml"
    ports = (free_port(socket.SOCK_DGRAM), free_port(socket.SOCK_DGRAM))
    hand_written(path, ports)
    assert main(["up", "--cluster", str(path), "--memory", "256KiB", "--detach", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    info = load_cluster(path)
    try:
        assert (summary["nodes"], summary["ranks"], summary["world_size"]) == (2, [0, 2], 3)
        local = [info.nodes[0], info.nodes[2]]
        assert [n.port for n in local] == list(ports) and all(
            n.pid and n.control_port for n in local
        )
        assert all(Path(n.memory_file).stat().st_size == 256 << 10 for n in local)
        assert (
            info.nodes[1].pid == 0
            and info.nodes[1].memory_file == ""
            and info.nodes[1].memory_bytes == 1 << 20
        )
        assert info.keep_file and info.admin_key == 0x1234567
        with ControlClient.for_cluster(info) as client:
            pings = [client.ping(n.endpoint)[0] for n in local]
            client.counters(local[1].control_endpoint)  # the file's admin key works
        assert [(p["rank"], p["world_size"]) for p in pings] == [(0, 3), (2, 3)]
        # Again: the local nodes run already.
        assert main(["up", "--cluster", str(path), "--detach", "--json"]) == 2
        assert "already runs as pid" in json.loads(capsys.readouterr().out)["error"]
    finally:
        assert main(["down", "--cluster", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == [0, 2]
    after = load_cluster(path)  # kept, the running state cleared, the remote entry as written
    assert [(n.pid, n.memory_file, n.control_port) for n in after.nodes] == [(0, "", 0)] * 3
    assert after.nodes[1] == info.nodes[1]
    assert not any(Path(n.memory_file).exists() for n in local)
    assert not any(alive(n.pid) for n in local)


def test_up_with_a_file_refuses_flags_that_describe_a_new_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.toml"
    hand_written(path, (1, 2))
    assert main(["up", "--cluster", str(path), "--nodes", "2", "--json"]) == 2
    assert "--nodes conflicts with" in json.loads(capsys.readouterr().out)["error"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '[cluster]\nadmin_key = 1\n[[nodes]]\nrank = 0\naddress = "127.0.0.1"\nport = "7744"\n',
            r"line 6 \(\[\[nodes\]\] #1\): `port = \"7744\"` must be an integer: write e.g. `port = 7744` \(no quotes\)",
        ),
        (
            '[cluster]\nadmin_key = 1\n[[nodes]]\nrank = 0\naddress = "127.0.0.1"\nprot = 7744\n',
            r"line 6 .*unknown field `prot`: did you mean `port`\?",
        ),
        (
            '[cluster]\nadmin_key = 1\n[[nodes]]\nrank = 0\naddress = "node01"\nport = 1\n',
            r"line 5 .*is not an IPv4 address: write the node's IP",
        ),
        (
            '[cluster]\n[[nodes]]\nrank = 0\naddress = "127.0.0.1"\nport = 1\n',
            r"line 1 \(\[cluster\]\): missing field `admin_key`: add `admin_key = ",
        ),
        (
            '[cluster]\nadmin_key = 1\n[[nodes]]\nrank = 0\naddress = "127.0.0.1"\nport = 1\n[[nodes]]\nrank = 0\naddress = "127.0.0.1"\nport = 2\n',
            r"line 8 .*rank 0 is also \[\[nodes\]\] #1's \(line 4\)",
        ),
        (
            '[cluster]\nadmin_key = 1\n[[nodes]]\nrank = 1\naddress = "127.0.0.1"\nport = 1\n',
            r"ranks must be 0..0, each once; got 1 .*renumber",
        ),
        (
            "[cluster]\nadmin_key = 1\n[[nodes]]\nrank = 0\naddress = 127.0.0.1\n",
            r"not valid TOML: .*line 5.*strings in double quotes",
        ),
    ],
)
def test_malformed_cluster_files_name_line_field_and_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cluster(text, Path("c.toml"))


def test_up_with_a_malformed_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[cluster]\nadmin_key = 1\n[[nodes]]\nrank = 0\nadress = "127.0.0.1"\nport = 1\n'
    )
    assert main(["up", "--cluster", str(path), "--json"]) == 2
    assert (
        "line 5 ([[nodes]] #1): unknown field `adress`: did you mean `address`?"
        in json.loads(capsys.readouterr().out)["error"]
    )
