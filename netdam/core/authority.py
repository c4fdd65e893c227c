"""Who may send a control opcode (SPEC.md 2.6 "Control tags", 8 and 12): the one decision the
node's and the switch's control planes share.

A process given the cluster's 128-bit admin tag key (every node and switch that ``netdam up``
or a launcher starts) takes a control opcode as the admin's only when it carries its control
tag under that key: the 32-bit admin key, which travels in ``rkey``, proves nothing there. A
process without one (a bare core, a node started by hand with only ``--admin-key-file``) takes
the admin key in ``rkey``, as SPEC v1 did. Sans-I/O: bytes in, a verdict out.
"""

from __future__ import annotations

from enum import Enum

from netdam.kernels.tag import verify_control_bytes
from netdam.protocol.constants import Flags
from netdam.protocol.packet import Packet


class ControlProof(Enum):
    """What a control datagram proves about its sender."""

    #: Its control tag verifies under the admin tag key: the admin (answers are sealed).
    TAG = "tag"
    #: The admin key in ``rkey``, at a process without an admin tag key (v1).
    KEY = "key"
    #: No claim: ``rkey`` 0 and no tag (a pool tenant, whose credential is in the payload).
    NONE = "none"
    #: A wrong admin key, or the admin key alone where the tag is required: UNAUTHORIZED,
    #: counted toward the sender's lockout.
    REFUSED = "refused"
    #: TAGGED with a wrong control tag: dropped and counted (``drop_control_forged``).
    FORGED = "forged"


def control_authority(
    admin_key: int, admin_tag_key: bytes, packet: Packet, data: bytes
) -> ControlProof:
    """The proof *packet* (decoded from *data*, its trailer included) carries."""
    if packet.flags & Flags.TAGGED:
        if not admin_tag_key:
            return ControlProof.REFUSED
        return (
            ControlProof.TAG if verify_control_bytes(admin_tag_key, data) else ControlProof.FORGED
        )
    if packet.rkey == 0:
        return ControlProof.NONE
    if not admin_tag_key and packet.rkey == admin_key:
        return ControlProof.KEY
    return ControlProof.REFUSED


def refusal_text(admin_tag_key: bytes) -> bytes:
    """The UTF-8 text of an UNAUTHORIZED to a control opcode (none in v1, where only the key
    can be wrong; at most 128 bytes, within the 3x bound of SPEC.md 12.4)."""
    if not admin_tag_key:
        return b""
    return b"the admin key alone is refused here: seal control opcodes under the admin tag key (SPEC 2.6)"
