"""Layout of the collective engine's state arrays, shared by the datapath and the engine tick."""

from netdam.protocol.payloads import Algo

# cfg indices
CFG_STATE = 0  # 0 idle, 1 running, 2 done, 3 failed
CFG_COLL = 1
CFG_EPOCH = 2
CFG_RANK = 3
CFG_WORLD = 4
CFG_ALGO = 5
CFG_DTYPE = 6
CFG_OP = 7
CFG_COUNT = 8
CFG_IN = 9
CFG_OUT = 10
CFG_RKEY = 11
CFG_WINDOW = 12
CFG_PER_PACKET = 13
CFG_CHUNKS = 14
CFG_GROUP = 15  # multicast group endpoint, 0: fan out by unicast
CFG_HOST = 16  # where the completion goes
CFG_SLOT = 17  # completed-chunk guard slot
CFG_ORIG_BLOCK = 18  # block whose chains this node starts, -1: none
CFG_OWN_BLOCK = 19  # block this node stores and spreads, -1: none
CFG_NEXT_SEND = 20
CFG_INFLIGHT = 21
CFG_ACKED = 22
CFG_LOW_UNACKED = 23
CFG_AG_NEXT = 24
CFG_RETRANSMITS = 25
CFG_READS = 26
CFG_FATAL = 27  # status of a fatal NACK (0: none)
CFG_CLIENT = 28
CFG_TXN = 29
CFG_NEEDED = 30  # chunks this node must hold (done bits) to finish
CFG_DONE_COUNT = 31  # chunks whose done bit is set on this node
CFG_PEERS_DONE = 32  # bit r: rank r said DONE for this epoch (this node's own bit included)
CFG_PREV_ASK = 33  # bit r: rank r asked for this node's DONE of the previous epoch
CFG_CUR_ASK = 34  # bit r: rank r still asks for this node's DONE of the finished epoch
CFG_SPARSE = 35  # descriptor flags bit 0: sparse payloads and the non-zero bitmap round
CFG_BM_GOT = 36  # bit r: rank r's non-zero bitmap arrived (own bit included)
CFG_BM_HAS = 37  # bit r: rank r answered: it holds this node's bitmap (own bit included)
CFG_BM_ASK = 38  # bit r: rank r sent its bitmap as a request: answer with ours
CFG_BM_APPLIED = 39  # 1 once chunks zero everywhere were skipped
CFG_LEN = 40

#: aux_addr of an ACK that says "this member holds everything of the epoch" (DONE).
AUX_DONE = 2
#: aux_addr of an ACK carrying a member's per-chunk non-zero bitmap (sparse mode, SPEC 4.1).
AUX_BITMAP = 3

# Sparse mode keeps two more per-chunk tables at the end of the ``done`` array (no new kernel
# arguments): the OR of all members' bitmaps, one byte per chunk, at NZ_BASE + c, and this
# node's own bitmap, packed LSB first, at BM_BASE.
MAX_CHUNKS = 1 << 17
NZ_BASE = MAX_CHUNKS
BM_BASE = 2 * MAX_CHUNKS
DONE_LEN = 2 * MAX_CHUNKS + MAX_CHUNKS // 8

# fcfg indices
F_START = 0
F_RTO = 1
F_SRTT = 2
F_RTTVAR = 3
F_LAST_PROGRESS = 4
F_LAST_COUNT = 5
F_NOW = 6
F_DEADLINE = 7  # watchdog: the collective fails after this long without any progress
F_BASE_RTO = 8  # RTO without backoff: paces all-gather repair
F_LAST_ADVANCE = 9  # last time a chunk completed or a chain was ACKed
F_LAST_DONE_SENT = 10  # last time this node sent its DONE
F_BM_SENT = 11  # last time this node sent its bitmap requests (sparse mode)
F_LEN = 12

# algorithms (START_COLL descriptor byte 0; the wire's values, protocol/payloads.py)
ALGO_ALL_REDUCE = int(Algo.ALL_REDUCE)
ALGO_REDUCE_SCATTER = int(Algo.REDUCE_SCATTER)
ALGO_ALL_GATHER = int(Algo.ALL_GATHER)
ALGO_BROADCAST = int(Algo.BROADCAST)
