"""The optimizer update rules' reference (protocol/optim.py): properties that follow from the
rules themselves, the gradient types, and the distance to torch.optim's single-tensor
implementations (where PyTorch is installed)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from netdam.protocol.constants import DType
from netdam.protocol.elements import bf16_round
from netdam.protocol.optim import AdamRule, SgdRule, adam_step, gradient_values, sgd_step

N = 4099
#: The stated bound: after 30 steps a master differs from torch.optim's by at most 2^-16 of
#: max(|p|, lr). Measured on this machine (PyTorch 2.13, CPU): 1.3-8.3e-6 of it, 2.1-14 x
#: 2^-24 per step; the difference is PyTorch's vectorised fused multiply-adds (one rounding
#: where the rule has two), which accumulate through the momentum and moments.
TORCH_BOUND = 2.0**-16


def _run(rule: SgdRule | AdamRule, grads: list[np.ndarray], p: np.ndarray) -> np.ndarray:
    p = p.copy()
    s1, s2 = np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if isinstance(rule, SgdRule):
            sgd_step(p, g, s1, t, rule)
        else:
            adam_step(p, g, s1, s2, t, rule)
    return p


def test_first_sgd_step_takes_the_gradient_as_momentum() -> None:
    """torch's first step: the buffer is the gradient itself, whatever the dampening."""
    rng = np.random.default_rng(1)
    p = rng.standard_normal(N).astype(np.float32)
    g = rng.standard_normal(N).astype(np.float32)
    buf = np.zeros_like(p)
    q = p.copy()
    sgd_step(q, g, buf, 1, SgdRule(lr=0.1, momentum=0.9, dampening=0.5))
    assert buf.tobytes() == g.tobytes()
    assert q.tobytes() == (p - np.float32(0.1) * g).tobytes()
    # The second step dampens.
    sgd_step(q, g, buf, 2, SgdRule(lr=0.1, momentum=0.9, dampening=0.5))
    assert buf.tobytes() == (np.float32(0.9) * g + np.float32(0.5) * g).tobytes()


def test_first_adam_step_moves_each_master_by_lr_against_its_gradient() -> None:
    """Bias correction makes Adam's first step lr * g / (|g| + eps'), about lr * sign(g)."""
    rng = np.random.default_rng(2)
    p = rng.standard_normal(N).astype(np.float32)
    g = rng.standard_normal(N).astype(np.float32)
    m, v = np.zeros_like(p), np.zeros_like(p)
    q = p.copy()
    adam_step(q, g, m, v, 1, AdamRule(lr=1e-3))
    moved = (q - p).astype(np.float64)
    np.testing.assert_allclose(moved, -1e-3 * np.sign(g), rtol=1e-3, atol=1e-6)
    # AdamW decays the masters before the step, Adam adds the decay to the gradient.
    decayed = p.copy()
    adam_step(decayed, np.zeros_like(g), np.zeros_like(p), np.zeros_like(p), 1,
              AdamRule(lr=0.1, weight_decay=0.5, decoupled=True))  # fmt: skip
    assert decayed.tobytes() == (p * np.float32(1 - 0.1 * 0.5)).tobytes()


def test_gradients_widen_exactly() -> None:
    values = np.array([0.5, -3.25, 1e-3, 65504.0], np.float32)
    assert gradient_values(values.astype(np.float16), DType.F16).tolist() == [
        float(x) for x in values.astype(np.float16)
    ]
    bf16 = bf16_round(values)
    widened = gradient_values(bf16, DType.BF16)
    assert widened.dtype == np.float32
    assert (widened.view(np.uint32) >> 16).astype(np.uint16).tolist() == bf16.tolist()
    with pytest.raises(ValueError, match="f32, f16 or bf16"):
        gradient_values(values, DType.I32)


def test_bad_steps_and_rules_are_refused() -> None:
    p = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="steps count from 1"):
        sgd_step(p, p, p.copy(), 0, SgdRule(lr=0.1))
    with pytest.raises(ValueError, match="float32 arrays of one shape"):
        adam_step(p, p, np.zeros(3, np.float32), p.copy(), 1, AdamRule())
    with pytest.raises(ValueError, match="Nesterov"):
        SgdRule(lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="betas"):
        AdamRule(beta1=1.0)


def _torch_cases() -> list[tuple[str, SgdRule | AdamRule, Callable[[Any], Any]]]:
    return [
        ("sgd", SgdRule(lr=0.01), lambda torch: (torch.optim.SGD, {"lr": 0.01})),
        (
            "sgd momentum, weight decay",
            SgdRule(lr=0.01, momentum=0.9, weight_decay=1e-4),
            lambda torch: (torch.optim.SGD, {"lr": 0.01, "momentum": 0.9, "weight_decay": 1e-4}),
        ),
        (
            "sgd nesterov",
            SgdRule(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
            lambda torch: (
                torch.optim.SGD,
                {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
            ),
        ),
        ("adam", AdamRule(lr=1e-3), lambda torch: (torch.optim.Adam, {"lr": 1e-3})),
        (
            "adam weight decay",
            AdamRule(lr=1e-3, weight_decay=1e-2),
            lambda torch: (torch.optim.Adam, {"lr": 1e-3, "weight_decay": 1e-2}),
        ),
        (
            "adamw",
            AdamRule(lr=1e-3, weight_decay=1e-2, decoupled=True),
            lambda torch: (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2}),
        ),
    ]


@pytest.mark.parametrize(
    ("name", "rule", "make"), _torch_cases(), ids=[c[0] for c in _torch_cases()]
)
def test_within_the_stated_bound_of_torch_optim(
    name: str, rule: SgdRule | AdamRule, make: Callable[[Any], Any]
) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    p0 = rng.standard_normal(N).astype(np.float32)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(30)]
    ours = _run(rule, grads, p0)
    param = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    kind, kwargs = make(torch)
    optimizer = kind([param], foreach=False, **kwargs)
    for g in grads:
        param.grad = torch.from_numpy(g.copy())
        optimizer.step()
    theirs = param.detach().numpy()
    scale = np.maximum(np.abs(theirs).astype(np.float64), rule.lr)
    worst = float((np.abs(ours.astype(np.float64) - theirs) / scale).max())
    assert worst <= TORCH_BOUND, (name, worst)
