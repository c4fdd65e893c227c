"""An optimizer step on NetDAM cards (SPEC.md 6.8's UPDATE) against a host optimizer after a RoCE
all-reduce: steps per second for a model of P parameters over N nodes.

- NetDAM (the design's pool optimizer, sharded and fused: SPEC.md 4.1's fused reduce and
  update): the gradients are all-reduced by the chain (netdam-chain, or netdam-chain-2d past one
  SR list) in the gradients' dtype, and each block's last hop, the card holding that 1/N of the
  parameters, steps them as the block's chunks arrive and multicasts the weights in place of
  the sum. The update hides behind the block's arrival at line rate: what shows is the update's
  excess over that stream, if any, plus one chunk's update (the last chunk, after the stream
  ends). ``fused=False`` counts the whole update after the all-reduce instead (no overlap).
- RoCE host (DDP + torch.optim): the gradients are all-reduced as Open MPI runs it over RoCE
  (``roce-ring``, validated on published measurements), then every host's CPU applies the rule
  to all P parameters, with every core (torch's intra-op threads) at the host's DRAM bandwidth.

On the card the update takes the longer of its state traffic (8-24 bytes read and written per
parameter) over ``mem_bytes_per_s`` and its fp32 lanes, ``bus_bytes / 4`` elements a cycle with
every operator pipelined (the shipped presets: 16 lanes at 250 MHz, 4 G parameters/s, slower
than their HBM for every rule); on the host it is the state and gradient traffic over
``host_dram_bytes_per_s`` (the best a multi-threaded step reaches: the host side's most
favourable case). Assumptions, not measurements: no card with UPDATE
exists, and torch.optim's step was not timed on these hosts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from . import wire
from .collectives import CHAIN_GROUP, netdam_chain, netdam_chain_2d, roce_ring
from .params import NetdamParams, RoceParams

#: float32 state bytes an update reads and writes again per parameter: the master, and each
#: moment the rule keeps (SPEC.md 6.8).
STATE_BYTES = {"sgd": 4, "sgd-momentum": 8, "adam": 12}
RULES = tuple(STATE_BYTES)


@dataclass(frozen=True)
class OptimizerEstimate:
    """One training step's communication and update on one side."""

    side: str
    allreduce_s: float
    update_s: float

    @property
    def seconds(self) -> float:
        return self.allreduce_s + self.update_s

    @property
    def steps_per_second(self) -> float:
        return 1.0 / self.seconds

    def as_dict(self) -> dict[str, float | str]:
        return {
            "side": self.side,
            "allreduce_seconds": self.allreduce_s,
            "update_seconds": self.update_s,
            "step_seconds": self.seconds,
            "steps_per_second": self.steps_per_second,
        }


def _check(rule: str, params: int, grad_bytes: int) -> None:
    if rule not in STATE_BYTES:
        raise ValueError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")
    if params < 1:
        raise ValueError(f"a model has at least one parameter, got {params}")
    if grad_bytes not in (2, 4):
        raise ValueError(f"gradients are 2 (bf16, f16) or 4 (f32) bytes, got {grad_bytes}")


def card_update_seconds(p: NetdamParams, rule: str, elements: int, grad_bytes: int = 4) -> float:
    """A card applying *rule* to *elements* parameters in its memory (the gradient arrives on
    the wire: only the state is read and written)."""
    _check(rule, elements, grad_bytes)
    memory = 2 * STATE_BYTES[rule] * elements / p.mem_bytes_per_s
    lanes = wire.beats(4 * elements, p.bus_bytes) / p.clock_hz
    return max(memory, lanes)


def host_update_seconds(p: RoceParams, rule: str, elements: int, grad_bytes: int = 4) -> float:
    """A host applying *rule* to *elements* parameters (torch.optim's step) at its DRAM
    bandwidth: state read and written, the gradient read."""
    _check(rule, elements, grad_bytes)
    return (2 * STATE_BYTES[rule] + grad_bytes) * elements / p.host_dram_bytes_per_s


def fused_update_seconds(
    p: NetdamParams, rule: str, elements: int, grad_bytes: int = 4, segments: int = 0
) -> float:
    """What a block's update adds to a fused reduce and update: the owner steps each chunk as
    it lands, so the update hides behind the block's arrival at line rate (its data bytes alone:
    the headers would lengthen the stream and hide more) except its excess over that stream and
    the last chunk's own update. *segments*: the SR list the chunks carry (it shrinks them)."""
    _check(rule, elements, grad_bytes)
    chunk = wire.max_data_bytes(p.mtu, segments, grad_bytes) // grad_bytes
    stream = elements * grad_bytes * 8 / (p.link_gbps * 1e9)
    whole = card_update_seconds(p, rule, elements, grad_bytes)
    return max(whole - stream, 0.0) + card_update_seconds(p, rule, min(chunk, elements), grad_bytes)


def optimizer_step(
    nd: NetdamParams,
    ro: RoceParams,
    nodes: int,
    params: int,
    rule: str,
    grad_bytes: int = 4,
    fused: bool = True,
) -> tuple[OptimizerEstimate, OptimizerEstimate]:
    """(NetDAM cards, RoCE hosts): one step of a *params*-parameter model over *nodes*; the
    cards' update fused into the chain (the default) or after it."""
    _check(rule, params, grad_bytes)
    nbytes = params * grad_bytes
    chain = netdam_chain if nodes <= CHAIN_GROUP + 1 else netdam_chain_2d
    block = math.ceil(params / nodes)
    card = OptimizerEstimate(
        "netdam" if fused else "netdam-unfused",
        chain(nd, nodes, nbytes, grad_bytes).seconds,
        fused_update_seconds(nd, rule, block, grad_bytes, min(nodes, CHAIN_GROUP + 1) - 1)
        if fused
        else card_update_seconds(nd, rule, block, grad_bytes),
    )
    host = OptimizerEstimate(
        "roce",
        roce_ring(ro, nodes, nbytes, grad_bytes).seconds,
        host_update_seconds(ro, rule, params, grad_bytes),
    )
    return card, host
