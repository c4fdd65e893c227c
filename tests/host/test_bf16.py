"""bf16 in the NICs (issue 25): SPEC.md 2.4's rule for bfloat16, its numpy statement
(``netdam.protocol.elements``) checked by hand and against PyTorch, the compiled combine checked
bit for bit against it, and a node's ADD and chains carrying dtype 7. Collectives of bf16 and
f16 on real nodes are in test_api.py."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import CLIENT, RKEY, Cluster, only

from netdam import api
from netdam.kernels.combine import DTYPE_BF16, combine
from netdam.protocol.constants import DType, Flags, Opcode, ReduceOp, Status
from netdam.protocol.elements import (
    BFLOAT16,
    bf16_combine,
    bf16_round,
    bf16_values,
    element_values,
    is_bf16,
)
from netdam.protocol.layout import H_DTYPE
from netdam.protocol.packet import Packet, decode_packet, encode_packet

SUM, MIN, MAX = int(ReduceOp.SUM), int(ReduceOp.MIN), int(ReduceOp.MAX)

#: Patterns at the edges of the format: zeros, the smallest subnormal, the largest finite,
#: infinities, a quiet and a signalling NaN of each sign, the smallest normal, and 1.0.
SPECIAL = np.array(
    [
        0x0000,
        0x8000,
        0x0001,
        0x8001,
        0x7F7F,
        0xFF7F,
        0x7F80,
        0xFF80,
        0x7FC0,
        0xFFC1,
        0x7F81,
        0xFF81,
        0x0080,
        0x8080,
        0x3F80,
        0xBF80,
    ],
    np.uint16,
)


def bits(*values: int) -> np.ndarray:
    return np.array(values, np.uint16)


def test_the_rule_by_hand() -> None:
    """The cases SPEC.md 2.4 names, computed by hand."""
    # 1.0 + 2^-8 is halfway between 0x3F80 and 0x3F81: ties to even keep 0x3F80; 1.0 + 3 * 2^-8
    # is halfway between 0x3F81 and 0x3F82: up to the even 0x3F82.
    assert bf16_combine(bits(0x3F80, 0x3F80), bits(0x3B80, 0x3C40), SUM).tolist() == [
        0x3F80,
        0x3F82,
    ]
    # The largest finite doubled overflows to infinity; inf - inf and any NaN give 0x7FC0.
    assert bf16_combine(
        bits(0x7F7F, 0x7F80, 0xFFC1, 0x3F80), bits(0x7F7F, 0xFF80, 0x3F80, 0x7F81), SUM
    ).tolist() == [0x7F80, 0x7FC0, 0x7FC0, 0x7FC0]
    # Subnormals add exactly (bf16 has f32's exponent range): 1 + 1 quanta = 2 quanta.
    assert bf16_combine(bits(0x0001), bits(0x0001), SUM).tolist() == [0x0002]
    # MIN/MAX return an operand's bits unchanged: ties keep a, a NaN in a wins, a NaN in b wins
    # over a number.
    assert bf16_combine(
        bits(0x0000, 0x8000, 0x7FC5, 0x3F80), bits(0x8000, 0x0000, 0x3F80, 0xFFC3), MIN
    ).tolist() == [0x0000, 0x8000, 0x7FC5, 0xFFC3]
    assert bf16_combine(bits(0x3F80, 0xBF80), bits(0x4000, 0xC000), MAX).tolist() == [
        0x4000,
        0xBF80,
    ]


def test_widening_and_rounding_are_exact() -> None:
    every = np.arange(65536, dtype=np.uint16)
    finite = (every & 0x7F80) != 0x7F80
    # Widening then rounding gives every non-NaN pattern back.
    assert np.array_equal(
        bf16_round(bf16_values(every))[finite | ((every & 0x7F) == 0)],
        every[finite | ((every & 0x7F) == 0)],
    )
    assert bf16_values(bits(0x3F80, 0xC000, 0x0001)).tolist() == [1.0, -2.0, 2.0**-133]
    assert element_values(bits(0x3F80, 0x4040).tobytes(), DType.BF16).tolist() == [1.0, 3.0]


def test_the_reference_is_pytorchs_bf16_add() -> None:
    """The numpy statement of the rule against an implementation we did not write: torch's CPU
    bf16 add, on 400,000 random pattern pairs (every class of value), bit for bit wherever the
    result is not a NaN (torch's vector loop may keep another NaN pattern; SPEC says 0x7FC0)."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(25)
    a = np.concatenate(
        [rng.integers(0, 65536, 400_000, dtype=np.uint16), np.repeat(SPECIAL, len(SPECIAL))]
    )
    b = np.concatenate(
        [rng.integers(0, 65536, 400_000, dtype=np.uint16), np.tile(SPECIAL, len(SPECIAL))]
    )
    ours = bf16_combine(a, b, SUM)
    as_torch = [torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (a, b)]
    theirs = (as_torch[0] + as_torch[1]).view(torch.int16).numpy().view(np.uint16)
    nan = (ours & 0x7FFF) > 0x7F80
    assert np.array_equal(nan, (theirs & 0x7FFF) > 0x7F80)
    assert np.array_equal(ours[~nan], theirs[~nan])
    assert set(ours[nan].tolist()) == {0x7FC0}


@pytest.mark.parametrize("n", [1, 7, 64, 4101])
@pytest.mark.parametrize("op", [SUM, MIN, MAX])
def test_compiled_combine_is_the_reference_bitwise(n: int, op: int) -> None:
    rng = np.random.default_rng(n * 3 + op)
    ordinary = bf16_round((rng.standard_normal(n) * 100).astype(np.float32))
    patterns = rng.integers(0, 65536, n, dtype=np.uint16)
    specials = rng.choice(SPECIAL, n)
    for a, b in ((ordinary, ordinary[::-1].copy()), (patterns, specials), (specials, patterns)):
        expected = bf16_combine(a, b, op)
        in_place = a.copy()
        combine(in_place, in_place, b, DTYPE_BF16, op)
        out = np.empty_like(a)
        combine(out, a, b, DTYPE_BF16, op)
        assert in_place.tobytes() == expected.tobytes() and out.tobytes() == expected.tobytes()


def test_the_marked_dtype_and_unmarked_uint16() -> None:
    """netdam.bfloat16 is uint16 marked as bf16; plain uint16 is not a NIC type (it would
    otherwise be added as bf16, silently wrong)."""
    marked = np.zeros(8, api.bfloat16)
    assert (
        is_bf16(marked)
        and is_bf16(marked[2:5])
        and is_bf16(marked.copy())
        and api.bfloat16 is BFLOAT16
    )
    assert api.wire_dtype(marked) == DType.BF16
    with pytest.raises(TypeError, match="bfloat16"):
        api.wire_dtype(np.zeros(8, np.uint16))


def test_ml_dtypes_bfloat16_is_bf16() -> None:
    """ml_dtypes' bfloat16 (JAX's, and what some torch exports give) is read by its scalar
    type's name, not by dtype.name, which numpy builds anew on every read."""
    ml_dtypes = pytest.importorskip("ml_dtypes", reason="ml_dtypes is not installed")
    array = np.zeros(8, ml_dtypes.bfloat16)
    assert is_bf16(array) and is_bf16(array[2:5]) and api.wire_dtype(array) == DType.BF16


def test_a_node_adds_bf16_and_refuses_an_unknown_dtype(cluster: Cluster) -> None:
    node = cluster.nodes[0]
    start = bits(0x3F80, 0x3F80, 0x7F7F, 0x0000)
    node.memory[64:72] = start.view(np.uint8)
    addend = bits(0x3B80, 0x3C40, 0x7F7F, 0x8000)
    add = Packet(
        Opcode.ADD,
        flags=Flags.ACK_REQ,
        client_id=1,
        txn_id=3,
        rkey=RKEY,
        addr=64,
        dtype=DType.BF16,
        length=8,
        payload=addend.tobytes(),
    )
    only(cluster.request(0, add), Opcode.ACK)
    assert node.memory[64:72].view(np.uint16).tolist() == bf16_combine(start, addend, SUM).tolist()
    # Dtype codes above the last one are refused, before anything touches memory.
    raw = bytearray(encode_packet(add))
    raw[H_DTYPE] = max(DType) + 1
    cluster.fabric.send(CLIENT, cluster.endpoints[0], bytes(raw))
    cluster.fabric.run_until_idle()
    ((reply, _),) = cluster.fabric.receive(CLIENT)
    nack = decode_packet(reply)
    assert nack.opcode == Opcode.NACK and nack.status == Status.BAD_DTYPE
    assert node.memory[64:72].view(np.uint16).tolist() == bf16_combine(start, addend, SUM).tolist()
