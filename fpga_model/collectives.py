"""All-reduce time on real hardware: NetDAM chain + multicast against RoCE host algorithms.

Algorithms (p nodes, n bytes per node):

- ``netdam-chain``: reduce-scatter by SR chains (each chunk visits p-1 NICs, every hop adds
  in flight, the last stores), then all-gather by multicast writes (design notes 4.1-4.3).
  Every block's chains advance a hop at a time, each hop the longer of a chunk's latency and
  the NIC's pipeline time for a block of ADDs; then a multicast hop, every node's (p-1)/p n of
  WRITEs at its pipeline's rate (analytic.py; an owner's WRITE of a chunk is also that chunk's
  chain's acknowledgement, SPEC.md 4.1, so no ACK is sent), and the DONE exchange. A
  replay of the same job packet by packet (replay.py) agrees within 1%.
- ``roce-ideal``: the hardware bound of a RoCE host all-reduce: no software cost, no copies,
  and the reduction of each step fully overlapped with its transfer (an infinitely fine
  pipeline). The best of a ring, Thakur, Rabenseifner & Gropp 2005,
  2(p-1) a + (p-1)/p n (max(b_rs, g) + b_ag), recursive doubling, log2(p) steps of
  a + n max(b_rs, g), and Rabenseifner's halving-doubling (off powers of two both fold the
  extra ranks first), where a is the RDMA one-way latency (PCIe doorbell + NIC + wire +
  NIC + DMA write), b the per-byte cost of the slowest of link, PCIe and host DRAM (with
  DDIO misses, design notes 8.2), g one core's reduction cost. No library can beat it:
  ``roce-ring`` >= ``roce-ideal`` for every size, node count and preset.
- ``roce-ring``: RoCE as people run it, Open MPI over verbs with one rank per host: the
  algorithm its coll/tuned table picks (``openmpi_allreduce_algorithm``: Open MPI >= 4.1 by
  default, recursive doubling, ring or Rabenseifner; the older 4.0 rule on request), each
  step as coll/base runs it (receive into a temporary buffer, then reduce into the local one
  on one core, serialized; extra ranks folded in first off powers of two), the send buffer
  copied into the working buffer first, software per message and per step, eager copies
  below the eager limit and a rendezvous (RTS/CTS round trip, PCIe read round trip) above.
  Validated against two published host measurement sets (validation.py). With every
  software cost and copy zero and a free reduction, the best of its algorithms, forced, is
  exactly ``roce-ideal``.
- ``halving-doubling``: Rabenseifner (same paper): 2 log2(p) a + 2(p-1)/p n b + (p-1)/p n g
  for powers of two; otherwise the p - p' extra ranks first fold into a partner and get the
  result back at the end (a + n b + n g, then a + n b).
- ``ideal``: the bandwidth lower bound 2(p-1)/p n / link rate, no latency.

algbw = n / t, busbw = algbw x 2(p-1)/p (nccl-tests PERFORMANCE.md); both in 10^9 bit/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from . import wire
from .analytic import pipeline_latency_s, pipeline_rate, roce_one_way_s
from .params import NetdamParams, NicParams, RoceParams, default_presets, load_preset, with_link
from .pipeline import Stage, netdam_shape, netdam_stages

ALGOS = ("netdam-chain", "netdam-chain-2d", "roce-ideal", "roce-ring", "halving-doubling", "ideal")
#: Most NICs one chain visits: an SR list names at most 64 hops (protocol/SPEC.md, MAX_SEGMENTS),
#: so a chain spans at most 65 nodes; netdam-chain-2d groups nodes by 64.
CHAIN_GROUP = 64
#: Published SHARP (InfiniBand switch aggregation) MPI_Allreduce latencies on 128 hosts, with
#: and without SHARP: (bytes per node) -> (seconds with SHARP, seconds host-based). As quoted
#: by the project's scale issue from the SHARP evaluations (Bloch et al., "Towards a Data Centric
#: System Architecture: SHARP", Supercomputing Frontiers and Innovations 4(4), 2017,
#: doi:10.14529/jsfi170401); a reference row beside the model, not a model.
SHARP_128_HOSTS = {8: (2.83e-6, 6.01e-6), 4096: (14.5e-6, 46.9e-6)}
_LINK_STAGES = {"wire_in": "link", "wire_out": "link"}


@dataclass(frozen=True)
class AllreduceEstimate:
    """Modelled time of one all-reduce and what limits it."""

    algo: str
    nodes: int
    nbytes: int
    link_gbps: float
    seconds: float
    bottleneck: str
    terms: dict[str, float]
    params: str
    algorithm: str = ""  # the host library's algorithm (roce-ring), else empty

    @property
    def algbw_gbps(self) -> float:
        return self.nbytes * 8.0 / self.seconds / 1e9 if self.seconds > 0 else 0.0

    @property
    def busbw_gbps(self) -> float:
        return self.algbw_gbps * bus_factor(self.nodes)

    def as_dict(self) -> dict[str, object]:
        return {
            "algo": self.algo,
            "nodes": self.nodes,
            "bytes": self.nbytes,
            "link_gbps": self.link_gbps,
            "seconds": self.seconds,
            "algbw_gbps": self.algbw_gbps,
            "busbw_gbps": self.busbw_gbps,
            "bottleneck": self.bottleneck,
            "terms_seconds": self.terms,
            "params": self.params,
            "host_algorithm": self.algorithm or None,
        }


def bus_factor(nodes: int) -> float:
    """nccl-tests all-reduce bus bandwidth factor 2(p-1)/p."""
    return 2.0 * (nodes - 1) / nodes


def _check(nodes: int, nbytes: int, dtype_bytes: int) -> None:
    if nodes < 2:
        raise ValueError(f"an all-reduce needs at least 2 nodes, got {nodes}")
    if nbytes <= 0:
        raise ValueError(f"size must be positive, got {nbytes} bytes")
    if dtype_bytes not in (1, 2, 4, 8):
        raise ValueError(f"dtype_bytes must be 1, 2, 4 or 8, got {dtype_bytes}")


def _packet_time(p: NetdamParams, op: str, data: int, segments: int, dtype_bytes: int) -> float:
    """Seconds one packet of *data* bytes occupies the node's bottleneck stage."""
    rate, _ = pipeline_rate(netdam_stages(p, netdam_shape(op, data, segments), dtype_bytes))
    return 1.0 / rate


def netdam_chain(
    p: NetdamParams, nodes: int, nbytes: int, dtype_bytes: int = 4
) -> AllreduceEstimate:
    """Chained reduce-scatter + multicast all-gather on NetDAM cards behind one switch."""
    _check(nodes, nbytes, dtype_bytes)
    segments = nodes - 1
    block = math.ceil(math.ceil(nbytes / nodes) / dtype_bytes) * dtype_bytes
    chunk = min(wire.max_data_bytes(p.mtu, segments, dtype_bytes), block)
    full, rest = divmod(block, chunk)
    add = netdam_stages(p, netdam_shape("add", chunk, segments), dtype_bytes)
    write = netdam_stages(p, netdam_shape("write", chunk, 0), dtype_bytes)
    add_pps, add_limit = pipeline_rate(add)
    write_pps, write_limit = pipeline_rate(write)
    # Per block: `full` packets of `chunk` bytes and one shorter packet for the rest.
    add_block = full / add_pps + (
        _packet_time(p, "add", rest, segments, dtype_bytes) if rest else 0.0
    )
    write_block = full / write_pps + (
        _packet_time(p, "write", rest, 0, dtype_bytes) if rest else 0.0
    )
    rs_bw = (nodes - 1) * add_block  # every node receives p-1 blocks in each phase
    ag_bw = (nodes - 1) * write_block
    hop = p.propagation_s + p.switch_latency_s
    store = netdam_stages(p, netdam_shape("add-store", chunk, segments), dtype_bytes)
    control = netdam_stages(p, netdam_shape("write", 0, 0), dtype_bytes)  # DONE
    control_interval = 1.0 / pipeline_rate(control)[0]

    def after_receive(stages: list[Stage]) -> float:
        """A packet's latency through a NIC once its last bit is in (the receive wire stage
        overlaps the sender's transmit)."""
        return pipeline_latency_s(stages) - stages[0].latency_s

    # Every block's chains advance together, a hop at a time (each NIC starts its block's
    # chunks at once, at line rate): a hop takes a chunk's latency through the link and the
    # next NIC, or that NIC's pipeline time for a block of adds, whichever is longer; the last
    # hop stores. Then one multicast hop, and every NIC takes p-1 blocks of WRITEs (among them
    # its chains' acknowledgements); the last of them leaves its pipeline; every NIC sends its
    # DONE (SPEC.md 4.1: complete when every member's DONE is here), p-1 of them per NIC.
    per_hop = rs_bw / segments
    chains = (
        add[0].latency_s
        + (segments - 1) * max(hop + after_receive(add), per_hop)
        + max(hop + after_receive(store), per_hop)
    )
    last_out = after_receive(write) - 1.0 / write_pps
    done = hop + control[0].latency_s + after_receive(control) + (nodes - 2) * control_interval
    total = chains + hop + ag_bw + last_out + done
    completion = done
    fill = total - rs_bw - ag_bw - completion
    limit = add_limit if rs_bw >= ag_bw else write_limit
    bottleneck = "latency" if fill + completion > rs_bw + ag_bw else _LINK_STAGES.get(limit, limit)
    return AllreduceEstimate(
        "netdam-chain",
        nodes,
        nbytes,
        p.link_gbps,
        total,
        bottleneck,
        {"reduce_scatter": rs_bw, "all_gather": ag_bw, "latency": fill, "completion": completion},
        p.name,
    )


def _chain_groups(nodes: int) -> int:
    """Groups of netdam-chain-2d over *nodes* (more than one chain): the emulator's torus shape
    (SPEC.md 4.2), the most square split into equal groups of at most CHAIN_GROUP, at most
    CHAIN_GROUP of them (group + size smallest, the fewer groups of two alike); with no such
    split, the fewest groups of at most CHAIN_GROUP nodes (the last one smaller)."""
    fewest = math.ceil(nodes / CHAIN_GROUP)
    even = [g for g in range(fewest, CHAIN_GROUP + 1) if nodes % g == 0]
    return min(even, key=lambda g: (g + nodes // g, g)) if even else fewest


def netdam_chain_2d(
    p: NetdamParams, nodes: int, nbytes: int, dtype_bytes: int = 4
) -> AllreduceEstimate:
    """Chains past one SR list: nodes in groups (_chain_groups: as square as the count allows,
    every group ceil(nodes / groups) nodes, the last maybe fewer); a chained reduce-scatter inside each group leaves each
    member 1/g of its group's sum, the members holding the same block index all-reduce it over
    the groups (a chain again, 2-D recursively past CHAIN_GROUP groups: a torus of chains, one
    dimension after another), then a multicast all-gather inside each group. At most
    CHAIN_GROUP + 1 nodes it is netdam-chain itself."""
    _check(nodes, nbytes, dtype_bytes)
    if nodes <= CHAIN_GROUP + 1:
        flat = netdam_chain(p, nodes, nbytes, dtype_bytes)
        return AllreduceEstimate(
            "netdam-chain-2d",
            nodes,
            nbytes,
            p.link_gbps,
            flat.seconds,
            flat.bottleneck,
            flat.terms,
            p.name,
        )
    groups = _chain_groups(nodes)
    size = math.ceil(nodes / groups)
    inner = netdam_chain(p, size, nbytes, dtype_bytes)
    block = max(dtype_bytes, math.ceil(math.ceil(nbytes / size) / dtype_bytes) * dtype_bytes)
    outer = netdam_chain_2d(p, groups, block, dtype_bytes) if groups >= 2 else None
    # The inner chain's latency and completion: both phases pay them.
    terms = {
        "reduce_scatter": inner.terms["reduce_scatter"],
        "all_gather": inner.terms["all_gather"],
        "latency": inner.terms["latency"],
        "completion": inner.terms["completion"],
        "across_groups": outer.seconds if outer else 0.0,
    }
    total = sum(terms.values())
    bottleneck = max(terms, key=lambda k: terms[k])
    return AllreduceEstimate(
        "netdam-chain-2d",
        nodes,
        nbytes,
        p.link_gbps,
        total,
        "latency" if bottleneck == "latency" else inner.bottleneck,
        terms,
        p.name,
    )


@dataclass(frozen=True)
class _HostCosts:
    alpha: float
    beta_rs: float
    beta_ag: float
    gamma: float
    limiter_rs: str
    limiter_ag: str


def _host_costs(p: RoceParams) -> _HostCosts:
    """Per-step latency and per-byte costs of a RoCE host (design notes section 8)."""
    frame = wire.roce_frame_bytes(p.roce_mtu_bytes)
    link = p.link_gbps * 1e9 / 8.0 * p.roce_mtu_bytes / wire.wire_bytes(frame)
    nic = p.nic_max_mpps * 1e6 * p.roce_mtu_bytes
    miss = 1.0 - p.ddio_hit_rate
    # DRAM bytes per received byte: a DDIO miss writes it and reads it back (B8, 2x NIC
    # bandwidth); reduce-scatter adds the core's read of the local block and write of the sum.
    mem_rs = p.host_dram_bytes_per_s / (2.0 * miss + 2.0)
    mem_ag = p.host_dram_bytes_per_s / (2.0 * miss) if miss > 0 else float("inf")
    caps_rs = {"link": link, "nic": nic, "pcie": p.pcie_bytes_per_s, "host_memory": mem_rs}
    caps_ag = {"link": link, "nic": nic, "pcie": p.pcie_bytes_per_s, "host_memory": mem_ag}
    lim_rs = min(caps_rs, key=lambda k: caps_rs[k])
    lim_ag = min(caps_ag, key=lambda k: caps_ag[k])
    return _HostCosts(
        alpha=roce_one_way_s(p, 32, switched=True),
        beta_rs=1.0 / caps_rs[lim_rs],
        beta_ag=1.0 / caps_ag[lim_ag],
        gamma=1.0 / p.cpu_reduce_bytes_per_s,
        limiter_rs=lim_rs,
        limiter_ag=lim_ag,
    )


def _host_estimate(
    algo: str,
    p: RoceParams,
    nodes: int,
    nbytes: int,
    steps: float,
    frac: float,
    extra: dict[str, float],
) -> AllreduceEstimate:
    c = _host_costs(p)
    terms = {
        "latency": steps * c.alpha + extra.get("latency", 0.0),
        "transfer": frac * nbytes * (c.beta_rs + c.beta_ag) + extra.get("transfer", 0.0),
        "cpu_reduce": frac * nbytes * c.gamma + extra.get("cpu_reduce", 0.0),
    }
    worst = max(terms, key=lambda k: terms[k])
    bottleneck = c.limiter_rs if worst == "transfer" else worst
    return AllreduceEstimate(
        algo, nodes, nbytes, p.link_gbps, sum(terms.values()), bottleneck, terms, p.name
    )


def roce_ideal(p: RoceParams, nodes: int, nbytes: int, dtype_bytes: int = 4) -> AllreduceEstimate:
    """Hardware bound of a RoCE host all-reduce (module docstring): the best of a ring,
    recursive doubling and Rabenseifner's halving-doubling, no software, no copies, each
    step's reduction hidden behind its transfer where the transfer is the slower (and the
    transfer behind the reduction where that is)."""
    _check(nodes, nbytes, dtype_bytes)
    c = _host_costs(p)
    rs = max(c.beta_rs, c.gamma)  # per byte of a reducing step: the slower of the two

    def steps(count: float, reduced: float, gathered: float) -> dict[str, float]:
        return {
            "latency": count * c.alpha,
            "transfer": reduced * c.beta_rs + gathered * c.beta_ag,
            "cpu_reduce": reduced * (rs - c.beta_rs),
        }

    frac = (nodes - 1) / nodes
    pow2 = 1 << (nodes.bit_length() - 1)
    fold = nbytes if pow2 != nodes else 0.0  # whole vector in and (result) back out
    hops = 2 if pow2 != nodes else 0
    log = math.log2(pow2)
    candidates = [
        steps(2.0 * (nodes - 1), frac * nbytes, frac * nbytes),  # ring
        steps(log + hops, log * nbytes + fold, fold),  # recursive doubling
        steps(
            2.0 * log + hops,
            (pow2 - 1) / pow2 * nbytes + fold,  # Rabenseifner
            (pow2 - 1) / pow2 * nbytes + fold,
        ),
    ]
    terms = min(candidates, key=lambda t: sum(t.values()))
    worst = max(terms, key=lambda k: terms[k])
    bottleneck = c.limiter_rs if worst == "transfer" else worst
    return AllreduceEstimate(
        "roce-ideal", nodes, nbytes, p.link_gbps, sum(terms.values()), bottleneck, terms, p.name
    )


def _message_overhead_s(p: RoceParams, c: _HostCosts, nbytes: float) -> tuple[float, float]:
    """(seconds per message, seconds per byte) of software for one point-to-point message."""
    if nbytes <= p.eager_limit_bytes:
        # Eager: copy into a registered bounce buffer, copy out at the receiver.
        return p.sw_message_s, p.eager_copies / p.cpu_memcpy_bytes_per_s
    # Rendezvous: RTS then CTS (one round trip of small messages, each with its own
    # software cost), then the RDMA read crosses the responder's PCIe as a read round trip.
    handshake = 2.0 * (c.alpha + p.sw_message_s)
    return p.sw_message_s + handshake + p.pcie_read_s(32), 0.0


ROCE_RING_ALGORITHMS = (
    "recursive_doubling",
    "ring",
    "segmented_ring",
    "rabenseifner",
    "nonoverlapping",
)


def openmpi_allreduce_algorithm(p: RoceParams, nodes: int, nbytes: int) -> str:
    """The algorithm Open MPI's coll/tuned picks for a commutative all-reduce (MPI_SUM).

    ``openmpi-4.1``: ``ompi_coll_tuned_allreduce_intra_dec_fixed`` of Open MPI >= 4.1.0
    (coll_tuned_decision_fixed.c, commutative branch, switch points from the
    ompi-collectives-tuning measurements). Its algorithm 5 (segmented ring) runs with
    segment size 0, which ``ompi_coll_base_allreduce_intra_ring_segmented`` turns into the
    plain ring, so it is reported as ``ring``. ``openmpi-4.0``: the older fixed rule,
    recursive doubling below ``small_allreduce_bytes``, ring up to p segments of
    ``ring_segment_bytes``, segmented ring above.
    """
    if p.coll_decision == "openmpi-4.0":
        if nbytes < p.small_allreduce_bytes:
            return "recursive_doubling"
        return "ring" if nodes * p.ring_segment_bytes >= nbytes else "segmented_ring"
    n = nbytes
    if nodes < 4:
        if n < 8 or 4096 <= n < 8192 or 16384 <= n < 262144:
            return "ring"
        return "recursive_doubling" if n < 16384 else "rabenseifner"
    if nodes < 8:
        return "ring" if n < 16 else "recursive_doubling" if n < 8192 else "rabenseifner"
    if nodes < 16:
        return "recursive_doubling" if n < 8192 else "rabenseifner"
    if nodes < 32:
        return "ring" if n < 64 else "recursive_doubling" if n < 4096 else "rabenseifner"
    if nodes < 64:
        return "ring" if n < 128 else "rabenseifner"
    if nodes < 128:
        return "recursive_doubling" if n < 262144 else "rabenseifner"
    if nodes < 256:
        return (
            "nonoverlapping"
            if n < 131072
            else "recursive_doubling"
            if n < 262144
            else "rabenseifner"
        )
    if nodes < 512:
        return "nonoverlapping" if n < 4096 else "rabenseifner"
    if nodes < 2048:
        return (
            "nonoverlapping" if n < 2048 else "recursive_doubling" if n < 16384 else "rabenseifner"
        )
    if nodes < 4096:
        return (
            "nonoverlapping"
            if n < 2048
            else "ring"
            if n < 4096
            else "recursive_doubling"
            if n < 16384
            else "rabenseifner"
        )
    return (
        "nonoverlapping"
        if n < 2048
        else "ring"
        if n < 16384
        else "recursive_doubling"
        if n < 32768
        else "rabenseifner"
    )


class _Steps:
    """Adds up the steps of one host-library algorithm, term by term."""

    def __init__(self, p: RoceParams, c: _HostCosts) -> None:
        self.p, self.c = p, c
        self.terms = {"latency": 0.0, "transfer": 0.0, "cpu_reduce": 0.0, "copies": 0.0}

    def copy(self, nbytes: float) -> None:
        """The library copies *nbytes* on the host (send buffer into its working buffer)."""
        self.terms["copies"] += nbytes / self.p.cpu_memcpy_bytes_per_s

    def exchange(self, nbytes: float, reduce: bool, times: int = 1) -> None:
        """*times* algorithm steps: send and receive *nbytes* with one peer, then (reduce)
        fold the received temporary into the local buffer; progress only inside the call,
        so the reduction follows the transfer."""
        lat, per = _message_overhead_s(self.p, self.c, nbytes)
        beta = self.c.beta_rs if reduce else self.c.beta_ag
        self.terms["latency"] += times * (self.c.alpha + lat + self.p.sw_step_s)
        self.terms["transfer"] += times * nbytes * (beta + per)
        if reduce:
            self.terms["cpu_reduce"] += times * nbytes * self.c.gamma

    def pipelined(self, nseg: int, seg: float, reduce: bool, times: int) -> None:
        """*times* steps of *nseg* segments: segment k+1 travels while segment k is reduced."""
        lat, per = _message_overhead_s(self.p, self.c, seg)
        beta = self.c.beta_rs if reduce else self.c.beta_ag
        comm_fixed = self.c.alpha + lat
        comm = comm_fixed + seg * (beta + per)
        red = seg * self.c.gamma if reduce else 0.0
        step = nseg * max(comm, red) + min(comm, red)
        self.terms["latency"] += times * (nseg * comm_fixed + self.p.sw_step_s)
        self.terms["transfer"] += times * nseg * seg * (beta + per)
        self.terms["cpu_reduce"] += times * (step - nseg * comm)


def _fold(s: _Steps, nodes: int, nbytes: int, halves: bool) -> tuple[int, bool]:
    """Open MPI's non-power-of-two handling: the first 2r ranks pair up and one of each pair
    leaves the algorithm, its partner holding the pair's sum (and sending the result back
    at the end). Recursive doubling sends the whole vector one way and reduces it;
    Rabenseifner (*halves*) exchanges halves, reduces one each and sends that half back.
    Returns (p', folded)."""
    pow2 = 1 << (nodes.bit_length() - 1)
    if pow2 != nodes:
        if halves:
            s.exchange(nbytes / 2, reduce=True)
            s.exchange(nbytes / 2, reduce=False)
        else:
            s.exchange(nbytes, reduce=True)
    return pow2, pow2 != nodes


def roce_ring(
    p: RoceParams, nodes: int, nbytes: int, dtype_bytes: int = 4, algorithm: str | None = None
) -> AllreduceEstimate:
    """MPI-library all-reduce over RoCE as Open MPI's coll/tuned runs it (module docstring).

    *algorithm* forces one of ROCE_RING_ALGORITHMS instead of the library's choice.
    """
    _check(nodes, nbytes, dtype_bytes)
    algo = algorithm or openmpi_allreduce_algorithm(p, nodes, nbytes)
    if algo == "ring" and nbytes // dtype_bytes < nodes:
        algo = "recursive_doubling"  # ompi_coll_base_allreduce_intra_ring: count < size
    if algo not in ROCE_RING_ALGORITHMS:
        raise ValueError(
            f"unknown host algorithm {algo!r}; choose one of {', '.join(ROCE_RING_ALGORITHMS)}"
        )
    c = _host_costs(p)
    s = _Steps(p, c)
    s.copy(p.send_buffer_copies * nbytes)
    if algo in ("recursive_doubling", "rabenseifner"):
        pow2, folded = _fold(s, nodes, nbytes, halves=algo == "rabenseifner")
        steps = int(math.log2(pow2))
        if algo == "recursive_doubling":
            s.exchange(nbytes, reduce=True, times=steps)
        else:
            # Recursive halving (reduce-scatter), then recursive doubling (all-gather).
            for k in range(1, steps + 1):
                s.exchange(nbytes / (1 << k), reduce=True)
            for k in range(steps, 0, -1):
                s.exchange(nbytes / (1 << k), reduce=False)
        if folded:
            s.exchange(nbytes, reduce=False)
    elif algo == "nonoverlapping":
        # Reduce to a root then broadcast it (binomial trees of whole vectors).
        depth = math.ceil(math.log2(nodes))
        s.exchange(nbytes, reduce=True, times=depth)
        s.exchange(nbytes, reduce=False, times=depth)
    else:
        block = nbytes / nodes  # Open MPI splits into early and late blocks one element apart
        if algo == "segmented_ring":
            seg = min(block, p.ring_segment_bytes)
            nseg = math.ceil(block / seg)
            s.pipelined(nseg, seg, reduce=True, times=nodes - 1)
            s.pipelined(nseg, seg, reduce=False, times=nodes - 1)
        else:
            s.exchange(block, reduce=True, times=nodes - 1)
            s.exchange(block, reduce=False, times=nodes - 1)
    terms = s.terms
    worst = max(terms, key=lambda k: terms[k])
    bottleneck = c.limiter_rs if worst == "transfer" else worst
    return AllreduceEstimate(
        "roce-ring",
        nodes,
        nbytes,
        p.link_gbps,
        sum(terms.values()),
        bottleneck,
        terms,
        p.name,
        algorithm=algo,
    )


def halving_doubling(
    p: RoceParams, nodes: int, nbytes: int, dtype_bytes: int = 4
) -> AllreduceEstimate:
    """Rabenseifner's recursive halving reduce-scatter + doubling all-gather over RoCE."""
    _check(nodes, nbytes, dtype_bytes)
    pow2 = 1 << (nodes.bit_length() - 1)
    extra: dict[str, float] = {}
    if pow2 != nodes:
        c = _host_costs(p)
        extra = {
            "latency": 2.0 * c.alpha,
            "transfer": nbytes * (c.beta_rs + c.beta_ag),
            "cpu_reduce": nbytes * c.gamma,
        }
    return _host_estimate(
        "halving-doubling", p, nodes, nbytes, 2.0 * math.log2(pow2), (pow2 - 1) / pow2, extra
    )


def ideal(link_gbps: float, nodes: int, nbytes: int, dtype_bytes: int = 4) -> AllreduceEstimate:
    """Bandwidth lower bound: every node receives 2(p-1)/p n bytes at the raw link rate."""
    _check(nodes, nbytes, dtype_bytes)
    t = bus_factor(nodes) * nbytes * 8.0 / (link_gbps * 1e9)
    return AllreduceEstimate(
        "ideal", nodes, nbytes, link_gbps, t, "link", {"transfer": t}, f"{link_gbps:g} Gb/s link"
    )


def allreduce(
    algo: str, nodes: int, nbytes: int, netdam: NetdamParams, roce: RoceParams, dtype_bytes: int = 4
) -> AllreduceEstimate:
    """Dispatch to one algorithm; the link speed comes from the parameters it uses."""
    if algo == "netdam-chain":
        return netdam_chain(netdam, nodes, nbytes, dtype_bytes)
    if algo == "netdam-chain-2d":
        return netdam_chain_2d(netdam, nodes, nbytes, dtype_bytes)
    if algo == "roce-ideal":
        return roce_ideal(roce, nodes, nbytes, dtype_bytes)
    if algo == "roce-ring":
        return roce_ring(roce, nodes, nbytes, dtype_bytes)
    if algo == "halving-doubling":
        return halving_doubling(roce, nodes, nbytes, dtype_bytes)
    if algo == "ideal":
        return ideal(netdam.link_gbps, nodes, nbytes, dtype_bytes)
    raise ValueError(f"unknown algorithm {algo!r}; choose one of {', '.join(ALGOS)}")


@lru_cache(maxsize=32)
def default_params(link_gbps: float) -> tuple[NetdamParams, RoceParams]:
    """Shipped presets for a port speed (100G class or 200G class), set to exactly that speed."""
    nd_name, ro_name = default_presets(link_gbps)
    nd: NicParams = with_link(load_preset(nd_name), link_gbps)
    ro: NicParams = with_link(load_preset(ro_name), link_gbps)
    assert isinstance(nd, NetdamParams) and isinstance(ro, RoceParams)
    return nd, ro


def estimate_allreduce_seconds(
    nodes: int,
    nbytes: int,
    link_gbps: float = 100.0,
    algo: str = "netdam-chain",
    dtype_bytes: int = 4,
) -> float:
    """Modelled seconds of one all-reduce of *nbytes* per node over *nodes* nodes.

    Stable entry point for the emulator's collectives, which print it beside the measured
    time. Uses the shipped presets: netdam-100g / roce-gen3 up to 100 Gb/s, netdam-200g /
    roce-gen4 above, with the port speed set to *link_gbps*. *algo* is one of ALGOS.
    Raises ValueError for fewer than 2 nodes, a non-positive size or an unknown algorithm.
    """
    if link_gbps <= 0:
        raise ValueError(f"link_gbps must be positive, got {link_gbps}")
    nd, ro = default_params(float(link_gbps))
    return allreduce(algo, nodes, nbytes, nd, ro, dtype_bytes).seconds


__all__ = [
    "ALGOS",
    "AllreduceEstimate",
    "allreduce",
    "bus_factor",
    "default_params",
    "estimate_allreduce_seconds",
    "halving_doubling",
    "ideal",
    "netdam_chain",
    "roce_ideal",
    "roce_ring",
]
