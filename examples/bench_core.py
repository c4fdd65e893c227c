"""Packet rate of one node core's datapath in one process (no sockets): CHAIN_ADD of 2048 f32,
combined with local memory and forwarded, in batches of 64. Run: python examples/bench_core.py"""

from __future__ import annotations

import time

import numpy as np

from netdam.node import SLOT_BYTES, NodeConfig, NodeCore
from netdam.protocol.constants import RIGHTS_ALL, DType, Opcode
from netdam.protocol.packet import Packet, encode_packet, endpoint_to_u64

SELF, NEXT = ("127.0.0.1", 7001), ("127.0.0.1", 7002)
BATCH, ROUNDS = 64, 3000


def main() -> None:
    node = NodeCore(NodeConfig(endpoint=SELF, memory_bytes=1 << 24, members=(SELF, NEXT), tx_slots=BATCH))
    rkey = node.register_region(0, 1 << 24, RIGHTS_ALL)
    payload = np.ones(2048, np.float32).tobytes()
    packet = encode_packet(Packet(Opcode.CHAIN_ADD, rkey=rkey, addr=0, aux_addr=8192, dtype=DType.F32,
                                  segments=(SELF, NEXT), segments_left=1, length=8192, payload=payload))  # fmt: skip
    buf = np.zeros((BATCH, SLOT_BYTES), np.uint8)
    buf[:, : len(packet)] = np.frombuffer(packet, np.uint8)
    lens = np.full(BATCH, len(packet), np.int32)
    srcs = np.full(BATCH, endpoint_to_u64(NEXT), np.uint64)
    out = np.zeros((BATCH, SLOT_BYTES), np.uint8)
    out_lens = np.zeros(BATCH, np.int32)
    out_dsts = np.zeros(BATCH, np.uint64)

    def one_round() -> None:
        node.receive_batch(buf, lens, srcs, BATCH, 0.0)
        node.fill_send_batch(out, out_lens, out_dsts, 0.0)

    for _ in range(20):  # compile and warm up
        one_round()
    start = time.perf_counter()
    for _ in range(ROUNDS):
        one_round()
    seconds = time.perf_counter() - start
    pps = BATCH * ROUNDS / seconds
    print(f"CHAIN_ADD forward, 2048 f32, batches of {BATCH}: {pps / 1e3:.0f} k packets/s, "
          f"{pps * 8192 / 1e9:.2f} GB/s of payload")  # fmt: skip


if __name__ == "__main__":
    main()
