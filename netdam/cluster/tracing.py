"""Reading the NICs' trace rings of a running cluster (SPEC.md 6.7) for a timeline
(netdam.core.timeline): where each ring stands, every record written since, the file."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from netdam.cluster.clusterfile import ClusterFile
from netdam.cluster.control import ControlClient
from netdam.core.timeline import NicTrace, TracedNic
from netdam.protocol.trace import TRACE_DTYPE

#: Pages one NIC is read for at most per collect (170 records each: the whole default ring).
_MAX_PAGES = 400


def nics_of(info: ClusterFile) -> list[TracedNic]:
    """The cluster file's NICs in rank order."""
    return [TracedNic(n.rank, (n.address, n.port), n.control_endpoint) for n in info.nodes]


def mark(client: ControlClient, nics: Sequence[TracedNic]) -> dict[int, int]:
    """Records each NIC has written so far (where a trace of what follows starts)."""
    return {nic.rank: client.trace_page(nic.control, 1 << 62).written for nic in nics}


class TraceReader:
    """Reads the records NICs write from their marks on, as often as ``poll`` is called (a
    running cluster's trace polls often enough that no ring turns over between two polls)."""

    def __init__(
        self, client: ControlClient, nics: Sequence[TracedNic], since: dict[int, int]
    ) -> None:
        self.client = client
        self.nics = list(nics)
        self._next = {nic.rank: since.get(nic.rank, 0) for nic in self.nics}
        self._pages: dict[int, list[np.ndarray]] = {nic.rank: [] for nic in self.nics}
        self._lost = dict.fromkeys(self._next, 0)
        self._off = dict.fromkeys(self._next, False)

    def poll(self) -> int:
        """Read every record written since the last poll; returns how many."""
        got = 0
        for nic in self.nics:
            first = self._next[nic.rank]
            page = self.client.trace_page(nic.control, first)
            end = page.written  # what was written when this poll began: it stops there
            self._off[nic.rank] = page.slots == 0
            for _ in range(_MAX_PAGES):
                self._lost[nic.rank] += max(page.first - first, 0)
                self._pages[nic.rank].append(page.records)
                got += len(page.records)
                first = page.first + len(page.records)
                if first >= end or len(page.records) == 0:
                    break
                page = self.client.trace_page(nic.control, first)
            self._next[nic.rank] = first
        return got

    def take(self) -> list[NicTrace]:
        """What was read since the last take (or the start), per NIC; forgets it."""
        taken = self.traces()
        for nic in self.nics:
            self._pages[nic.rank] = []
            self._lost[nic.rank] = 0
        return taken

    def traces(self) -> list[NicTrace]:
        """What was read so far, per NIC."""
        return [
            NicTrace(
                nic,
                np.concatenate(self._pages[nic.rank])
                if self._pages[nic.rank]
                else np.zeros(0, TRACE_DTYPE),
                self._lost[nic.rank],
                self._off[nic.rank],
            )
            for nic in self.nics
        ]


def collect(
    client: ControlClient, nics: Sequence[TracedNic], since: dict[int, int]
) -> list[NicTrace]:
    """Every record each NIC wrote from its mark in *since* up to now."""
    reader = TraceReader(client, nics, since)
    reader.poll()
    return reader.traces()


def write_trace(path: Path, trace: dict[str, Any]) -> None:
    """The trace as JSON (compact: a large run's records are many)."""
    path.write_text(json.dumps(trace, separators=(",", ":")))
