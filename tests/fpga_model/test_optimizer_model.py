"""The model of an optimizer step (fpga_model/optimizer.py): the cards' update is the longer of
their state traffic over their memory bandwidth and their fp32 lanes, on 1/N of the parameters;
the host's is its traffic over its DRAM on all of them; each after its all-reduce; and
`netdam model optimizer` prints both per link."""

from __future__ import annotations

import json

import pytest

from netdam.cli.main import main as cli_main
from netdam.fpga_model.collectives import default_params, netdam_chain, roce_ring
from netdam.fpga_model.optimizer import (
    STATE_BYTES,
    card_update_seconds,
    fused_update_seconds,
    host_update_seconds,
    optimizer_step,
)
from netdam.fpga_model.wire import max_data_bytes

ND, RO = default_params(100.0)


@pytest.mark.parametrize("rule", sorted(STATE_BYTES))
def test_updates_are_their_state_traffic_over_the_memory_bandwidth(rule: str) -> None:
    n = 50_000_000
    card = card_update_seconds(ND, rule, n, 2)
    memory = 2 * STATE_BYTES[rule] * n / ND.mem_bytes_per_s
    lanes = n / (ND.bus_bytes // 4) / ND.clock_hz
    assert card == pytest.approx(max(memory, lanes))
    assert card_update_seconds(ND, rule, 2 * n, 2) == pytest.approx(2 * card)
    host = host_update_seconds(RO, rule, n, 2)
    assert host == pytest.approx((2 * STATE_BYTES[rule] + 2) * n / RO.host_dram_bytes_per_s)


def test_a_step_is_the_all_reduce_then_the_update() -> None:
    card, host = optimizer_step(ND, RO, 8, 100_000_000, "adam", 2, fused=False)
    assert card.allreduce_s == pytest.approx(netdam_chain(ND, 8, 200_000_000, 2).seconds)
    assert card.update_s == pytest.approx(card_update_seconds(ND, "adam", 12_500_000, 2))
    assert host.allreduce_s == pytest.approx(roce_ring(RO, 8, 200_000_000, 2).seconds)
    assert host.update_s == pytest.approx(host_update_seconds(RO, "adam", 100_000_000, 2))
    assert card.seconds == card.allreduce_s + card.update_s
    assert card.steps_per_second == pytest.approx(1 / card.seconds)
    faster, _ = optimizer_step(*default_params(200.0), 8, 100_000_000, "adam", 2, fused=False)
    assert faster.seconds < card.seconds


def test_a_fused_step_hides_the_update_behind_the_blocks_arrival() -> None:
    """The last hop steps each chunk as it lands: only the update's excess over the block's
    stream at line rate shows, plus the last chunk's own update."""
    block = 12_500_000
    fused, _ = optimizer_step(ND, RO, 8, 8 * block, "adam", 2)
    unfused, _ = optimizer_step(ND, RO, 8, 8 * block, "adam", 2, fused=False)
    assert fused.allreduce_s == unfused.allreduce_s
    stream = block * 2 * 8 / (ND.link_gbps * 1e9)
    chunk = max_data_bytes(ND.mtu, 7, 2) // 2
    assert fused.update_s == pytest.approx(
        max(card_update_seconds(ND, "adam", block, 2) - stream, 0)
        + card_update_seconds(ND, "adam", chunk, 2)
    )
    assert fused.update_s == fused_update_seconds(ND, "adam", block, 2, 7)
    assert fused.seconds < unfused.seconds
    # SGD on f32 gradients: the lanes (4 G parameters/s) outrun the block's stream (3.1 G/s at
    # 100 Gb/s): the whole update hides but the last chunk's.
    light, _ = optimizer_step(ND, RO, 8, 8 * block, "sgd", 4)
    chunk32 = max_data_bytes(ND.mtu, 7, 4) // 4
    assert light.update_s == pytest.approx(card_update_seconds(ND, "sgd", chunk32, 4))


def test_unknown_rules_and_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown rule"):
        optimizer_step(ND, RO, 4, 1000, "lion")
    with pytest.raises(ValueError, match="at least one parameter"):
        optimizer_step(ND, RO, 4, 0, "sgd")


def test_cli_prints_both_links(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["model", "optimizer", "--model-size", "125M", "--nodes", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model_size"] == 125_000_000 and [r["link_gbps"] for r in out["links"]] == [100, 200]
    for row in out["links"]:
        assert row["speedup"] == pytest.approx(
            row["netdam"]["steps_per_second"] / row["roce"]["steps_per_second"]
        )
    with pytest.raises(SystemExit) as stop:
        cli_main(["model", "optimizer", "--model-size", "1.5x", "--nodes", "8"])
    assert stop.value.code == 2 and "not a parameter count" in capsys.readouterr().err
