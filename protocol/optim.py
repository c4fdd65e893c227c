"""The optimizer update rules a region's NIC applies in place (UPDATE, SPEC.md 6.8), in plain
numpy float32: the reference the NICs' kernel (netdam/kernels/optim.py) is held to bitwise
(tests/kernels/test_update.py), as ``elements.py`` is the bf16 rule's.

Masters are float32; a gradient arrives as float32, float16 or bfloat16 and is widened to
float32 exactly. Every operation below is one float32 operation, rounded to nearest even,
in the order written (no fused multiply-add: the kernels are compiled without fast-math, so
nothing is contracted). Hyperparameters are the owner's float64 values; each enters an
operation rounded to float32, as PyTorch rounds a Python float scalar into a float32 tensor
operation. The order follows torch.optim's single-tensor implementations (``foreach=False``),
so the two agree to within float32 rounding where PyTorch's vectorised kernels fuse a
multiply and an add (tests/protocol/test_optim.py measures how far).

SGD (torch.optim.SGD, ``maximize=False``), step t = 1, 2, ...::

    g = grad                          ; g = g + wd * p          (weight decay, if wd != 0)
    b = g (t == 1)  |  b = mu * b + (1 - dampening) * g          (if mu != 0)
    g = g + mu * b (nesterov)  |  g = b                          (if mu != 0)
    p = p - lr * g

Adam and AdamW (torch.optim.Adam / AdamW, ``amsgrad=False``)::

    p = p * (1 - lr * wd)             (AdamW: decoupled weight decay, if wd != 0)
    g = g + wd * p                    (Adam: weight decay into the gradient, if wd != 0)
    m = m + (1 - b1) * (g - m)        (torch's lerp for a weight under 0.5)
    v = v * b2 + ((1 - b2) * g) * g
    c1 = 1 - b1 ** t ; c2 = 1 - b2 ** t ; s = lr / c1 ; r = sqrt(c2)   (float64, from the step)
    p = p + (-s) * (m / (sqrt(v) / r + eps))

The step counter t is the NIC's own (one per chunk, in the descriptor's step table): an UPDATE
names its step, and the NIC applies only the one after the chunk's last, so the bias
corrections follow the NIC's count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from netdam.protocol.constants import DType, OptFlags, OptRule
from netdam.protocol.elements import bf16_values
from netdam.protocol.payloads import OptimizerDescriptor

__all__ = ["AdamRule", "SgdRule", "adam_step", "descriptor_for", "gradient_values", "sgd_step"]

F32 = np.float32


@dataclass(frozen=True)
class SgdRule:
    """SGD with momentum, dampening, weight decay and Nesterov (torch.optim.SGD's defaults)."""

    lr: float
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise ValueError("Nesterov momentum needs a momentum and zero dampening")


@dataclass(frozen=True)
class AdamRule:
    """Adam, or AdamW with ``decoupled=True`` (torch.optim.Adam / AdamW's defaults)."""

    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    decoupled: bool = False

    def __post_init__(self) -> None:
        if not (0.0 <= self.beta1 < 1.0 and 0.0 <= self.beta2 < 1.0):
            raise ValueError(f"betas must be in [0, 1), got {self.beta1}, {self.beta2}")


def gradient_values(grad: np.ndarray[Any, Any], dtype: DType) -> np.ndarray[Any, Any]:
    """A gradient's elements as float32, exactly: float32 as is, float16 and bf16 widened."""
    if dtype == DType.F32:
        return np.asarray(grad, dtype=F32)
    if dtype == DType.F16:
        return np.asarray(grad, dtype=np.float16).astype(F32)
    if dtype == DType.BF16:
        widened: np.ndarray[Any, Any] = bf16_values(np.asarray(grad).view(np.uint16))
        return widened
    raise ValueError(f"a gradient is f32, f16 or bf16, not {dtype.name}")


def _f32(value: float) -> np.float32:
    rounded: np.float32 = np.float32(value)
    return rounded


def _check(p: np.ndarray[Any, Any], *state: np.ndarray[Any, Any]) -> None:
    for array in (p, *state):
        if array.dtype != F32 or array.shape != p.shape:
            raise ValueError("masters and optimizer state are float32 arrays of one shape")


def sgd_step(
    p: np.ndarray[Any, Any],
    grad: np.ndarray[Any, Any],
    buf: np.ndarray[Any, Any],
    step: int,
    rule: SgdRule,
) -> None:
    """One SGD step on masters *p* with momentum buffer *buf*, both in place; *step* from 1."""
    _check(p, buf)
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    g = np.asarray(grad, dtype=F32).copy()
    if rule.weight_decay != 0:
        g = g + _f32(rule.weight_decay) * p
    if rule.momentum != 0:
        if step == 1:
            buf[...] = g
        else:
            buf[...] = _f32(rule.momentum) * buf + _f32(1.0 - rule.dampening) * g
        g = g + _f32(rule.momentum) * buf if rule.nesterov else buf.copy()
    p[...] = p - _f32(rule.lr) * g


def adam_step(
    p: np.ndarray[Any, Any],
    grad: np.ndarray[Any, Any],
    m: np.ndarray[Any, Any],
    v: np.ndarray[Any, Any],
    step: int,
    rule: AdamRule,
) -> None:
    """One Adam (AdamW) step on masters *p* and moments *m*, *v*, all in place; *step* from 1."""
    _check(p, m, v)
    if step < 1:
        raise ValueError(f"steps count from 1, got {step}")
    g = np.asarray(grad, dtype=F32).copy()
    if rule.weight_decay != 0:
        if rule.decoupled:
            p[...] = p * _f32(1.0 - rule.lr * rule.weight_decay)
        else:
            g = g + _f32(rule.weight_decay) * p
    m[...] = m + _f32(1.0 - rule.beta1) * (g - m)
    v[...] = v * _f32(rule.beta2) + (_f32(1.0 - rule.beta2) * g) * g
    c1 = 1.0 - rule.beta1**step
    c2 = 1.0 - rule.beta2**step
    step_size = rule.lr / c1
    denom = np.sqrt(v) / _f32(math.sqrt(c2)) + _f32(rule.eps)
    p[...] = p + _f32(-step_size) * (m / denom)


def descriptor_for(
    rule: SgdRule | AdamRule, count: int, chunk: int, params: int
) -> OptimizerDescriptor:
    """The optimizer descriptor (SPEC.md 6.8) of *rule* over *count* masters at offset *params*
    from it, followed by the first moment, the second and the step table (each moment
    allocated whether the rule keeps it or not: 12 bytes a parameter, then 4 a chunk)."""
    m1, m2, steps = params + 4 * count, params + 8 * count, params + 12 * count
    if isinstance(rule, SgdRule):
        return OptimizerDescriptor(
            OptRule.SGD,
            count,
            chunk,
            params,
            m1 if rule.momentum else 0,
            0,
            steps,
            rule.lr,
            rule.momentum,
            rule.dampening,
            rule.weight_decay,
            flags=OptFlags.NESTEROV if rule.nesterov else OptFlags(0),
        )
    return OptimizerDescriptor(
        OptRule.ADAMW if rule.decoupled else OptRule.ADAM,
        count,
        chunk,
        params,
        m1,
        m2,
        steps,
        rule.lr,
        rule.beta1,
        rule.beta2,
        rule.weight_decay,
        rule.eps,
    )
