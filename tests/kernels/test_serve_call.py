"""The node's compiled serve called without numba's type dispatch (netdam.kernels.serve.ServeCall)
while its arguments are the objects it typed, and through the dispatcher, which refuses a
mismatch, the moment one is not; the owners' bundles stay the same objects until an array in
them is replaced (netdam.kernels.state.Kept)."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from netdam.kernels import serve
from netdam.kernels.state import Kept, Regions, TxQueue
from netdam.shell.node_process import NodeProcess, NodeProcessConfig


class _CountingDispatcher:
    """Stands in for serve._serve: counts the calls that go through numba's dispatcher."""

    def __init__(self, real: Any) -> None:
        self.real, self.calls = real, 0
        self.overloads = real.overloads

    def __call__(self, *args: object) -> tuple[int, int]:
        self.calls += 1
        result: tuple[int, int] = self.real(*args)
        return result


@pytest.fixture
def nic(tmp_path: Path) -> Any:
    process = NodeProcess(
        NodeProcessConfig(memory_bytes=1 << 20, bind=("127.0.0.1", 0), shm_dir=tmp_path)
    )
    yield process
    process.close()


def test_kept_makes_a_bundle_again_only_when_a_part_is_another_object() -> None:
    kept: Kept[TxQueue] = Kept()
    a, b, c, d = (np.zeros(4, np.uint8), np.zeros(2), np.zeros(1), np.zeros(1))
    first = kept.of(TxQueue, a, b, c, d)
    assert kept.of(TxQueue, a, b, c, d) is first
    replaced = kept.of(TxQueue, a, b, c, np.zeros(1))  # equal contents, another array
    assert replaced is not first and replaced[3] is not d
    assert kept.of(TxQueue, a, b, c, replaced[3]) is replaced


def test_the_owners_hand_out_the_same_bundles_until_an_array_is_replaced(nic: Any) -> None:
    core = nic.core
    state, tx = core.node_state(), core.tx_bundle()
    assert core.node_state() is state and core.tx_bundle() is tx
    assert core.collective.state() is state.coll
    core.set_members([("127.0.0.1", 9), nic.endpoint])  # replaces the members array
    moved = core.node_state()
    assert moved is not state and moved.members is not state.members
    assert moved.regions is state.regions  # the unchanged parts are the same bundles
    core.reserve(8 * tx.len.shape[0])  # the send queue grows: new arrays
    assert core.tx_bundle() is not tx


def test_same_arguments_skip_the_dispatcher_and_a_mismatch_is_refused(
    nic: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    counting = _CountingDispatcher(serve._serve)
    monkeypatch.setattr(serve, "_serve", counting)
    call = serve.ServeCall()
    core = nic.core
    for _ in range(50):
        assert call(nic.serve_args(0, 1)) == (serve.RETURN_IDLE, 0)
    assert counting.calls == 1  # typed once, then straight to the compiled entry point
    assert all(map(operator.is_, nic.serve_args(0, 1), nic.serve_args(0, 1)))
    io, rx, faults, _, guard, tx, txq, punt = nic.serve_args(0, 1)
    # A NodeState whose rkey table has the wrong dtype: a new object, so it goes through the
    # dispatcher, which has no such signature and refuses it (the entry point would have read
    # the uint64 keys as uint32).
    state = core.node_state()
    wrong = state._replace(regions=Regions(*(np.zeros(r.shape, np.uint64) for r in state.regions)))
    with pytest.raises(TypeError, match="No matching definition"):
        call((io, rx, faults, wrong, guard, tx, txq, punt))
    assert counting.calls == 2
    # A refused call changes nothing: the arguments typed before are still known.
    assert call(nic.serve_args(0, 1)) == (serve.RETURN_IDLE, 0)
    assert counting.calls == 2
    # The bounds are checked on every call, dispatched or not.
    txq[1] = tx.len.shape[0]
    with pytest.raises(ValueError, match="send queue"):
        call(nic.serve_args(0, 1))
    txq[1] = 0
