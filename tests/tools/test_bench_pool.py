"""`netdam bench pool`: generator processes against a real pool (nodes, switch, VIP), and the
time ALLOC and FREE take, FREE zeroing the backing (SPEC.md 6.1)."""

from __future__ import annotations

import pytest
from helpers import run_bench_cli as run_cli

from netdam.tools.bench import pool as P


@pytest.mark.slow
def test_pool_bench_reports_phases_and_what_freeing_costs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, res = run_cli(
        [
            "bench",
            "pool",
            "--seconds",
            "0.3",
            "--warmup",
            "0",
            "--generators",
            "1",
            "--max-generators",
            "1",
            "--json",
        ],
        capsys,
    )
    assert code == 0, res.get("error")
    assert res["netdam_ops"] > 0 and all(row["errors"] == 0 for row in res["results"].values())
    sizes = res["free"]["sizes"]
    assert [int(k) for k in sizes] == list(P.FREE_SIZES)
    for row in sizes.values():
        assert 0 < row["alloc_seconds"] < 5 and 0 < row["free_seconds"] < 5
