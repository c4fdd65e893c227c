"""Error hierarchy, split by blame (h11 style) and carrying the wire status (aioquic style).

``LocalProtocolError``: the caller asked for something illegal (encode a 9000-byte payload).
``RemoteProtocolError``: a peer sent bytes that break the contract; ``status`` is the NACK code a
node answers with.
"""

from __future__ import annotations

from netdam.protocol.constants import Status


class NetdamError(Exception):
    """Root of every error this package raises on purpose."""


class ProtocolError(NetdamError, ValueError):
    """A packet breaks protocol/SPEC.md."""

    def __init__(self, status: Status, message: str) -> None:
        super().__init__(message)
        self.status = status


class LocalProtocolError(ProtocolError):
    """We were asked to build a packet SPEC.md does not allow."""


class RemoteProtocolError(ProtocolError):
    """Bytes received from a peer break SPEC.md; ``status`` is what a node NACKs with."""
