"""roce-ring against published host all-reduce measurements (issue 16, fpga_model/README.md).

The sets are shipped data (fpga_model/measurements/); these tests bound the model's
geometric-mean ratio over each set, check that the sets are what the README says they are
(one rank per host, 2-8 hosts, tens of KiB up, cited), and that no all-reduce row was used to
fit a parameter.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import run_model_cli

from netdam.fpga_model.analytic import fit_roce_sw_message
from netdam.fpga_model.collectives import default_params, roce_ideal, roce_ring
from netdam.fpga_model.params import load_preset
from netdam.fpga_model.validation import (
    BOUNDS,
    MEASUREMENTS_DIR,
    MeasuredPoint,
    compare_set,
    geometric_mean,
    load_sets,
)

README = Path(__file__).resolve().parents[2] / "fpga_model" / "README.md"


def test_at_least_two_independent_sets_in_scope() -> None:
    sets = load_sets()
    assert len(sets) >= 2
    assert len({s.citation for s in sets}) == len(sets)  # independent sources
    for s in sets:
        nodes = {p.nodes for p in s.points}
        assert nodes <= set(range(2, 9)) and len(nodes) >= 2, s.key
        sizes = [p.nbytes for p in s.points if p.nbytes >= s.validate_from_bytes]
        assert min(sizes) <= 64 << 10 and max(sizes) >= 1 << 20, s.key  # tens of KiB to MiB
        assert s.validate_from_bytes >= 10 << 10  # "from tens of KiB"
        assert all(p.seconds > 0 for p in s.points)
        head = (MEASUREMENTS_DIR / f"{s.key}.csv").read_text().splitlines()[0]
        assert head.startswith("#") and s.citation and s.hosts and s.metric


@pytest.mark.parametrize("key", [s.key for s in load_sets()])
def test_roce_ring_geomean_within_bounds(key: str) -> None:
    (measured,) = [s for s in load_sets() if s.key == key]
    ring = compare_set(measured, "roce-ring")
    assert BOUNDS[0] <= ring.geomean <= BOUNDS[1], (key, ring.geomean)
    # The hardware bound is what issue 16 says it is: well under what the library reaches.
    ideal = compare_set(measured, "roce-ideal")
    assert ideal.geomean < BOUNDS[0] < ring.geomean, (key, ideal.geomean)
    for r, i in zip(ring.rows, ideal.rows):
        assert r.model_seconds >= i.model_seconds * (1 - 1e-12)


def test_acclplus_authors_aggregation_also_within_bounds() -> None:
    """The set's latency_us is the slowest rank's median; the authors' plot.py takes the
    slowest rank's mean (column mean_latency_us). The bound holds for either."""
    import csv

    (accl,) = [s for s in load_sets() if s.key == "acclplus-hacc-roce100"]
    path = MEASUREMENTS_DIR / "acclplus-hacc-roce100.csv"
    with path.open() as fh:
        rows = list(csv.DictReader(line for line in fh if not line.startswith("#")))
    ratios = [
        roce_ring(accl.params, int(r["nodes"]), int(r["bytes"])).seconds
        / (float(r["mean_latency_us"]) * 1e-6)
        for r in rows
        if int(r["bytes"]) >= accl.validate_from_bytes
    ]
    assert BOUNDS[0] <= geometric_mean(ratios) <= BOUNDS[1]
    assert f"{geometric_mean(ratios):.2f}" in README.read_text()


def test_readme_quotes_the_computed_geomeans() -> None:
    """fpga_model/README.md's validation table must say what the code computes."""
    text = README.read_text()
    for s in load_sets():
        ring, ideal = compare_set(s, "roce-ring"), compare_set(s, "roce-ideal")
        row = [line for line in text.splitlines() if line.startswith(f"| `{s.key}`")]
        assert row, s.key
        numbers = re.findall(r"\*\*(\d+\.\d+)\*\*", row[0])
        assert numbers and float(numbers[0]) == pytest.approx(ring.geomean, abs=0.006), s.key
        assert f"{ideal.geomean:.2f}" in row[0], s.key


def test_sets_use_their_own_host_parameters() -> None:
    by_key = {s.key: s for s in load_sets()}
    _, preset = default_params(100.0)
    accl = by_key["acclplus-hacc-roce100"].params
    # Same NIC class and PCIe as the preset: nothing overridden, so the set tests the preset.
    assert {k: v for k, v in vars(accl).items() if k not in ("name", "provenance")} == {
        k: v for k, v in vars(preset).items() if k not in ("name", "provenance")
    }
    lassen = by_key["lassen-edr-dualrail"].params
    assert lassen.link_gbps == 200.0
    # Its fitted values come from its point-to-point runs, never from all-reduce rows.
    for name in ("pcie_bytes_per_s", "sw_message_s"):
        prov = lassen.source_of(name)
        assert prov.status == "fitted" and "osu_latency" in prov.source
    assert fit_roce_sw_message(lassen, 1.13e-6) == pytest.approx(lassen.sw_message_s, abs=1e-9)


def test_sw_message_fitted_to_published_mpi_latency() -> None:
    p = load_preset("roce-gen3")
    assert p.source_of("sw_message_s").status == "fitted"
    assert fit_roce_sw_message(p) == pytest.approx(p.sw_message_s, abs=1e-9)
    # The MPI one-way latency the fit reproduces: verbs through the switch + software.
    one_way = roce_ring(p, 2, 4).terms["latency"]
    assert one_way > p.sw_message_s + 1.1e-6


def test_geometric_mean_and_ratio() -> None:
    assert geometric_mean([0.5, 2.0]) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        geometric_mean([])
    (s, *_) = load_sets()
    c = compare_set(s)
    row = c.rows[0]
    assert row.ratio == pytest.approx(row.model_seconds / row.point.seconds)
    assert isinstance(row.point, MeasuredPoint)
    with pytest.raises(ValueError, match="unknown model"):
        compare_set(s, "netdam-chain")


def test_non_power_of_two_penalty_matches_the_data() -> None:
    """The published set shows Open MPI's folding: 3 and 5-7 hosts slower than 4 and 8 at
    4 MiB. The model (Rabenseifner with its fold) reproduces the ordering."""
    (accl,) = [s for s in load_sets() if s.key == "acclplus-hacc-roce100"]
    at = {p.nodes: p.seconds for p in accl.points if p.nbytes == 4 << 20}
    model = {n: roce_ring(accl.params, n, 4 << 20).seconds for n in at}
    for odd, even in ((3, 4), (5, 8), (6, 8), (7, 8)):
        assert at[odd] > at[even] and model[odd] > model[even], (odd, even)
    assert roce_ideal(accl.params, 3, 4 << 20).seconds < model[3]


def test_cli_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, d = run_model_cli(["model", "validate", "--json"], capsys)
    assert rc == 0 and d["ok"] and d["bounds"] == list(BOUNDS)
    for s in d["sets"]:
        assert s["roce_ring"]["within_bounds"] is True
        assert s["roce_ideal"]["geomean_ratio"] < s["roce_ring"]["geomean_ratio"]
        assert {r["host_algorithm"] for r in s["roce_ring"]["rows"]} <= {
            "ring",
            "recursive_doubling",
            "rabenseifner",
        }
    rc, out = run_model_cli(["model", "validate", "--set", "lassen-edr-dualrail"], capsys)
    assert rc == 0 and "lassen-edr-dualrail" in out and "acclplus" not in out
    rc, d = run_model_cli(["model", "validate", "--set", "nope", "--json"], capsys)
    assert rc == 2 and "known: " in d["error"]
    pytest.importorskip("matplotlib")
    png = tmp_path / "v.png"
    rc, out = run_model_cli(["model", "validate", "--plot", str(png)], capsys)
    assert rc == 0 and png.stat().st_size > 1000
