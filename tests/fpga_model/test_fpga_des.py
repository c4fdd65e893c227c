"""Discrete-event model against the analytic one: agreement, and where they part."""

from __future__ import annotations

import dataclasses
import random

import pytest

from netdam.fpga_model import des, load_preset, wire
from netdam.fpga_model.analytic import (
    line_rate_stages,
    pipeline_latency_s,
    pipeline_rate,
    stage_rate_pps,
)
from netdam.fpga_model.params import NetdamParams
from netdam.fpga_model.pipeline import NETDAM_OPS, Stage, netdam_shape, netdam_stages


def _random_uncontended(rng: random.Random) -> tuple[str, list[Stage]]:
    """A single-flow configuration whose memory stage is not near the bottleneck."""
    while True:
        base = load_preset(rng.choice(["netdam-100g", "netdam-200g", "netdam-sram-100g"]))
        assert isinstance(base, NetdamParams)
        p = dataclasses.replace(
            base,
            link_gbps=rng.choice([25.0, 50.0, 100.0, 200.0, 400.0]),
            clock_hz=rng.choice([200e6, 250e6, 300e6, 322e6]),
        )
        op = rng.choice(NETDAM_OPS)
        data = 4 * rng.randint(64, 2048)
        stages = netdam_stages(p, netdam_shape(op, data, rng.randint(0, 4)))
        rate, _ = pipeline_rate(stages)
        mem = [s for s in stages if s.name == "memory"]
        if not mem or stage_rate_pps(mem[0]) > 1.5 * rate:
            return f"{p.name} {p.link_gbps:g}G {p.clock_hz / 1e6:g}MHz {op} {data}B", stages


def test_des_agrees_with_analytic_on_100_random_uncontended_configs() -> None:
    rng = random.Random(20261122)
    worst = 0.0
    for i in range(100):
        label, stages = _random_uncontended(rng)
        rate, _ = pipeline_rate(stages)
        sat = des.saturated(stages, packets=300, seed=i)
        low = des.unloaded(stages, packets=60, seed=i)
        err_rate = abs(sat.throughput_pps / rate - 1)
        err_lat = abs(low.latency_mean_s / pipeline_latency_s(stages) - 1)
        worst = max(worst, err_rate, err_lat)
        assert err_rate < 0.02, (label, sat.throughput_pps, rate)
        assert err_lat < 0.02, (label, low.latency_mean_s, pipeline_latency_s(stages))
        assert sat.dropped == 0  # a flow-controlled source is paused, never dropped
    assert worst < 0.02


def test_parting_small_packets() -> None:
    """64 B frames on HBM: in-order completion + DRAM jitter cost ~4% of the line rate."""
    stages = line_rate_stages(load_preset("netdam-100g"), wire.udp_payload_for_frame(64))
    rate, bottleneck = pipeline_rate(stages)
    sim = des.saturated(stages, packets=3000)
    assert bottleneck == "wire_in" and rate / 1e6 == pytest.approx(148.8, abs=0.05)
    assert 0.90 < sim.throughput_pps / rate < 0.98
    # Without jitter the same pipeline keeps the line rate: the loss is the jitter's.
    calm = [dataclasses.replace(s, jitter_s=0.0) for s in stages]
    assert des.saturated(calm, packets=3000).throughput_pps / rate == pytest.approx(1.0, abs=0.01)


def test_parting_memory_bound() -> None:
    """One DDR4 channel at 200G: rates agree, but the queue in front of memory fills."""
    stages = line_rate_stages(load_preset("netdam-ddr4-200g"), 8972)
    rate, bottleneck = pipeline_rate(stages)
    assert bottleneck == "memory"
    sim = des.offered_load(stages, period_s=stages[0].ii_s, packets=3000)  # line rate in
    assert sim.throughput_pps / rate == pytest.approx(1.0, abs=0.02)
    assert sim.dropped > 0.15 * sim.offered  # the wire cannot be paused: ~24% are lost
    assert sim.latency_p50_s > 20 * pipeline_latency_s(stages)


def test_parting_incast() -> None:
    """8 senders at line rate into one port: the analytic model knows no queue."""
    p = load_preset("netdam-100g")
    rx = line_rate_stages(p, 8972, "write")
    port = Stage("switch_port", p.switch_latency_s + rx[0].ii_s, rx[0].ii_s, capacity=64)
    tail = [port, *rx[1:]]
    unloaded = port.latency_s + pipeline_latency_s(rx[1:])
    one = des.incast([], tail, 1, 300, rx[0].ii_s)
    assert one.latency_p99_s == pytest.approx(unloaded, rel=0.01) and one.dropped == 0
    eight = des.incast([], tail, 8, 300, rx[0].ii_s)
    assert eight.throughput_pps * rx[0].ii_s == pytest.approx(1.0, abs=0.02)  # port saturated
    assert eight.dropped > 0.5 * eight.offered
    assert eight.latency_p99_s > 10 * unloaded


def test_des_is_deterministic_per_seed() -> None:
    stages = line_rate_stages(load_preset("netdam-100g"), 18)
    a = des.saturated(stages, packets=500, seed=7)
    b = des.saturated(stages, packets=500, seed=7)
    assert a == b
