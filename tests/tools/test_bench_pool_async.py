"""`netdam bench pool --async`: AsyncPoolClients in one event loop against a real pool (nodes,
switch, VIP); every READ compared with the bytes its slot holds."""

from __future__ import annotations

import pytest
from helpers import run_bench_cli as run_cli

from netdam.tools.bench import pool_async as A


@pytest.mark.slow
def test_async_clients_in_one_loop_read_what_was_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, res = run_cli(
        [
            "bench",
            "pool",
            "--async",
            "--clients",
            "4",
            "--seconds",
            "0.3",
            "--warmup",
            "0",
            "--json",
        ],
        capsys,
    )
    assert code == 0, res.get("error")
    assert res["ok"] is True and res["mode"] == "async" and res["clients"] == 4
    assert list(res["results"]) == [name for name, _, _ in A.PHASES]
    for name, row in res["results"].items():
        assert row["ops"] > 0, name
        assert row["mismatches"] == 0 and row["errors"] == 0
        assert 0 < row["p50_us"] <= row["p99_us"]
    assert res["netdam_ops"] == res["results"]["read_64"]["ops"]


def test_patterns_differ_per_slot_and_client() -> None:
    assert A._pattern(0, 0, 64) != A._pattern(0, 1, 64) != A._pattern(1, 0, 64)
    assert A._pattern(3, 5, 4096)[:64] == A._pattern(
        3, 5, 64
    )  # a 64 B read checks a 4 KiB write's head


@pytest.mark.parametrize(
    ("flags", "message"), [(["--clients", "0"], "1..256"), (["--plot", "x.png"], "drop it")]
)
def test_async_usage_errors(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, res = run_cli(["bench", "pool", "--async", *flags, "--json"], capsys)
    assert code == 2 and message in res["error"]
