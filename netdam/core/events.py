"""Events a core hands to its owner (aioquic ``events.py`` style): small frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field

from netdam.protocol.packet import Endpoint, Packet


@dataclass(frozen=True)
class Event:
    """Base class of every core event."""


@dataclass(frozen=True)
class ReplyReceived(Event):
    """A reply (ACK, NACK, READ_RESP, INFO) addressed to this core."""

    packet: Packet
    #: Who sent it.
    src: Endpoint


@dataclass(frozen=True)
class GroupJoined(Event):
    """The control plane asked this node to join a multicast group. The I/O shell subscribes,
    then answers the JOIN with ``NodeCore.answer_join``: only the shell knows whether the
    group's port could be bound (another socket of the machine may hold it)."""

    group: Endpoint
    #: The JOIN, its sender and the key its answer is sealed under (the admin tag key when
    #: its control tag proved it, SPEC.md 2.6), for ``answer_join``.
    request: Packet
    src: int
    seal_key: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class GroupLeft(Event):
    """The node left a multicast group."""

    group: Endpoint


@dataclass(frozen=True)
class CollectiveStartRequested(Event):
    """START_COLL arrived: the collective engine takes it from here."""

    packet: Packet
    src: Endpoint


@dataclass(frozen=True)
class RegionRegistered(Event):
    """A region became reachable under *rkey*."""

    rkey: int
    base: int
    size: int
    rights: int


@dataclass(frozen=True)
class RegionDeregistered(Event):
    """*rkey* no longer grants anything."""

    rkey: int
