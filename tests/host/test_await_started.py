"""Chained collectives that await their members' STARTEDs (descriptor flags bit 2, SPEC.md 4.1
"STARTED"), as the host API asks for them: when a member that starts late could not hold what
the others send it early (netdam.api._awaits_started), and for every chained step of a torus."""

from __future__ import annotations

import time

import numpy as np
import pytest

from netdam import api
from netdam.api import ProcessGroup
from netdam.cluster.clusterfile import ClusterFile
from netdam.cluster.control import ControlClient
from netdam.cluster.launch import start_cluster
from netdam.kernels import collective as kernels
from netdam.protocol import counters as C
from netdam.protocol.constants import DType, Status
from netdam.protocol.payloads import FLAG_AWAIT_STARTED, unpack_descriptor

#: 4 ranks of 131,072 float32 (512 KiB): blocks of 17 chunks at MTU 9000, 68 early chains for
#: a member that starts late, past the 64 a node holds: the host asks the chains to await.
WORLD, COUNT = 4, 4 * 32_768


def _busy_and_resent(info: ClusterFile) -> tuple[int, int]:
    with ControlClient.for_cluster(info) as client:
        counts = [client.counters(node.control_endpoint) for node in info.nodes]
    busy = sum(int(c[C.NACK_BASE + Status.BUSY]) for c in counts)
    return busy, sum(int(c[C.RETRANSMITS]) for c in counts)


def test_the_host_asks_chains_to_await_where_a_late_member_could_not_hold_them() -> None:
    """The rule: chains await when a late member would be sent more early chains than the
    shipped node holds (EARLY_CHAINS_HELD, its EARLY_SLOTS): one per chunk of each block."""
    assert api.EARLY_CHAINS_HELD == kernels.EARLY_SLOTS
    f32 = DType.F32
    assert not api._awaits_started(4, 1024, f32, 9000)  # 4 x 4 KiB: one chunk a block
    assert not api._awaits_started(8, 16_384, f32, 9000)  # 8 x 64 KiB: 2 chunks a block
    assert not api._awaits_started(16, 65_536, f32, 9000)  # 16 x 256 KiB: 16 x 2 chunks
    assert api._awaits_started(16, 262_144, f32, 9000)  # 16 x 1 MiB: 16 x 8 chunks
    assert api._awaits_started(64, 1024, f32, 9000)  # 64 members: one early chain each is 64
    assert api._awaits_started(WORLD, COUNT, f32, 9000)
    assert not api._awaits_started(1, 1 << 20, f32, 9000)


@pytest.mark.parametrize("awaiting", [True, False], ids=["awaiting", "eager"])
def test_a_member_starting_late_is_sent_no_chain_before_it_runs(
    awaiting: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real node processes: ranks 0-2 start a 4 x 512 KiB all-reduce, rank 3 ten times the
    5 ms a node holds early chains later. Awaiting STARTEDs, no chain meets rank 3's node
    before it runs: nothing is answered BUSY, nothing re-sent, and every rank holds the exact
    sum. The control: the same start, eager (the host not asking), is answered BUSY."""
    if not awaiting:
        monkeypatch.setattr(api, "_awaits_started", lambda *_: False)
    rng = np.random.default_rng(7)
    inputs = [rng.integers(-1000, 1000, COUNT).astype(np.float32) for _ in range(WORLD)]
    expected = np.sum(inputs, axis=0, dtype=np.float32)  # integers: exact in any order
    with start_cluster(WORLD, memory=8 << 20) as cluster:
        groups = [ProcessGroup(cluster.info, rank) for rank in range(WORLD)]
        try:
            warm = [np.ones(COUNT, np.float32) for _ in range(WORLD)]  # every group settled
            for work in [api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups, warm)]:
                assert work is not None
                work.wait()
            before = _busy_and_resent(cluster.info)
            buffers = [x.copy() for x in inputs]
            works = [
                api.all_reduce(b, group=g, async_op=True) for g, b in zip(groups[:-1], buffers[:-1])
            ]
            time.sleep(10 * kernels.EARLY_HOLD_S)
            works.append(api.all_reduce(buffers[-1], group=groups[-1], async_op=True))
            flags = [unpack_descriptor(w.packet.payload).flags for w in works if w is not None]
            for work in works:
                assert work is not None
                work.wait()
            busy, resent = (a - b for a, b in zip(_busy_and_resent(cluster.info), before))
        finally:
            for group in groups:
                group.close()
    assert all(b.tobytes() == expected.tobytes() for b in buffers)
    assert all(bool(f & FLAG_AWAIT_STARTED) == awaiting for f in flags), flags
    if awaiting:
        assert (busy, resent) == (0, 0)
    else:
        assert busy > 0
