"""Fault injection per switch link and direction (protocol/SPEC.md 11.6 "Fault injection").

Links are the switch's ports: ``client`` (port 0: every endpoint that is not a cluster node) and
``node<R>`` (port 1 + R). Directions: ``rx`` (into the switch from that link) and ``tx`` (out of
the switch onto it). Decisions are ``fault_hash(seed, src, dst, packet id, attempt)`` like the
nodes' (BRIEF section 7), so a seeded run replays; "drop the k-th packet of opcode X" counts
packets of that opcode per link and direction in arrival order (deterministic for one stream).

Text form (``--faults`` of ``netdam switch``), entries separated by ``;``::

    node0:tx:loss=0.1,dup=0.05;client:rx:kth=FETCH_ADD@3,delay=0.2,delay_ms=5
"""

from __future__ import annotations

from netdam.core.faults import FaultSpec
from netdam.protocol.constants import Opcode

DIRECTIONS = {"rx": 0, "tx": 1}


def link_port(link: str, nodes: int) -> int:
    """Port index of a link name: ``client`` -> 0, ``node<R>`` -> 1 + R."""
    if link == "client":
        return 0
    if link.startswith("node") and link[4:].isdigit() and int(link[4:]) < nodes:
        return 1 + int(link[4:])
    raise ValueError(f"unknown link {link!r}: use client or node0..node{nodes - 1}")


def parse_link_spec(text: str) -> FaultSpec:
    """``loss=0.1,dup=0.05,reorder=0.1,delay=0.2,delay_ms=5,kth=FETCH_ADD@3``."""
    values: dict[str, float | int] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(
                f"fault {part!r} needs KEY=VALUE (loss, dup, reorder, delay, delay_ms, kth)"
            )
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
            raise ValueError(
                f"unknown fault {key!r}: use loss, dup, reorder, delay, delay_ms or kth"
            )
    return FaultSpec(**values)  # type: ignore[arg-type]  # values: the parsed fields by name, each of its field's type


def parse_faults(text: str, nodes: int) -> list[tuple[int, int, FaultSpec]]:
    """``LINK:DIR:SPEC;...`` -> [(port, direction, spec)]."""
    result = []
    for entry in filter(None, (e.strip() for e in text.split(";"))):
        parts = entry.split(":", 2)
        if len(parts) != 3 or parts[1] not in DIRECTIONS:
            raise ValueError(
                f"fault entry {entry!r}: write LINK:rx|tx:SPEC, e.g. node0:tx:loss=0.1"
            )
        result.append((link_port(parts[0], nodes), DIRECTIONS[parts[1]], parse_link_spec(parts[2])))
    return result
