"""Packet rate of one node core's datapath in one process (no sockets): CHAIN_ADD of 2048 f32,
combined with local memory and forwarded, in batches of 64. Run: python examples/bench_core.py"""

from __future__ import annotations

import time

import numpy as np

from netdam.core.node import NodeConfig, NodeCore
from netdam.protocol.constants import RIGHTS_ALL, DType, Opcode
from netdam.protocol.packet import Packet, encode_packet, endpoint_to_u64

SELF, NEXT = ("127.0.0.1", 7001), ("127.0.0.1", 7002)
BATCH, ROUNDS = 64, 3000


def main() -> None:
    node = NodeCore(
        NodeConfig(endpoint=SELF, memory_bytes=1 << 24, members=(SELF, NEXT), tx_slots=BATCH)
    )
    rkey = node.register_region(0, 1 << 24, RIGHTS_ALL)
    payload = np.ones(2048, np.float32).tobytes()
    packet = encode_packet(
        Packet(
            Opcode.CHAIN_ADD,
            rkey=rkey,
            addr=0,
            aux_addr=8192,
            dtype=DType.F32,
            segments=(SELF, NEXT),
            segments_left=1,
            length=8192,
            payload=payload,
        )
    )
    buf = np.frombuffer(packet * BATCH, np.uint8).copy()  # a GRO run: back to back
    lens = np.full(BATCH, len(packet), np.int32)
    offs = np.arange(BATCH, dtype=np.int64) * len(packet)
    srcs = np.full(BATCH, endpoint_to_u64(NEXT), np.uint64)

    def one_round() -> None:
        node.receive_batch(buf, offs, lens, srcs, BATCH, 0.0)
        node.sent(node.pending())  # an I/O shell sends straight from the queue

    for _ in range(20):  # compile and warm up
        one_round()
    start = time.perf_counter()
    for _ in range(ROUNDS):
        one_round()
    seconds = time.perf_counter() - start
    pps = BATCH * ROUNDS / seconds
    print(
        f"CHAIN_ADD forward, 2048 f32, batches of {BATCH}: {pps / 1e3:.0f} k packets/s, "
        f"{pps * 8192 * 8 / 1e9:.2f} Gb/s of payload"
    )


if __name__ == "__main__":
    main()
