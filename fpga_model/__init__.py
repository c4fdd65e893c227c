"""FPGA cycle model of a NetDAM card and of a RoCE host (installed as ``netdam.fpga_model``).

A laptop's wall clock says nothing about 100 Gb/s hardware, so this package estimates what
the same job costs on a real NetDAM card and on a RoCE host:

- ``params``: frozen parameter dataclasses with provenance, presets in ``presets/*.toml``;
- ``wire``: Ethernet/IP/UDP/NetDAM framing arithmetic;
- ``pipeline``: per-packet stage costs shared by both models;
- ``analytic``: closed-form latency breakdowns and line rate;
- ``des``: discrete-event model (queues, backpressure, jitter, incast);
- ``collectives``: all-reduce time of NetDAM chain, RoCE (hardware bound and MPI library as
  run), halving-doubling, ideal;
- ``validation``: the RoCE models against published host all-reduce measurements
  (``measurements/``).

``estimate_allreduce_seconds(nodes, nbytes, link_gbps=100.0, algo="netdam-chain",
dtype_bytes=4)`` is the stable entry point the emulator's collectives call.
"""

from __future__ import annotations

from .analytic import (
    LineRate,
    OpBreakdown,
    fit_netdam_mem_latency,
    fit_roce_nic_side,
    line_rate,
    line_rate_stages,
    op_breakdown,
    pipeline_latency_s,
    pipeline_rate,
    roce_one_way_s,
)
from .collectives import (
    ALGOS,
    AllreduceEstimate,
    allreduce,
    bus_factor,
    default_params,
    estimate_allreduce_seconds,
)
from .des import DesResult, Source, simulate
from .params import (
    NetdamParams,
    NicParams,
    ParamSet,
    Provenance,
    RoceParams,
    load_params_file,
    load_preset,
    preset_names,
)
from .pipeline import Stage, stages_for

__all__ = [
    "ALGOS",
    "AllreduceEstimate",
    "DesResult",
    "LineRate",
    "NetdamParams",
    "NicParams",
    "OpBreakdown",
    "ParamSet",
    "Provenance",
    "RoceParams",
    "Source",
    "Stage",
    "allreduce",
    "bus_factor",
    "default_params",
    "estimate_allreduce_seconds",
    "fit_netdam_mem_latency",
    "fit_roce_nic_side",
    "line_rate",
    "line_rate_stages",
    "load_params_file",
    "load_preset",
    "op_breakdown",
    "pipeline_latency_s",
    "pipeline_rate",
    "preset_names",
    "roce_one_way_s",
    "simulate",
    "stages_for",
]
