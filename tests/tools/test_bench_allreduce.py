"""`netdam bench allreduce`: a tiny real run (chain and ring-host on node processes) has every
key; missing peers are reported in `skipped` with the command that installs them; --plot writes
a PNG; usage errors exit 2. Targets are reported by the benchmark, never asserted here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import run_bench_cli as run_cli

from netdam.tools.bench import allreduce as B

ROW_KEYS = {
    "algo",
    "nodes",
    "bytes",
    "dtype",
    "repeat",
    "seconds_median",
    "seconds_p50",
    "seconds_p99",
    "seconds_min",
    "seconds_max",
    "algbw_gbps",
    "busbw_gbps",
    "ratio_vs_chain",
    "model_seconds_100g",
}
MACHINE_KEYS = {"cores", "kernel", "python", "numpy", "numba", "torch", "mpi4py", "mpi"}


def fake_runner(
    algo: str, nodes: int, count: int, warmup: int, repeat: int, timeout_s: float
) -> B._Outcome:
    """Seconds proportional to size, chain fastest: exercises rows, ratios and the plot quickly."""
    scale = {
        "chain": 1.0,
        "chain-emu": 0.9,
        "chain-resident": 0.8,
        "chain-resident-emu": 0.7,
        "ring-host": 3.0,
        "gloo": 0.5,
        "mpi": 2.0,
        "mpi-shm": 0.1,
    }[algo]
    base = scale * (1e-4 + count * 4 / 1e9) * nodes
    return B._Outcome(times=[base * (1 + 0.01 * i) for i in range(repeat)], ok=True)


@pytest.mark.slow
def test_tiny_real_run_has_every_key(capsys: pytest.CaptureFixture[str]) -> None:
    code, res = run_cli(
        [
            "bench",
            "allreduce",
            "--nodes",
            "2",
            "--size",
            "64KiB",
            "--repeat",
            "1",
            "--vs",
            "ring-host,chain-resident",
            "--json",
        ],
        capsys,
    )
    assert code == 0, res.get("error")
    assert res["ok"] is True
    assert {"results", "skipped", "machine"} <= res.keys()
    assert MACHINE_KEYS <= res["machine"].keys()
    assert res["skipped"] == []
    algos = {r["algo"]: r for r in res["results"]}
    # 32 KiB blocks span four wire payloads: the chain runs again at the emulation MTU.
    assert set(algos) == {"chain", "chain-emu", "chain-resident", "chain-resident-emu", "ring-host"}
    assert (res["mtu"], res["emulation_mtu"], res["model_mtu"]) == (9000, 65000, 9000)
    for algo in ("chain", "chain-resident"):
        wire, emulated = algos[algo], algos[f"{algo}-emu"]
        assert (wire["mtu"], emulated["mtu"]) == (9000, 65000)
        assert emulated["packets"] < wire["packets"], algo  # 1 datagram a block, not 4
        assert emulated["model_seconds_100g"] == wire["model_seconds_100g"]  # the wire's model
    # Host-side phases of the netdam rows: the staged chain copies in and out, resident does not.
    assert set(algos["chain"]["phases"]) == {
        "stage_in",
        "start_skew",
        "reduce_scatter",
        "all_gather",
        "done",
        "completion",
        "copy_out",
    }
    assert algos["chain-resident"]["phases"]["copy_out"] < algos["chain"]["phases"]["copy_out"]
    # The host API's own time per call and rank (issue, return), copies excluded.
    for algo in ("chain", "chain-resident"):
        overhead = algos[algo]["host_overhead_us"]
        assert set(overhead) == {"issue", "return"} and min(overhead.values()) >= 0.0
    for row in res["results"]:
        assert ROW_KEYS <= row.keys()
        assert (row["nodes"], row["bytes"], row["dtype"], row["repeat"]) == (2, 65536, "f32", 1)
        assert row["ok"] is True
        assert row["seconds_min"] <= row["seconds_median"] <= row["seconds_max"]
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"])  # 2(p-1)/p = 1 at p = 2
        assert row["model_seconds_100g"] > 0
        assert row["model_seconds_100g_roce_ring"] > 0 and row["model_seconds_100g_roce_ideal"] > 0
    assert algos["chain"]["ratio_vs_chain"] == 1.0
    ring = algos["ring-host"]
    assert ring["ratio_vs_chain"] == pytest.approx(
        ring["seconds_median"] / algos["chain"]["seconds_median"]
    )


def test_percentiles_and_default_call_counts() -> None:
    calls = [float(i) for i in range(1, 101)]  # 1..100
    assert B.percentile(calls, 50) == 50.0 and B.percentile(calls, 99) == 99.0
    assert B.percentile([3.0, 1.0, 2.0], 99) == 3.0  # under 100 calls p99 is the slowest
    assert B.percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert (
        B.auto_repeat(4),
        B.auto_repeat(64 << 10),
        B.auto_repeat(1 << 20),
        B.auto_repeat(64 << 20),
    ) == (100, 100, 20, 5)
    cfg = B.AllReduceBenchConfig(
        nodes=(2,), sizes=(4096, 8 << 20), peers=("chain-resident",), progress=False
    )
    res, code = B.run_allreduce_bench(cfg, runner=fake_runner)
    assert code == 0
    rows = {(r["algo"], r["bytes"]): r for r in res["results"]}
    assert rows[("chain", 4096)]["repeat"] == 100 and rows[("chain", 8 << 20)]["repeat"] == 5
    small = rows[("chain-resident", 4096)]  # fake times: base x (1 + 0.01 i), i = 0..99
    base = small["seconds_min"]
    assert small["seconds_p50"] == pytest.approx(base * 1.49)
    assert small["seconds_p99"] == pytest.approx(base * 1.98)
    assert small["seconds_p99"] < small["seconds_max"]
    big = rows[("chain", 8 << 20)]  # 5 calls: p99 is the slowest
    assert big["seconds_p99"] == big["seconds_max"]


def test_back_to_back_calls_end_with_their_last_rank() -> None:
    # Rank 1 starts late and finishes call 1 last; rank 0 finishes call 2 last.
    ends = [[10.0, 10.5, 11.4], [10.2, 10.6, 11.1]]
    assert B.call_times(ends) == pytest.approx([10.6 - 10.2, 11.4 - 10.6])
    assert sum(B.call_times(ends)) == pytest.approx(11.4 - 10.2)  # the loop's wall time


def test_missing_peers_are_skipped_with_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("netdam.tools.bench.allreduce.util.find_spec", lambda name: None)
    monkeypatch.setattr("netdam.tools.bench.allreduce.shutil.which", lambda name: None)
    cfg = B.AllReduceBenchConfig(
        nodes=(2,), sizes=(4096,), peers=("gloo", "mpi", "mpi-shm"), repeat=2, progress=False
    )
    res, code = B.run_allreduce_bench(cfg, runner=fake_runner)
    assert code == 0
    reasons = {s["algo"]: s["reason"] for s in res["skipped"]}
    assert set(reasons) == {"gloo", "mpi", "mpi-shm"}
    assert (
        "pip install torch==2.13.0" in reasons["gloo"] and "'netdam[bench]'" not in reasons["gloo"]
    )
    assert "apt-get install openmpi-bin libopenmpi-dev" in reasons["mpi"]
    assert [r["algo"] for r in res["results"]] == ["chain"]


def test_installed_peers_are_not_skipped() -> None:
    """Here the real checks decide: a peer is either measured or skipped, never both."""
    for peer, check in (("gloo", B.gloo_unavailable), ("mpi", B.mpi_unavailable)):
        reason = check()
        assert reason is None or "install" in reason, (peer, reason)


def test_rows_ratios_and_exit_codes_with_a_fake_runner() -> None:
    cfg = B.AllReduceBenchConfig(
        nodes=(2, 4), sizes=(1024, 4096), peers=("ring-host",), repeat=3, progress=False
    )
    res, code = B.run_allreduce_bench(cfg, runner=fake_runner)
    assert code == 0 and len(res["results"]) == 8
    for row in res["results"]:
        expected = 1.0 if row["algo"] == "chain" else 3.0
        assert row["ratio_vs_chain"] == pytest.approx(expected)
        p = row["nodes"]
        assert row["busbw_gbps"] == pytest.approx(row["algbw_gbps"] * 2 * (p - 1) / p)
    json.dumps(res, allow_nan=False)

    def wrong(*args: object) -> B._Outcome:
        return B._Outcome(times=[1.0], ok=False, error="result differs from the reference")

    def dead(*args: object) -> B._Outcome:
        return B._Outcome(error="node rank 1 exited")

    one = B.AllReduceBenchConfig(nodes=(2,), sizes=(1024,), peers=(), repeat=1, progress=False)
    res, code = B.run_allreduce_bench(one, runner=wrong)
    assert code == 1 and res["ok"] is False and "error" in res
    res, code = B.run_allreduce_bench(one, runner=dead)
    assert code == 3 and res["results"][0]["seconds_median"] is None
    assert res["results"][0]["error"] == "node rank 1 exited"


def test_the_netdam_rows_run_at_the_placement_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--nics-per-process K reaches the private cluster of every netdam row (chain and its
    -emu row here), and the result and its table say so; without it, the default placement."""
    from netdam.tools import allreduce as tool

    asked: list[tuple[str, int | None]] = []

    def fake_run(config: tool.AllReduceConfig) -> dict[str, object]:
        asked.append((config.algo, config.nics_per_process))
        return {"ok": True, "seconds_all": [1e-3] * config.repeat, "startup_seconds": 0.1}

    monkeypatch.setattr(tool, "run_allreduce", fake_run)
    argv = "bench allreduce --nodes 2 --size 64KiB --repeat 2 --vs none".split()
    code, res = run_cli([*argv, "--nics-per-process", "2", "--json"], capsys)
    assert code == 0, res.get("error")
    assert res["nics_per_process"] == 2
    assert asked == [("chain", 2), ("chain", 2)]  # chain, then chain-emu
    assert "netdam rows: 2 NICs a node process" in B.format_table(res)
    asked.clear()
    code, res = run_cli([*argv, "--json"], capsys)
    assert code == 0 and res["nics_per_process"] is None
    assert asked == [("chain", None), ("chain", None)]
    assert "NICs a node process" not in B.format_table(res)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "allreduce.png"
    cfg = B.AllReduceBenchConfig(
        nodes=(2, 4, 8),
        sizes=(1024, 1 << 20),
        peers=("ring-host",),
        repeat=1,
        plot=png,
        progress=False,
    )
    res, code = B.run_allreduce_bench(cfg, runner=fake_runner)
    assert code == 0 and res["plot"] == str(png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    real = B.util.find_spec
    monkeypatch.setattr(
        B.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a)
    )
    code, res = run_cli(
        [
            "bench",
            "allreduce",
            "--nodes",
            "2",
            "--size",
            "4KiB",
            "--plot",
            str(tmp_path / "x.png"),
            "--json",
        ],
        capsys,
    )
    assert code == 2 and "pip install matplotlib" in res["error"]


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--nodes", "1"], "2..64"),
        (["--nodes", "two"], "comma-separated"),
        (["--vs", "nccl"], "choose from"),
        (["--size", "64MB"], "decimal units"),
        (["--size", "6B"], "multiple of 4"),
        (["--sizes", "1KiB..3KiB"], "powers of two"),
        (["--size", "1KiB", "--sizes", "1KiB..2KiB"], "not allowed with"),
        (["--repeat", "0"], "out of range"),
        (["--plot", "fig.svg"], ".png"),
        (["--nics-per-process", "0"], "out of range"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, res = run_cli(["bench", "allreduce", *argv, "--json"], capsys)
    assert code == 2
    assert res["ok"] is False and fragment in res["error"]


def test_parsers() -> None:
    assert B.parse_nodes("8,2,4,4") == (2, 4, 8)
    assert B.parse_peers("mpi, GLOO") == ("gloo", "mpi")
    assert B.parse_peers("none") == () and B.parse_peers("chain") == ()
    assert B.mpirun_command(4)[:4][1:] == ["--oversubscribe", "-np", "4"]
    # The MPI rows: TCP loopback names its transport; shared memory leaves OpenMPI its choice.
    assert B.mpirun_command(4)[-3:] == ["--mca", "btl", "tcp,self"]
    assert "--mca" not in B.mpirun_command(4, "shared memory")
    assert B.parse_peers("mpi-shm,mpi") == ("mpi", "mpi-shm") and "mpi-shm" in B.PEERS


def test_a_peer_that_times_out_is_killed_with_its_process_group() -> None:
    """A Gloo run that cannot finish in time reports the timeout and leaves no rank behind."""
    pytest.importorskip("torch")
    before = _children()
    # 2 ranks of a 3-rank group: init_process_group waits for the third until the timeout.
    outcome = B.run_gloo(3, 1024, 0, 1, timeout_s=1.0, ranks=2)
    assert outcome.error is not None and "timed out after 1 s" in outcome.error
    assert _children() == before


def _children() -> set[int]:
    import os

    me = str(os.getpid())
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                found.add(int(entry.name))
    return found


def test_rounds_take_turns_and_pool_each_rows_calls() -> None:
    """--rounds 3: the rows of a (nodes, size) run chain, ring-host, chain, ...; each row holds
    every round's calls, each round's median, and its counters summed; a round that was wrong
    makes the row wrong."""
    order: list[str] = []
    slow = {1}  # the second round runs at half speed, for every row alike

    def runner(
        algo: str, nodes: int, count: int, warmup: int, repeat: int, timeout_s: float
    ) -> B._Outcome:
        turn = sum(a == algo for a in order)
        order.append(algo)
        base = fake_runner(algo, nodes, count, warmup, repeat, timeout_s)
        factor = 2.0 if turn in slow else 1.0
        return B._Outcome(
            times=[t * factor for t in base.times],
            ok=not (algo == "chain" and turn == 2 and count == 7),
            extra={"retransmits": turn, "phases": {"turn": turn}},
        )

    cfg = B.AllReduceBenchConfig(
        nodes=(2,), sizes=(4096,), peers=("ring-host",), repeat=4, progress=False, rounds=3
    )
    res, code = B.run_allreduce_bench(cfg, runner=runner)
    assert code == 0 and res["rounds"] == 3
    assert order == ["chain", "ring-host"] * 3
    rows = {r["algo"]: r for r in res["results"]}
    for row in rows.values():
        assert row["rounds"] == 3 and len(row["seconds_all"]) == 12
        first, second, third = row["round_medians"]
        assert second == pytest.approx(2 * first) and third == pytest.approx(first)
        assert row["retransmits"] == 0 + 1 + 2  # summed over the rounds
        assert row["phases"] == {"turn": 2}  # the rest: the last round's
    assert rows["ring-host"]["ratio_vs_chain"] == pytest.approx(3.0)
    assert "3 rounds, the rows taking turns" in B.format_table(res)
    wrong = B.AllReduceBenchConfig(
        nodes=(2,), sizes=(28,), peers=(), repeat=2, progress=False, rounds=3, emulation_mtu=0
    )
    order.clear()
    res, code = B.run_allreduce_bench(wrong, runner=runner)
    assert code == 1 and res["results"][0]["ok"] is False
