"""Calls between our kernels compile once per argument type, not once per constant value
(netdam/kernels/dispatch.py): what took a third of a cold compile."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from numba import njit

import netdam.kernels  # noqa: F401  (installs the dispatch hook, as every kernel import does)


def _jitted_in(module: str) -> tuple[Any, Any]:
    """A helper and a caller passing it three different constants, as if defined in *module*."""

    def helper(a: int, b: int) -> int:
        return a + b

    helper.__module__ = module
    jitted_helper = njit(helper)

    def caller(x: int) -> int:
        return jitted_helper(x, 1) + jitted_helper(x, 2) + jitted_helper(x, 3)

    caller.__module__ = module
    return jitted_helper, njit(caller)


def _specializations(make: Callable[[str], tuple[Any, Any]], module: str) -> int:
    helper, caller = make(module)
    assert caller(1) == 9
    return len(helper.signatures)


def test_a_kernel_helper_called_with_three_constants_compiles_once() -> None:
    assert _specializations(_jitted_in, "netdam.kernels.probe") == 1


def test_numba_alone_would_compile_one_per_constant() -> None:
    """The control: outside the package numba keeps literal dispatch (a numba that stops doing
    it makes the hook moot, and this test says so)."""
    assert _specializations(_jitted_in, "somewhere.else") == 3
