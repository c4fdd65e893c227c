"""``netdam model``: the FPGA cycle model from the command line (fpga_model/README.md).

Subcommands: ``op`` (latency breakdown of one instruction), ``line-rate`` (packets/s and
goodput against packet size), ``allreduce`` (modelled all-reduce time of one algorithm),
``sweep`` (every algorithm against size and node count, optionally plotted) and ``validate``
(the RoCE models against published host all-reduce measurements). Every one takes
``--json``; all but ``validate`` (whose sets carry their own hosts) take ``--params FILE.toml``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from netdam.cli.common import (
    CommandError,
    ExitCode,
    NetdamArgumentParser,
    bounded_int,
    emit,
    size_arg,
    size_range_arg,
    writable_output,
)
from netdam.fpga_model import des, wire
from netdam.fpga_model.analytic import describe_system, line_rate, line_rate_stages, op_breakdown
from netdam.fpga_model.collectives import (
    ALGOS,
    CHAIN_GROUP,
    SHARP_128_HOSTS,
    AllreduceEstimate,
    allreduce,
)
from netdam.fpga_model.optimizer import RULES as OPT_RULES
from netdam.fpga_model.optimizer import optimizer_step
from netdam.fpga_model.params import (
    NetdamParams,
    NicParams,
    RoceParams,
    default_presets,
    load_params_file,
    load_preset,
    preset_names,
    with_link,
)
from netdam.fpga_model.pipeline import NETDAM_OPS
from netdam.fpga_model.validation import BOUNDS, SetComparison, compare_set, load_sets
from netdam.protocol.constants import ELEMENT_SIZE, DType
from netdam.tools import plot as plotting
from netdam.units import format_size

#: The cards' retransmit timeout a replay assumes, microseconds: a 4-hop chain's round trip at
#: 100 Gb/s is ~5-8 us in the model (`netdam model op`), and a timer a few round trips long is
#: what a transport with one outstanding window sets (an assumption; --rto-us changes it).
REPLAY_RTO_US = 20.0

#: Element types a collective reduces, by name, and their bytes (u64 is the atomics' type).
DTYPES = {d.name.lower(): ELEMENT_SIZE[d] for d in DType if d not in (DType.RAW, DType.U64)}


def _common(p: argparse.ArgumentParser, link_default: str = "100 (from the preset)") -> None:
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    p.add_argument(
        "--params",
        metavar="FILE.toml",
        help='parameter file: kind = "netdam"|"roce", or [netdam]/[roce] tables '
        "(each may name a base preset and override values)",
    )
    p.add_argument("--preset", choices=preset_names(), help="start from this shipped preset")
    p.add_argument(
        "--link-gbps",
        type=float,
        metavar="GBPS",
        help=f"port speed in 10^9 bit/s (default: {link_default})",
    )


def register(subparsers: Any) -> None:
    """Add ``model`` and its sub-subcommands to the top-level parser."""
    model = subparsers.add_parser(
        "model",
        help="FPGA cycle model: latency, line rate and all-reduce time on real hardware",
        description="Estimate what a job costs on a real NetDAM card and on a RoCE host. "
        "Seconds everywhere; *_gbps are 10^9 bit/s; sizes in bytes.",
    )
    sub = model.add_subparsers(
        dest="model_command", metavar="MODEL_COMMAND", parser_class=NetdamArgumentParser
    )
    sub.required = True

    op = sub.add_parser(
        "op",
        help="latency breakdown of one instruction, wire to wire",
        description="Latency of one instruction (first bit in to last bit out) "
        "stage by stage: wire, MAC/PHY, parse, memory, ALU, store, reply.",
    )
    op.add_argument("--op", choices=NETDAM_OPS, default="read", help="instruction (default read)")
    amount = op.add_mutually_exclusive_group()
    amount.add_argument(
        "--bytes", type=size_arg, metavar="SIZE", help="data bytes moved (default 128 = 32 f32)"
    )
    amount.add_argument(
        "--count", type=bounded_int(1, 1 << 40), metavar="N", help="elements instead of bytes"
    )
    op.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="element type")
    op.add_argument(
        "--sr-segments",
        type=int,
        default=0,
        metavar="N",
        help="segment-routing entries in the request (chain hops)",
    )
    op.add_argument(
        "--system",
        choices=("netdam", "roce"),
        help="NetDAM card or RoCE host (default: the kind of --preset/--params, else netdam)",
    )
    op.add_argument(
        "--des",
        action="store_true",
        help="also run the discrete-event model for the latency distribution",
    )
    _common(op)
    op.set_defaults(func=cmd_op)

    lr = sub.add_parser(
        "line-rate",
        help="packets/s and goodput of a stream of equal packets",
        description="Saturated stream of equal packets through one node: "
        "goodput counts UDP payload bits; bottleneck names the slowest stage.",
    )
    size = lr.add_mutually_exclusive_group()
    size.add_argument(
        "--payload", type=size_arg, metavar="BYTES", help="UDP payload bytes (default: MTU - 28)"
    )
    size.add_argument(
        "--frame",
        type=size_arg,
        metavar="BYTES",
        help="L2 frame bytes including FCS instead of --payload (>= 64)",
    )
    lr.add_argument(
        "--op",
        choices=NETDAM_OPS,
        default="add",
        help="what the node does with each packet (default add: a chain hop)",
    )
    lr.add_argument("--mtu", type=int, help="IP MTU (default: from the parameters, 9000)")
    lr.add_argument("--system", choices=("netdam", "roce"), help="as for `model op`")
    lr.add_argument(
        "--des", action="store_true", help="also push packets through the discrete-event model"
    )
    _common(lr)
    lr.set_defaults(func=cmd_line_rate)

    ar = sub.add_parser(
        "allreduce",
        help="modelled all-reduce time of one algorithm",
        description="Modelled all-reduce of SIZE bytes per node. algbw = size / "
        "seconds, busbw = algbw x 2(N-1)/N (nccl-tests' definitions), printed and in --json "
        "(*_gbps) in Gb/s, 10^9 bit/s like the link speed (nccl-tests prints GB/s: x 8). "
        "--plot draws time and busbw against size.",
    )
    ar.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes (>= 2)")
    ar.add_argument(
        "--size", type=size_arg, required=True, metavar="SIZE", help="bytes per node (e.g. 64MiB)"
    )
    ar.add_argument(
        "--algo",
        choices=ALGOS,
        default=None,
        help="algorithm (default netdam-chain, or netdam-chain-2d where one SR list "
        "cannot name every hop)",
    )
    ar.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="element type")
    ar.add_argument(
        "--plot",
        metavar="FILE.png",
        type=writable_output("--plot"),
        help="also draw time and busbw against size, 4KiB up to 4 x SIZE (needs the "
        "[plot] extra: matplotlib)",
    )
    _common(ar, "100")
    ar.set_defaults(func=cmd_allreduce)

    sw = sub.add_parser(
        "sweep",
        help="every algorithm against size and node count",
        description="Time and busbw of every algorithm over sizes and node counts.",
    )
    sw.add_argument(
        "--sizes",
        type=size_range_arg,
        default=size_range_arg("4KiB..1GiB"),
        metavar="A..B",
        help="sizes, powers of two from A to B (default 4KiB..1GiB)",
    )
    sw.add_argument(
        "--nodes",
        default="2,4,8,16,32",
        metavar="LIST",
        help="comma-separated node counts (default 2,4,8,16,32)",
    )
    sw.add_argument(
        "--plot-nodes",
        type=int,
        default=8,
        metavar="N",
        help="node count of the against-size panels (default 8)",
    )
    sw.add_argument(
        "--plot-size",
        type=size_arg,
        default=size_arg("256MiB"),
        metavar="SIZE",
        help="size of the against-nodes panels (default 256MiB)",
    )
    sw.add_argument(
        "--plot",
        metavar="FILE.png",
        type=writable_output("--plot"),
        help="write a figure (needs the [plot] extra: matplotlib)",
    )
    sw.add_argument("--dtype", choices=sorted(DTYPES), default="f32", help="element type")
    _common(sw, "100")
    sw.set_defaults(func=cmd_sweep)

    va = sub.add_parser(
        "validate",
        help="the RoCE models against published host all-reduce measurements",
        description="Run roce-ring (the MPI library as run) and roce-ideal (the hardware "
        "bound) on every row of the published sets in fpga_model/measurements/, each with "
        "the parameters of its own hosts, and print model / measured with its geometric "
        f"mean (issue bound [{BOUNDS[0]}, {BOUNDS[1]}] for roce-ring).",
    )
    va.add_argument(
        "--set", dest="set_key", metavar="KEY", help="only this set (default: every set)"
    )
    va.add_argument(
        "--plot",
        metavar="FILE.png",
        type=writable_output("--plot"),
        help="draw measured against modelled time and their ratio (needs the "
        "[plot] extra: matplotlib)",
    )
    va.add_argument("--json", action="store_true", help="print exactly one JSON object")
    va.set_defaults(func=cmd_validate)

    rp = sub.add_parser(
        "replay",
        help="a recorded trace's run, packet for packet, on NetDAM cards",
        description="Feed every collective call of a trace file (netdam allreduce --trace, "
        "netdam trace, netdam.api.trace) through the cycle model packet by packet: what "
        "received what from whom, what each datagram carried, what it answered or forwarded, "
        "the re-sends its losses caused and the NICs' start skew. Prints what that exact run "
        "would take on NetDAM cards (with the recorded skew, and without it), beside its wall "
        "clock in the emulator and the model's estimate of the same job run clean.",
    )
    rp.add_argument("trace", type=Path, metavar="TRACE.json", help="the trace file")
    rp.add_argument(
        "--rto-us",
        type=float,
        default=REPLAY_RTO_US,
        help=f"the cards' retransmit timeout in microseconds (default {REPLAY_RTO_US:g}: a "
        "few round trips of a chain at 100 Gb/s; an assumption, not a measurement)",
    )
    _common(rp, "100")
    rp.set_defaults(func=cmd_replay)

    om = sub.add_parser(
        "optimizer",
        help="steps/s of the optimizer in the cards' memory against a host optimizer",
        description="One training step of a model of MODEL_SIZE parameters over N nodes: on "
        "NetDAM cards, the gradients all-reduced by the chain and each card applying the rule "
        "to its 1/N of the parameters in its memory (UPDATE, SPEC.md 6.8); on RoCE hosts, the "
        "gradients all-reduced as Open MPI runs it, then every host applying the rule to all "
        "of them at its DRAM bandwidth (DDP + torch.optim). Memory-bound updates: assumptions, "
        "not measurements (fpga_model/optimizer.py).",
    )
    om.add_argument(
        "--model-size",
        type=_count_arg,
        required=True,
        metavar="P",
        help="parameters, e.g. 125M or 1.3B (K, M, B: 10^3, 10^6, 10^9)",
    )
    om.add_argument("--nodes", type=int, required=True, metavar="N", help="nodes (>= 2)")
    om.add_argument("--rule", choices=OPT_RULES, default="adam", help="update rule (adam)")
    om.add_argument(
        "--grad-dtype",
        choices=("f32", "bf16", "f16"),
        default="bf16",
        help="the gradients' dtype on the wire (bf16); masters and moments are f32",
    )
    _common(om, "100 and 200")
    om.set_defaults(func=cmd_optimizer)


def _count_arg(text: str) -> int:
    """A count with an optional K, M or B (10^3, 10^6, 10^9) suffix."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}
    number, unit = (text[:-1], scale[text[-1].upper()]) if text[-1:].upper() in scale else (text, 1)
    try:
        value = round(float(number) * unit)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a parameter count (e.g. 125M, 1.3B, 350000)"
        ) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a model has at least one parameter, got {text!r}")
    return value


def cmd_optimizer(args: argparse.Namespace) -> int:
    """Steps per second of the pool optimizer on the cards against DDP + torch.optim on RoCE."""
    grad_bytes = 4 if args.grad_dtype == "f32" else 2
    links = [args.link_gbps] if args.link_gbps is not None else [100.0, 200.0]
    rows = []
    for link in links:
        nd, ro, _ = _resolve(argparse.Namespace(**{**vars(args), "link_gbps": link}))
        try:
            card, host = optimizer_step(nd, ro, args.nodes, args.model_size, args.rule, grad_bytes)
            unfused, _ = optimizer_step(
                nd, ro, args.nodes, args.model_size, args.rule, grad_bytes, fused=False
            )
        except ValueError as exc:
            raise CommandError(str(exc), ExitCode.USAGE) from None
        rows.append((link, card, host, unfused))
    out: dict[str, Any] = {
        "ok": True,
        "model_size": args.model_size,
        "nodes": args.nodes,
        "rule": args.rule,
        "grad_dtype": args.grad_dtype,
        "links": [
            {
                "link_gbps": link,
                "netdam": card.as_dict(),
                "netdam_unfused": unfused.as_dict(),
                "roce": host.as_dict(),
                "speedup": card.steps_per_second / host.steps_per_second,
            }
            for link, card, host, unfused in rows
        ],
    }
    lines = [
        f"{args.rule} on {args.model_size:,} parameters, {args.grad_dtype} gradients, "
        f"{args.nodes} nodes (modelled; fpga_model/optimizer.py)"
    ]
    for link, card, host, unfused in rows:
        lines.append(
            f"  {link:g} Gb/s: NetDAM {card.steps_per_second:.2f} steps/s (all-reduce "
            f"{card.allreduce_s * 1e3:.3f} ms + the update the chain does not hide "
            f"{card.update_s * 1e3:.3f} ms; unfused {unfused.steps_per_second:.2f} steps/s); "
            f"RoCE host {host.steps_per_second:.2f} steps/s (all-reduce {host.allreduce_s * 1e3:.3f} "
            f"ms + torch.optim {host.update_s * 1e3:.3f} ms); "
            f"{card.steps_per_second / host.steps_per_second:.2f}x"
        )
    emit(out, args.json, "\n".join(lines))
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    """A recorded trace's calls through the cycle model."""
    # Imported here: the replay reads trace records with numpy, nothing else of the model needs.
    from netdam.tools.replay import replay_trace

    nd, _, _ = _resolve(args)
    if args.rto_us <= 0:
        raise CommandError(f"--rto-us must be positive, got {args.rto_us}", ExitCode.USAGE)
    try:
        trace = json.loads(args.trace.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CommandError(
            f"cannot read {args.trace} as a trace: {exc}; write one with netdam allreduce "
            "--trace FILE or netdam trace",
            ExitCode.USAGE,
        ) from None
    try:
        calls = replay_trace(trace, nd, args.rto_us * 1e-6)
    except (ValueError, KeyError, TypeError) as exc:
        raise CommandError(f"{args.trace}: {exc}", ExitCode.USAGE) from None
    if not calls:
        raise CommandError(
            f"{args.trace} holds no collective that started and completed on every NIC it "
            "names: trace a whole call (netdam allreduce --trace)",
            ExitCode.USAGE,
        )
    rows = [c.as_dict() for c in calls]
    out = {
        "ok": True,
        "link_gbps": nd.link_gbps,
        "params": nd.name,
        "rto_s": args.rto_us * 1e-6,
        "calls": rows,
    }
    lines = [f"replay of {args.trace} on {nd.name} ({nd.link_gbps:g} Gb/s)"]
    for c in calls:
        lines.append(
            f"  call {c.coll_id} epoch {c.epoch}: {c.nics} NICs x {format_size(c.nbytes)}: "
            f"emulator {c.wall_s * 1e3:.3f} ms; on the cards {c.replayed.seconds * 1e6:.2f} us "
            f"with the recorded skew ({c.replayed.skew_s * 1e6:.1f} us), "
            f"{c.no_skew.seconds * 1e6:.2f} us without; {c.no_skew.retries} re-sends; "
            f"model, the same job clean: {c.estimate_s * 1e6:.2f} us"
        )
    emit(out, args.json, "\n".join(lines))
    return int(ExitCode.OK)


# --- parameter resolution ---------------------------------------------------------------
def _resolve(args: argparse.Namespace) -> tuple[NetdamParams, RoceParams, str | None]:
    """NetDAM and RoCE parameters from presets, --preset, --params and --link-gbps.

    Returns them and the kind the user named through --preset/--params (None if both or none).
    """
    link = args.link_gbps
    if link is not None and link <= 0:
        raise CommandError(f"--link-gbps must be positive, got {link}", ExitCode.USAGE)
    try:
        nd_name, ro_name = default_presets(link if link is not None else 100.0)
        nd, ro = load_preset(nd_name), load_preset(ro_name)
        named: set[str] = set()
        if args.preset:
            chosen = load_preset(args.preset)
            named.add(chosen.kind)
            if isinstance(chosen, NetdamParams):
                nd = chosen
            else:
                ro = chosen
        if args.params:
            pset = load_params_file(args.params)
            if pset.netdam is not None:
                nd = pset.netdam
                named.add("netdam")
            if pset.roce is not None:
                ro = pset.roce
                named.add("roce")
        if link is not None:
            nd, ro = with_link(nd, link), with_link(ro, link)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    assert isinstance(nd, NetdamParams) and isinstance(ro, RoceParams)
    return nd, ro, (named.pop() if len(named) == 1 else None)


def _system(args: argparse.Namespace) -> NicParams:
    nd, ro, named = _resolve(args)
    kind = args.system or named or "netdam"
    return nd if kind == "netdam" else ro


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    last = len(headers) - 1
    out += [
        "  ".join(
            c.rjust(w) if 0 < i < last else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))
        ).rstrip()
        for r in rows
    ]
    return "\n".join(out)


def _guard(func: Any) -> Any:
    """Report CommandError as the project does (JSON object with error), return its code."""

    def run(args: argparse.Namespace) -> int:
        try:
            code: int = func(args)
            return code
        except CommandError as exc:
            if args.json:
                emit({"ok": False, "error": str(exc)}, True)
            else:
                print(f"error: {exc}", file=sys.stderr)
            return int(exc.code)

    run.__doc__ = func.__doc__
    return run


# --- op ------------------------------------------------------------------------------
@_guard
def cmd_op(args: argparse.Namespace) -> int:
    """Latency breakdown of one instruction."""
    p = _system(args)
    dtype = DTYPES[args.dtype]
    nbytes = (
        args.count * dtype
        if args.count is not None
        else (args.bytes if args.bytes is not None else 128)
    )
    op = args.op
    if isinstance(p, RoceParams) and op == "add-store":
        raise CommandError("RoCE has no add-store; use add (a host ring step)", ExitCode.USAGE)
    try:
        b = op_breakdown(
            p, op, nbytes, args.sr_segments if isinstance(p, NetdamParams) else 0, dtype
        )
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    out: dict[str, Any] = {"ok": True, "system_description": describe_system(p), **b.as_dict()}
    if args.des:
        r = des.unloaded(list(b.stages), packets=400, seed=1)
        out["des"] = r.as_dict()
    rows = [
        [
            s["name"],
            f"{s['seconds'] * 1e9:.1f}",
            "" if s["cycles"] is None else f"{s['cycles']:g} @ {s['clock_hz'] / 1e6:.1f} MHz",
            s["note"],
        ]
        for s in out["stages"]
    ]
    text = (
        f"{describe_system(p)}\n{op.upper()} of {nbytes} B: {b.seconds * 1e9:.1f} ns wire to "
        f"wire (request frame {b.shape.request_frame_bytes} B, response frame "
        f"{b.shape.response_frame_bytes} B)\n\n" + _table(["stage", "ns", "cycles", "what"], rows)
    )
    if args.des:
        d = out["des"]
        text += (
            f"\n\nDES ({d['delivered']} packets): mean {d['latency_mean_s'] * 1e9:.1f} ns, "
            f"p99 {d['latency_p99_s'] * 1e9:.1f} ns, max {d['latency_max_s'] * 1e9:.1f} ns"
        )
    emit(out, args.json, text)
    return int(ExitCode.OK)


# --- line-rate -----------------------------------------------------------------------
@_guard
def cmd_line_rate(args: argparse.Namespace) -> int:
    """Packets/s and goodput of a saturated stream."""
    p = _system(args)
    if args.mtu is not None:
        if args.mtu < 68 or args.mtu > 65535:
            raise CommandError(f"--mtu must be 68..65535, got {args.mtu}", ExitCode.USAGE)

        p = dataclasses.replace(p, mtu=args.mtu)
    try:
        if args.frame is not None:
            if args.frame > p.mtu + wire.ETH_HEADER_BYTES + wire.FCS_BYTES:
                raise ValueError(f"--frame {args.frame} exceeds MTU {p.mtu} + 18 B of L2 framing")
            payload = wire.udp_payload_for_frame(args.frame)
        else:
            payload = args.payload if args.payload is not None else p.mtu - wire.IP_UDP_BYTES
        if isinstance(p, RoceParams) and args.payload is None and args.frame is None:
            payload = p.roce_mtu_bytes + wire.ROCE_BTH_BYTES + wire.ROCE_ICRC_BYTES
        lr = line_rate(p, payload, args.op)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    out: dict[str, Any] = {"ok": True, "system": p.kind, "params": p.name, **lr.as_dict()}
    text_extra = ""
    if args.des:
        stages = line_rate_stages(p, payload, args.op)
        r = des.saturated(stages, packets=3000, seed=1)
        out["des"] = r.as_dict()
        out["des_vs_model"] = r.throughput_pps / lr.pps
        text_extra = (
            f"\nDES: {r.throughput_pps / 1e6:.3f} Mpps "
            f"({out['des_vs_model']:.4f} of the analytic rate), latency p50 "
            f"{r.latency_p50_s * 1e9:.0f} ns, p99 {r.latency_p99_s * 1e9:.0f} ns"
        )
    rows = [
        [name, f"{mpps:.3f}", "<- bottleneck" if name == lr.bottleneck else ""]
        for name, mpps in lr.stage_mpps.items()
    ]
    text = (
        f"{describe_system(p)}\n{args.op}: UDP payload {payload} B, frame {lr.frame_bytes} B, "
        f"{lr.wire_bytes} B on the wire\n{lr.pps / 1e6:.3f} Mpps, goodput "
        f"{lr.goodput_gbps:.2f} Gb/s (data {lr.data_gbps:.2f} Gb/s), bottleneck "
        f"{lr.bottleneck}\n\n" + _table(["stage", "Mpps", ""], rows) + text_extra
    )
    emit(out, args.json, text)
    return int(ExitCode.OK)


# --- allreduce -----------------------------------------------------------------------
@_guard
def cmd_allreduce(args: argparse.Namespace) -> int:
    """Modelled all-reduce time of one algorithm."""
    nd, ro, _ = _resolve(args)
    dtype = DTYPES[args.dtype]
    plt = plotting.pyplot() if args.plot else None  # before the work: a missing extra is usage
    try:
        chain = _chain(args.nodes, args.size, nd, ro, dtype)
        est = allreduce(args.algo, args.nodes, args.size, nd, ro, dtype) if args.algo else chain
        # NetDAM beside both RoCE baselines: the hardware bound and the MPI-library model.
        # Past one SR list's 64 hops both ways of scaling a chain: the longer list, the 2-D chains.
        scaled = (
            ("netdam-chain-2d",)
            if args.nodes > CHAIN_GROUP + 1 and chain.algo == "netdam-chain"
            else ()
        )
        side = {
            chain.algo: chain,
            **{
                a: allreduce(a, args.nodes, args.size, nd, ro, dtype)
                for a in (*scaled, "roce-ideal", "roce-ring")
            },
        }
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    out: dict[str, Any] = {
        "ok": True,
        **est.as_dict(),
        "dtype": args.dtype,
        "ratio_vs_chain": est.seconds / chain.seconds,
        "chain_algo": chain.algo,
        "compare": {
            a: {"seconds": e.seconds, "busbw_gbps": e.busbw_gbps, "bottleneck": e.bottleneck}
            for a, e in side.items()
        },
    }
    terms = "\n".join(f"  {k}: {v * 1e6:.2f} us" for k, v in est.terms.items())
    if est.algorithm:
        terms = f"  host algorithm: {est.algorithm} ({ro.coll_decision})\n" + terms
    text = (
        f"{est.algo}, {args.nodes} nodes, {format_size(args.size)} per node at "
        f"{est.link_gbps:g} Gb/s ({est.params})\n"
        f"time {est.seconds * 1e6:.2f} us, algbw {est.algbw_gbps:.2f} Gb/s, "
        f"busbw {est.busbw_gbps:.2f} Gb/s, bottleneck {est.bottleneck}, "
        f"{out['ratio_vs_chain']:.2f}x {chain.algo}\n{terms}\n"
        + "\n".join(
            f"  vs {a}: {e.seconds * 1e6:.2f} us, busbw {e.busbw_gbps:.2f} Gb/s ({e.bottleneck})"
            for a, e in side.items()
        )
    )
    sharp = SHARP_128_HOSTS.get(args.size) if args.nodes == 128 else None
    if sharp is not None:
        out["reference_sharp"] = {"seconds": sharp[0], "seconds_host_based": sharp[1]}
        text += (
            f"\n  published, InfiniBand SHARP on 128 hosts: {sharp[0] * 1e6:.2f} us, host-based "
            f"{sharp[1] * 1e6:.2f} us (measured hardware, not this model)"
        )
    if plt is not None:
        _plot_allreduce(plt, args, nd, ro, dtype)
        out["plot"] = str(args.plot)
        text += f"\n\nplot written to {args.plot}"
    emit(out, args.json, text)
    return int(ExitCode.OK)


def _chain(
    nodes: int, size: int, nd: NetdamParams, ro: RoceParams, dtype: int
) -> AllreduceEstimate:
    """NetDAM's chain for this job: one SR list over every node where it fits in a packet with
    room for data, else the chains of netdam-chain-2d."""
    try:
        return allreduce("netdam-chain", nodes, size, nd, ro, dtype)
    except ValueError:
        return allreduce("netdam-chain-2d", nodes, size, nd, ro, dtype)


# --- sweep ---------------------------------------------------------------------------
def _parse_nodes(text: str) -> list[int]:
    try:
        nodes = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise CommandError(
            f"--nodes wants comma-separated integers, got {text!r}", ExitCode.USAGE
        ) from None
    if not nodes or nodes[0] < 2:
        raise CommandError("--nodes: every node count must be >= 2", ExitCode.USAGE)
    return nodes


@_guard
def cmd_sweep(args: argparse.Namespace) -> int:
    """Every algorithm against size and node count."""
    nd, ro, _ = _resolve(args)
    dtype = DTYPES[args.dtype]
    nodes = _parse_nodes(args.nodes)
    plt: Any = plotting.pyplot() if args.plot else None
    points = sorted(
        {(n, size) for n in nodes for size in args.sizes}
        | {(args.plot_nodes, size) for size in args.sizes}
        | {(n, args.plot_size) for n in nodes}
    )
    rows: list[dict[str, Any]] = []
    try:
        for algo in ALGOS:
            for n, size in points:
                e = allreduce(algo, n, size, nd, ro, dtype)
                rows.append(
                    {
                        k: v
                        for k, v in e.as_dict().items()
                        if k not in ("terms_seconds", "params", "link_gbps")
                    }
                )
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    if plt is not None:
        _plot(plt, rows, args.plot, args.plot_nodes, args.plot_size, nd.link_gbps)
    out: dict[str, Any] = {
        "ok": True,
        "link_gbps": nd.link_gbps,
        "netdam_params": nd.name,
        "roce_params": ro.name,
        "plot": args.plot,
        "rows": rows,
    }
    pick = [r for r in rows if r["nodes"] == args.plot_nodes and r["bytes"] in args.sizes]
    by_size: dict[int, dict[str, float]] = {}
    for r in pick:
        by_size.setdefault(r["bytes"], {})[r["algo"]] = r["busbw_gbps"]
    table = _table(
        ["size"] + [f"{a} busbw" for a in ALGOS],
        [
            [format_size(s)] + [f"{v.get(a, 0.0):.1f}" for a in ALGOS]
            for s, v in sorted(by_size.items())
        ],
    )
    text = (
        f"all-reduce busbw in Gb/s (10^9 bit/s, as the links), {args.plot_nodes} nodes, {nd.link_gbps:g} Gb/s links "
        f"({nd.name} / {ro.name})\n\n{table}"
        + (f"\n\nplot written to {args.plot}" if args.plot else "")
    )
    emit(out, args.json, text)
    return int(ExitCode.OK)


def _plot(
    plt: Any, rows: list[dict[str, Any]], path: str, nodes: int, size: int, link: float
) -> None:
    """Four questions, four panels: time and busbw against size (at *nodes*) and against node
    count (at *size*); one colour and marker per algorithm, dashed as every model line."""
    fig, axes = plotting.figure(plt, 2, 2)
    for index, algo in enumerate(ALGOS):
        style = plotting.series_style(index, algo, model=True)
        by_size = sorted((r["bytes"], r) for r in rows if r["algo"] == algo and r["nodes"] == nodes)
        by_nodes = sorted((r["nodes"], r) for r in rows if r["algo"] == algo and r["bytes"] == size)
        for ax, points, key, scale in (
            (axes[0], by_size, "seconds", 1e6),
            (axes[1], by_size, "busbw_gbps", 1.0),
            (axes[2], by_nodes, "seconds", 1e6),
            (axes[3], by_nodes, "busbw_gbps", 1.0),
        ):
            ax.plot([x for x, _ in points], [r[key] * scale for _, r in points], **style)
    for ax in axes[:2]:
        plotting.size_axis(ax)
    for ax in axes[2:]:
        plotting.nodes_axis(ax, sorted({r["nodes"] for r in rows if r["bytes"] == size}))
    for ax in (axes[0], axes[2]):
        ax.set_yscale("log")
    axes[0].set(ylabel="time (us)", title=f"time against size, {nodes} nodes")
    axes[1].set(ylabel="busbw (Gb/s)", title=f"busbw against size, {nodes} nodes")
    axes[2].set(ylabel="time (us)", title=f"time against nodes, {format_size(size)} per node")
    axes[3].set(ylabel="busbw (Gb/s)", title=f"busbw against nodes, {format_size(size)} per node")
    plotting.finish(
        fig,
        path,
        f"Modelled all-reduce, {link:g} Gb/s links (netdam fpga_model)",
        plotting.Key().colors(ALGOS).sources(None, "model"),
    )


# --- validate -------------------------------------------------------------------------
@_guard
def cmd_validate(args: argparse.Namespace) -> int:
    """The RoCE models against published host all-reduce measurements."""
    plt: Any = plotting.pyplot() if args.plot else None
    try:
        sets = load_sets()
    except (OSError, ValueError, KeyError) as exc:
        raise CommandError(
            f"cannot read the measurement sets: {exc}", ExitCode.RUN_FAILED
        ) from None
    if args.set_key is not None:
        sets = [s for s in sets if s.key == args.set_key]
        if not sets:
            known = ", ".join(s.key for s in load_sets())
            raise CommandError(
                f"no measurement set {args.set_key!r}; known: {known}", ExitCode.USAGE
            )
    ring = [compare_set(s, "roce-ring") for s in sets]
    ideal = [compare_set(s, "roce-ideal") for s in sets]
    out: dict[str, Any] = {"ok": True, "bounds": list(BOUNDS), "sets": []}
    text: list[str] = []
    for r, i in zip(ring, ideal):
        m = r.measured
        out["sets"].append(
            {
                "key": m.key,
                "title": m.title,
                "citation": m.citation,
                "library": m.library,
                "hosts": m.hosts,
                "metric": m.metric,
                "roce_ring": r.as_dict(),
                "roce_ideal": i.as_dict(),
            }
        )
        rows = [
            [
                str(a.point.nodes),
                format_size(a.point.nbytes),
                f"{a.point.seconds * 1e6:.1f}",
                f"{a.model_seconds * 1e6:.1f}",
                f"{a.ratio:.2f}",
                f"{b.ratio:.2f}",
                a.algorithm,
            ]
            for a, b in zip(r.rows, i.rows)
            if a.point.nbytes >= m.validate_from_bytes
        ]
        by_nodes = ", ".join(f"{n}: {g:.2f}" for n, g in r.geomean_by_nodes().items())
        text.append(
            f"{m.key}: {m.title}\n  source: {m.citation}\n  hosts: {m.hosts}; library: "
            f"{m.library}; measured: {m.metric}; model parameters: {m.params.name}\n\n"
            + _table(
                [
                    "nodes",
                    "size",
                    "measured us",
                    "roce-ring us",
                    "ring/meas",
                    "ideal/meas",
                    "host algorithm",
                ],
                rows,
            )
            + f"\n\n  geometric mean from {format_size(m.validate_from_bytes)} up: roce-ring "
            f"{r.geomean:.2f} (by nodes {by_nodes}), roce-ideal {i.geomean:.2f}; bound "
            f"[{BOUNDS[0]}, {BOUNDS[1]}]: {'within' if BOUNDS[0] <= r.geomean <= BOUNDS[1] else 'OUTSIDE'}"
        )
    if plt is not None:
        _plot_validation(plt, ring, ideal, args.plot)
        out["plot"] = str(args.plot)
        text.append(f"plot written to {args.plot}")
    emit(out, args.json, "\n\n".join(text))
    return int(ExitCode.OK)


def _plot_validation(
    plt: Any, ring: list[SetComparison], ideal: list[SetComparison], path: str
) -> None:
    """Per set: measured times (solid) against roce-ring (dashed) and roce-ideal (dotted) for a
    few node counts, and roce-ring / measured for every node count with the issue's bounds
    shaded; one colour per node count across the figure."""
    fig, axes = plotting.figure(plt, 2, len(ring))
    tops, bottoms = axes[: len(ring)], axes[len(ring) :]
    every = sorted({a.point.nodes for r in ring for a in r.rows})
    labels = [f"{n} nodes" for n in every]
    for top, bottom, r, i in zip(tops, bottoms, ring, ideal):
        nodes = sorted({a.point.nodes for a in r.rows})
        shown = [n for n in nodes if n in (2, 4, 8)] or nodes
        for n in nodes:
            index, label = every.index(n), f"{n} nodes"
            measured = plotting.series_style(index, label, order=labels)
            pts = sorted((a.point.nbytes, a) for a in r.rows if a.point.nodes == n)
            xs = [x for x, _ in pts]
            bottom.plot(xs, [a.ratio for _, a in pts], **measured)
            if n not in shown:
                continue
            ids = sorted((b.point.nbytes, b) for b in i.rows if b.point.nodes == n)
            top.plot(xs, [a.point.seconds * 1e6 for _, a in pts], **measured)
            top.plot(
                xs,
                [a.model_seconds * 1e6 for _, a in pts],
                **plotting.series_style(index, label, model=True, order=labels),
            )
            top.plot(
                [x for x, _ in ids],
                [b.model_seconds * 1e6 for _, b in ids],
                color=measured["color"],
                linestyle=":",
                linewidth=1.2,
            )
        bottom.axhspan(BOUNDS[0], BOUNDS[1], color="0.9", zorder=0)
        bottom.axhline(1.0, color="black", linewidth=0.8)
        bottom.axvline(r.measured.validate_from_bytes, color="0.5", linewidth=1.0)
        for ax in (top, bottom):
            plotting.size_axis(ax)
        top.set_yscale("log")
        top.set(ylabel="time (us)", title=f"{r.measured.key}: time against size")
        bottom.set(
            ylabel="roce-ring / measured",
            title=f"geometric mean {r.geomean:.2f} (roce-ideal {i.geomean:.2f})",
        )
    key = (
        plotting.Key()
        .colors(labels, labels)
        .sources("measured", "roce-ring model")
        .line("roce-ideal model", linestyle=":")
        .patch(f"issue bound [{BOUNDS[0]}, {BOUNDS[1]}]", facecolor="0.9", edgecolor="0.9")
        .line("first validated size", color="0.5", linewidth=1.0)
    )
    plotting.finish(fig, path, "roce-ring against published host all-reduce times", key)


def _plot_allreduce(plt: Any, args: argparse.Namespace, nd: Any, ro: Any, dtype: Any) -> None:
    """`model allreduce --plot`: the algorithm (and netdam-chain beside it) against size, from
    4 KiB to 4 x --size; the asked size is a grey line the legend names (a label in the panel
    would sit on the curves)."""
    top = max(4 * args.size, 1 << 20)
    sizes = [1 << k for k in range(12, top.bit_length()) if 1 << k <= top]
    algos = [args.algo] + (["netdam-chain"] if args.algo != "netdam-chain" else [])
    fig, (ax_t, ax_b) = plotting.figure(plt, 1, 2)
    for index, algo in enumerate(algos):
        style = plotting.series_style(index, algo, model=True)
        ests = [allreduce(algo, args.nodes, s, nd, ro, dtype) for s in sizes]
        ax_t.plot(sizes, [e.seconds * 1e6 for e in ests], **style)
        ax_b.plot(sizes, [e.busbw_gbps for e in ests], **style)
    asked = allreduce(args.algo, args.nodes, args.size, nd, ro, dtype)
    for ax in (ax_t, ax_b):
        ax.axvline(args.size, color="0.5", linewidth=1.0, zorder=1)
        plotting.size_axis(ax)
    ax_t.set_yscale("log")
    ax_t.set(ylabel="time (us)", title="time against size")
    ax_b.set(ylabel="busbw (Gb/s)", title="busbw against size (nccl-tests' definition)")
    key = (
        plotting.Key()
        .colors(algos)
        .sources(None, "model")
        .line(
            f"asked: {format_size(args.size)}, {args.algo} {asked.seconds * 1e6:.1f} us, "
            f"busbw {asked.busbw_gbps:.1f} Gb/s",
            color="0.5",
            linewidth=1.0,
        )
    )
    plotting.finish(
        fig, args.plot, f"Modelled all-reduce, {args.nodes} nodes, {nd.link_gbps:g} Gb/s links", key
    )
