"""Fault injection per switch link and direction (switch/SPEC_SWITCH.md "Fault injection").

Links are the switch's ports: ``client`` (port 0: every endpoint that is not a cluster node) and
``node<R>`` (port 1 + R). Directions: ``rx`` (into the switch from that link) and ``tx`` (out of
the switch onto it). Decisions are ``_fault_hash(seed, src, dst, packet id, attempt)`` like the
nodes' (BRIEF section 7), so a seeded run replays; "drop the k-th packet of opcode X" counts
packets of that opcode per link and direction in arrival order (deterministic for one stream).

Text form (``--faults`` of ``netdam switch``), entries separated by ``;``::

    node0:tx:loss=0.1,dup=0.05;client:rx:kth=FETCH_ADD@3,delay=0.2,delay_ms=5
"""

from __future__ import annotations

from dataclasses import dataclass

from netdam.protocol.constants import Opcode

DIRECTIONS = {"rx": 0, "tx": 1}


@dataclass(frozen=True)
class LinkFaultSpec:
    """Faults on one link direction: probabilities per datagram, and one k-th-packet drop."""

    loss: float = 0.0
    dup: float = 0.0
    reorder: float = 0.0
    delay: float = 0.0
    delay_s: float = 0.0
    #: Drop the kth_k-th packet (1-based) of this opcode on the link direction (0: off).
    kth_opcode: int = 0
    kth_k: int = 0

    def __post_init__(self) -> None:
        for name in ("loss", "dup", "reorder", "delay"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name}={value} is not a probability between 0 and 1")
        if self.delay_s < 0:
            raise ValueError(f"delay_ms must be >= 0, got {self.delay_s * 1000}")
        if self.kth_k < 0 or not 0 <= self.kth_opcode < 64:
            raise ValueError("kth needs OPCODE@K with K >= 1, e.g. kth=FETCH_ADD@3")

    @property
    def random_active(self) -> bool:
        return bool(self.loss or self.dup or self.reorder or (self.delay and self.delay_s))

    @property
    def active(self) -> bool:
        return self.random_active or self.kth_k > 0


def link_port(link: str, nodes: int) -> int:
    """Port index of a link name: ``client`` -> 0, ``node<R>`` -> 1 + R."""
    if link == "client":
        return 0
    if link.startswith("node") and link[4:].isdigit() and int(link[4:]) < nodes:
        return 1 + int(link[4:])
    raise ValueError(f"unknown link {link!r}: use client or node0..node{nodes - 1}")


def parse_link_spec(text: str) -> LinkFaultSpec:
    """``loss=0.1,dup=0.05,reorder=0.1,delay=0.2,delay_ms=5,kth=FETCH_ADD@3``."""
    values: dict[str, float | int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"fault {part!r} needs KEY=VALUE (loss, dup, reorder, delay, delay_ms, kth)")
        if key in ("loss", "dup", "reorder", "delay"):
            values[key] = float(value)
        elif key == "delay_ms":
            values["delay_s"] = float(value) / 1000.0
        elif key == "kth":
            name, at, k = value.partition("@")
            if not at or not k.isdigit() or int(k) < 1 or name.upper() not in Opcode.__members__:
                raise ValueError(f"kth={value!r}: write OPCODE@K with K >= 1, e.g. kth=FETCH_ADD@3")
            values["kth_opcode"] = int(Opcode[name.upper()])
            values["kth_k"] = int(k)
        else:
            raise ValueError(f"unknown fault {key!r}: use loss, dup, reorder, delay, delay_ms or kth")
    return LinkFaultSpec(**values)  # type: ignore[arg-type]


def parse_faults(text: str, nodes: int) -> list[tuple[int, int, LinkFaultSpec]]:
    """``LINK:DIR:SPEC;...`` -> [(port, direction, spec)]."""
    result = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        parts = entry.split(":", 2)
        if len(parts) != 3 or parts[1] not in DIRECTIONS:
            raise ValueError(f"fault entry {entry!r}: write LINK:rx|tx:SPEC, e.g. node0:tx:loss=0.1")
        result.append((link_port(parts[0], nodes), DIRECTIONS[parts[1]], parse_link_spec(parts[2])))
    return result
