"""Optimizers whose masters and state live in NIC memory (SPEC.md 6.8), torch-style:
``PoolSGD(params, lr=..., momentum=...)``, ``PoolAdam(params, lr=...)``, ``PoolAdamW``.

The parameters' float32 masters, the optimizer's moments and a step table sit in this rank's
NIC (its arena: ``ProcessGroup.empty``), under an optimizer descriptor. ``step()`` sends the
gradients as UPDATEs, one per chunk; the NIC applies the rule where each lands, exactly once per
step (a re-sent datagram is answered, not applied), and ``step()`` returns once every chunk is
ACKed, with the new weights copied into the parameters. The rules round as
``netdam.protocol.optim`` does, bit for bit; against ``torch.optim`` they agree within 2^-16
relative over 30 steps (tests/protocol/test_optim.py).

Give every rank the same gradients (DDP's, all-reduced by ``netdam.clients.ddp``'s hook, or
``netdam.all_reduce``'s) in the first two layouts:

- replicated (the default), as DDP keeps a ``torch.optim`` replica per rank: each rank's NIC
  holds the whole state and applies the whole gradient;
- ``shard=True``: rank r's NIC holds and steps only block r of the parameters (the blocks of a
  chain all-reduce, ``r * P // N`` on); after the step the group all-gathers the new weights
  through the NICs, so every rank's parameters are the same. A collective call: every rank
  of the group steps together. Each NIC keeps 1/N of the state;
- ``fused=True``: one collective per step, no separate all-reduce. Pass each rank's *own*
  gradients (not all-reduced: no DDP hook). ``step()`` runs a fused reduce and update (SPEC.md
  4.1): the chain sums block r of the ranks' gradients (each divided by the world size first,
  DDP's mean) and its last hop, rank r's NIC, steps the optimizer there and stores the new
  weights in place of the sum; the multicast all-gather then carries weights to every rank.
  Each NIC keeps 1/N of the state, as with ``shard=True``; the wire carries ``grad_dtype``
  both ways (bf16 or f16 weights to the workers, f32 masters in the NICs).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from netdam import api
from netdam.cluster.control import ControlClient
from netdam.protocol.constants import (
    ELEMENT_SIZE,
    MAX_PAYLOAD_BYTES,
    NUMPY_DTYPE,
    DType,
    Opcode,
    Status,
)
from netdam.protocol.elements import BFLOAT16, bf16_round
from netdam.protocol.errors import NetdamError
from netdam.protocol.layout import OPT_LR, OPTIMIZER_BYTES
from netdam.protocol.optim import AdamRule, SgdRule, descriptor_for, gradient_values
from netdam.protocol.packet import Packet

__all__ = ["OptimizerError", "PoolAdam", "PoolAdamW", "PoolOptimizer", "PoolSGD"]

#: Where the masters start after the descriptor (the rest of its 128 bytes unused: alignment).
_HEAD = 128
#: Gradient dtypes by the names torch and numpy give them.
_GRAD_DTYPES = {"float32": DType.F32, "float16": DType.F16, "bfloat16": DType.BF16}


class OptimizerError(NetdamError, RuntimeError):
    """A NIC refused an UPDATE: the status says why (SPEC.md 6.8)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class PoolOptimizer:
    """The masters and state of *params* in this rank's NIC, stepped there by *rule*.

    *params*: torch tensors (their ``.grad`` is sent) or float32 numpy arrays (pass the
    gradients to ``step``). *grad_dtype*: what goes on the wire ("float32", "float16" or
    "bfloat16"; widened to float32 exactly in the NIC). *shard*: this rank's NIC keeps only
    its block of the state, and ``step`` all-gathers the weights (module docstring)."""

    def __init__(
        self,
        params: Iterable[Any],
        rule: SgdRule | AdamRule,
        *,
        group: api.ProcessGroup | None = None,
        grad_dtype: str = "float32",
        shard: bool = False,
        fused: bool = False,
    ) -> None:
        if grad_dtype not in _GRAD_DTYPES:
            raise ValueError(
                f"grad_dtype must be one of {', '.join(_GRAD_DTYPES)}, not {grad_dtype!r}"
            )
        self.group = group if group is not None else api.get_default_group()
        self.params = list(params)
        if not self.params:
            raise ValueError("an optimizer needs at least one parameter")
        self.rule = rule
        self.grad_dtype = _GRAD_DTYPES[grad_dtype]
        self.count = sum(int(np.prod(_shape(p))) for p in self.params)
        world, rank = self.group.world_size, self.group.rank
        self.fused = fused
        if fused and world > self.group.max_chain:
            raise ValueError(
                f"a fused step runs over one chain of at most {self.group.max_chain} ranks, "
                f"not {world}: use shard=True (UPDATE, then all_gather)"
            )
        self.shard = (shard or fused) and world > 1
        if self.shard and self.count < world:
            raise ValueError(f"{self.count} parameters cannot be sharded over {world} ranks")
        #: The parameters this rank's NIC steps: all, or its block.
        self.lo, self.hi = (
            (rank * self.count // world, (rank + 1) * self.count // world)
            if self.shard
            else (0, self.count)
        )
        local = self.hi - self.lo
        #: Elements per UPDATE: the most one datagram's payload holds.
        self.chunk = MAX_PAYLOAD_BYTES // ELEMENT_SIZE[self.grad_dtype]
        #: A fused step's gradients in, weights out: first, so it sits at the same address on
        #: every rank (a chain reads and stores the same address on each member).
        # bf16 as netdam's marked uint16: plain uint16 is not reduced as bf16.
        wire_dtype = BFLOAT16 if self.grad_dtype == DType.BF16 else NUMPY_DTYPE[self.grad_dtype]
        self._wire = self.group.empty(self.count, wire_dtype) if fused else None
        # Every rank's block as large as the largest (ceil), so the arrays this rank makes
        # after this one also sit where the other ranks' do.
        widest = -(-self.count // world) if self.shard else local
        self._block = self.group.empty(
            _HEAD + 12 * widest + 4 * math.ceil(widest / self.chunk), np.uint8
        )
        self.address = self.group.address_of(self._block)
        self._block[:] = 0
        self._block[:OPTIMIZER_BYTES] = np.frombuffer(
            descriptor_for(rule, local, self.chunk, _HEAD).encode(), np.uint8
        )
        self.masters = self._block[_HEAD : _HEAD + 4 * local].view(np.float32)
        self.masters[:] = np.concatenate([_values(p).ravel() for p in self.params])[
            self.lo : self.hi
        ]
        #: The whole model's new weights after a sharded step (gathered from every NIC).
        self._weights = np.empty(self.count, np.float32) if self.shard else self.masters
        self.steps = 0
        self.last_stats: dict[str, int] = {}
        # A socket of its own: the group's carries its collectives' answers.
        self._client = ControlClient.for_cluster(self.group.cluster)

    @property
    def lr(self) -> float:
        return float(self._block[OPT_LR : OPT_LR + 8].view(np.float64)[0])

    @lr.setter
    def lr(self, value: float) -> None:
        """A new learning rate from the next step on: the descriptor's ``lr``, in NIC memory."""
        self._block[OPT_LR : OPT_LR + 8].view(np.float64)[0] = value
        self.rule = dataclasses.replace(self.rule, lr=value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if getattr(p, "grad", None) is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    def step(self, grads: Sequence[np.ndarray] | None = None) -> None:
        """One step: the gradients (*grads*, or each parameter's ``.grad``) go to the NIC as
        UPDATEs; returns when every chunk is ACKed, the new weights in the parameters."""
        flat = np.concatenate(
            [
                np.asarray(g, dtype=np.float32).ravel()
                for g in (grads if grads is not None else [_grad(p) for p in self.params])
            ]
        )
        if flat.size != self.count:
            raise ValueError(f"{flat.size} gradient elements for {self.count} parameters")
        if self.fused:
            self._fused_step(flat)
            return
        wire = _encode(flat[self.lo : self.hi], self.grad_dtype)
        esize = ELEMENT_SIZE[self.grad_dtype]
        step = self.steps + 1
        packets = [
            Packet(
                Opcode.UPDATE,
                rkey=self.group.arena_rkey,
                addr=self.address,
                aux_addr=first,
                epoch=step,
                dtype=self.grad_dtype,
            ).with_payload(wire[first * esize : (first + self.chunk) * esize])
            for first in range(0, self.hi - self.lo, self.chunk)
        ]
        for packet, answer in zip(
            packets, self._client.requests(self.group.node, packets), strict=True
        ):
            if answer.opcode != Opcode.ACK:
                raise OptimizerError(
                    f"step {step}: the NIC refused the UPDATE of elements {packet.aux_addr}.. "
                    f"{Status(answer.status).name} (SPEC.md 6.8)",
                    int(answer.status),
                )
        self.steps = step
        if self.shard:
            # Every rank's block of the new weights, through the NICs, onto every rank.
            api.all_gather_into_tensor(self._weights, self.masters, group=self.group)
        self._copy_out()

    def _fused_step(self, flat: np.ndarray) -> None:
        """One fused reduce and update over the group (a collective call: every rank at once):
        this rank's gradients, divided by the world size, in; the new weights out."""
        assert self._wire is not None
        step = self.steps + 1
        wire = self._wire.view(np.uint8)
        wire[:] = np.frombuffer(
            _encode(flat / np.float32(self.group.world_size), self.grad_dtype), np.uint8
        )
        try:
            work = api.all_reduce(
                self._wire, group=self.group, async_op=True, update=(self.address, step)
            )
            assert work is not None
            work.wait()
        except api.CollectiveError as e:
            raise OptimizerError(
                f"step {step}: the fused reduce and update failed: {e} (a NIC that stepped "
                "part of its block before the failure keeps it: restore the weights and the "
                "optimizer from a checkpoint before stepping again)",
                e.status,
            ) from e
        self.steps = step
        #: This rank's node's count of the last fused step's re-sent chains and repair reads.
        self.last_stats = dict(work.stats)
        # Widened into an array of the optimizer's own: the wire buffer takes the next step.
        self._weights = np.array(gradient_values(self._wire, self.grad_dtype), np.float32)
        self._copy_out()

    def _copy_out(self) -> None:
        at = 0
        for p in self.params:
            n = int(np.prod(_shape(p)))
            _assign(p, self._weights[at : at + n])
            at += n

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> PoolOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PoolSGD(PoolOptimizer):
    """torch.optim.SGD's rule, stepped in the NIC."""

    def __init__(
        self,
        params: Iterable[Any],
        lr: float,
        momentum: float = 0.0,
        dampening: float = 0.0,
        weight_decay: float = 0.0,
        nesterov: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(params, SgdRule(lr, momentum, dampening, weight_decay, nesterov), **kwargs)


class PoolAdam(PoolOptimizer):
    """torch.optim.Adam's rule, stepped in the NIC (``amsgrad`` not offered)."""

    decoupled = False

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        **kwargs: Any,
    ) -> None:
        rule = AdamRule(lr, betas[0], betas[1], eps, weight_decay, self.decoupled)
        super().__init__(params, rule, **kwargs)


class PoolAdamW(PoolAdam):
    """torch.optim.AdamW's rule (decoupled weight decay, 0.01 by default), stepped in the NIC."""

    decoupled = True

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, **kwargs: Any) -> None:
        kwargs.setdefault("weight_decay", 1e-2)
        super().__init__(params, lr, **kwargs)


def _shape(p: Any) -> tuple[int, ...]:
    return tuple(p.shape)


def _values(p: Any) -> np.ndarray:
    """A parameter's values as float32 (a torch tensor's, detached)."""
    if hasattr(p, "detach"):
        p = p.detach().float().cpu().numpy()  # float(): bf16 widened exactly (numpy has none)
    return np.asarray(p, dtype=np.float32)


def _grad(p: Any) -> np.ndarray:
    grad = getattr(p, "grad", None)
    if grad is None:
        raise ValueError("a parameter has no .grad: call backward() first, or pass grads to step()")
    return _values(grad)


def _assign(p: Any, values: np.ndarray) -> None:
    """Copy the NIC's new weights into the parameter, in place."""
    if hasattr(p, "detach"):  # a torch tensor (numpy arrays have .data too)
        import torch  # only for torch parameters: netdam runs without torch

        with torch.no_grad():
            p.copy_(torch.from_numpy(values.reshape(p.shape)).to(p.dtype))
    else:
        p[...] = values.reshape(p.shape)


def _encode(values: np.ndarray, dtype: DType) -> bytes:
    """The gradient as the wire carries it: f32, f16, or bf16 rounded to nearest even."""
    if dtype == DType.F32:
        return values.astype("<f4").tobytes()
    if dtype == DType.F16:
        return values.astype("<f2").tobytes()
    encoded: bytes = bf16_round(values).astype("<u2").tobytes()
    return encoded
