"""``netdam pool alloc|free|query|write|read|list|stats|quota`` and ``netdam switch``: the memory pool.

alloc, free, query and list talk to the switch's VIP with ALLOC, FREE and QUERY (SPEC.md 11.9),
the datagrams any client may send."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from netdam.cli.common import (
    CommandError,
    ExitCode,
    Subparsers,
    bounded_int,
    cluster_file,
    emit,
    readable_file,
    size_arg,
)
from netdam.cluster.clusterfile import load_cluster
from netdam.cluster.control import ControlClient, ControlError
from netdam.cluster.secrets_io import (
    KeyFileError,
    read_key_file,
    read_tag_key_file,
    tag_key_text,
    write_private,
)
from netdam.protocol.constants import Opcode, Status
from netdam.protocol.packet import Packet
from netdam.switch.addrmap import region_to_json
from netdam.switch.cli import add_switch_arguments, run_switch
from netdam.units import format_size

if TYPE_CHECKING:
    from netdam.clients.pool import PoolClient

T = TypeVar("T")

#: What `pool read --format` offers (the first is the default).
READ_FORMATS = ("hex", "text", "raw")


def _int(text: str) -> int:
    try:
        return int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid number {text!r}: write decimal or 0x hex"
        ) from None


def _rights(text: str) -> int:
    bits = {"r": 1, "w": 2, "a": 4}
    if not text or any(c not in bits for c in text):
        raise argparse.ArgumentTypeError(
            f"invalid rights {text!r}: letters r (READ), w (WRITE), a (ATOMIC), e.g. rwa"
        )
    return sum(bits[c] for c in set(text))


def _credential(text: str) -> int:
    try:
        value = int(text, 0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid credential {text!r}: give the 0x... value alloc printed"
        ) from None
    if not 0 < value < 1 << 64:
        raise argparse.ArgumentTypeError(f"credential {text!r} must be a non-zero 64-bit number")
    return value


def _quota_bytes(text: str) -> tuple[int | None, float | None]:
    """--bytes: (bytes, None) for a size, (None, percent) for PCT%."""
    if text.endswith("%"):
        try:
            percent = float(text[:-1])
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid share {text!r}: give a percent, e.g. 25%"
            ) from None
        if not 0 <= percent <= 100:
            raise argparse.ArgumentTypeError(f"share {text!r} must be 0%..100%")
        return None, percent
    return size_arg(text), None


def _credential_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    given = parser.add_mutually_exclusive_group()
    given.add_argument(
        "--credential",
        type=_credential,
        default=None,
        help=f"{what}; on a command line every local user sees it (ps): prefer --credential-file",
    )
    given.add_argument(
        "--credential-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="read the credential from FILE (mode 0600; alloc --save-credential writes one)",
    )


def _credential_of(args: argparse.Namespace) -> int | None:
    """The tenant credential of --credential or --credential-file (None: the admin key)."""
    path = getattr(args, "credential_file", None)
    if path is None:
        return getattr(args, "credential", None)
    try:
        return read_key_file(path, what="tenant credential", bits=64)
    except KeyFileError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None


def register(subparsers: Subparsers) -> None:

    sw = subparsers.add_parser(
        "switch",
        help="run one pool switch (VIP, address map, multicast)",
        description="Run the switch of a cluster: clients send to --vip, the "
        "switch translates global addresses and forwards to the nodes (which "
        "must list the VIP in --members; `netdam up --switch` does it all).",
    )
    add_switch_arguments(sw)
    sw.set_defaults(func=run_switch)

    pool = subparsers.add_parser(
        "pool",
        help="allocate, free, write and read pooled memory",
        description="The memory pool behind the switch's virtual IP. Every "
        "command takes the cluster file of `netdam up --switch`.",
    )
    cmds = pool.add_subparsers(dest="pool_command", metavar="COMMAND", parser_class=type(pool))
    cmds.required = True

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--cluster", type=cluster_file, required=True, help="cluster file (netdam up --switch)"
        )
        p.add_argument("--json", action="store_true")

    alloc = cmds.add_parser("alloc", help="allocate a region: prints its global address and rkey")
    common(alloc)
    alloc.add_argument("--size", type=size_arg, required=True, help="bytes (e.g. 64KiB)")
    alloc.add_argument(
        "--interleave",
        type=size_arg,
        default=None,
        help="interleave over nodes with this stride (e.g. 8KiB); default: one node",
    )
    alloc.add_argument(
        "--ways",
        type=bounded_int(1, 64),
        default=None,
        help="nodes to interleave over, at most the cluster's (default all)",
    )
    alloc.add_argument("--rights", type=_rights, default=7, help="r, w, a letters (default rwa)")
    alloc.add_argument(
        "--tenant", default="", help="a label stored with the region (at most 16 bytes)"
    )
    _credential_arguments(
        alloc,
        "allocate for the tenant of this credential (default: a new tenant, "
        "with the cluster file's admin key)",
    )
    alloc.add_argument(
        "--save-credential",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the tenant's credential to FILE, mode 0600, for --credential-file",
    )
    alloc.add_argument(
        "--save-tag-key",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the region's tag key (32 hex digits) to FILE, mode 0600: its requests are "
        "sealed under it (SPEC 2.6); read and write take it with --tag-key-file",
    )
    alloc.add_argument(
        "--untagged",
        action="store_true",
        help="a region its rkey alone opens, for clients of SPEC v1 before tags (2.6): "
        "whoever sees one of its datagrams can use it",
    )
    alloc.set_defaults(func=run_alloc)

    free = cmds.add_parser("free", help="free a region")
    common(free)
    free.add_argument("--gaddr", type=_int, required=True, help="the region's global address")
    _credential_arguments(free, "the tenant credential alloc printed (default: the admin key)")
    free.set_defaults(func=run_free)

    query = cmds.add_parser("query", help="describe a region (QUERY on the wire)")
    common(query)
    query.add_argument(
        "--gaddr", type=_int, required=True, help="the first region at or after this address"
    )
    _credential_arguments(query, "the tenant credential alloc printed (default: the admin key)")
    query.set_defaults(func=run_query)

    write = cmds.add_parser("write", help="write bytes at a global address")
    common(write)
    write.add_argument("--gaddr", type=_int, required=True)
    write.add_argument(
        "--rkey", type=_int, default=None, help="default: the region's, from the state file"
    )
    write.add_argument(
        "--tag-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the region's tag key (alloc --save-tag-key); default: from the state file",
    )
    source = write.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="UTF-8 text to write")
    source.add_argument("--hex", help="hex bytes to write")
    source.add_argument("--file", type=readable_file, help="file whose bytes to write")
    write.set_defaults(func=run_write)

    read = cmds.add_parser("read", help="read bytes at a global address")
    common(read)
    read.add_argument("--gaddr", type=_int, required=True)
    read.add_argument("--length", type=size_arg, required=True)
    read.add_argument(
        "--rkey", type=_int, default=None, help="default: the region's, from the state file"
    )
    read.add_argument(
        "--tag-key-file",
        type=Path,
        default=None,
        metavar="FILE",
        help="the region's tag key (alloc --save-tag-key); default: from the state file",
    )
    read.add_argument(
        "--format",
        choices=READ_FORMATS,
        default=None,
        help="hex (default): the bytes as hex digits; text: decoded as UTF-8, undecodable "
        "bytes and control characters as \\xNN, a backslash as \\\\; raw: the exact bytes, "
        "nothing else (for a pipe or a file). Not with --json, which always gives hex",
    )
    read.set_defaults(func=run_read)

    listing = cmds.add_parser("list", help="regions and groups of the pool")
    common(listing)
    listing.set_defaults(func=run_list)

    stats = cmds.add_parser("stats", help="the switch's counters: per port and per region")
    common(stats)
    stats.set_defaults(func=run_stats)

    quota = cmds.add_parser(
        "quota",
        help="tenants' quotas and use; set the default or a tenant's",
        description="What a tenant may hold of the pool: bytes and regions "
        "(SPEC.md 11.9). Without --bytes or --regions: print every quota and "
        "each tenant's use. The admin key's own ALLOCs are never limited. "
        "Writes the pool state file (run it where the switch's state file is).",
    )
    common(quota)
    who = quota.add_mutually_exclusive_group()
    who.add_argument(
        "--default", action="store_true", help="the quota of tenants without their own"
    )
    who.add_argument(
        "--tenant",
        metavar="LABEL_OR_DIGEST_PREFIX",
        default=None,
        help="one tenant: its label, or the start of its credential's digest (quota shows them)",
    )
    quota.add_argument(
        "--bytes",
        type=_quota_bytes,
        default=None,
        metavar="SIZE|PCT%",
        help="bytes the tenant may hold: a size (e.g. 64MiB) or a share of the pool (e.g. 25%%)",
    )
    quota.add_argument(
        "--regions",
        type=bounded_int(0, 1 << 31),
        default=None,
        metavar="N",
        help="regions the tenant may hold",
    )
    quota.set_defaults(func=run_quota)


def _controller(args: argparse.Namespace) -> Any:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.cli.running import check_not_stale
    from netdam.switch.controller import ControllerError, PoolController

    try:
        check_not_stale(args.cluster, load_cluster(args.cluster))
        return PoolController(args.cluster, credential=_credential_of(args))
    except (ControllerError, ValueError) as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None


def _region_json(region: Any) -> dict[str, Any]:

    data: dict[str, Any] = dict(region_to_json(region))
    data.pop("owner", None)
    # A tagged region's key stays in the 0600 state file and the tenant's ALLOC answer: never
    # printed (a terminal, a CI log and `ps` of a pipe are not key stores).
    data["tagged"] = bool(data.pop("tag_key", ""))
    data["gaddr_hex"] = f"0x{region.gaddr:x}"
    data["rkey_hex"] = f"0x{region.rkey:08x}"
    if region.extra.get("credential"):
        data["credential"] = f"0x{region.extra['credential']:016x}"
    return data


def run_alloc(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import ControllerError

    try:
        nodes = len(load_cluster(args.cluster).nodes)
    except ValueError as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    if args.ways is not None and args.ways > nodes:
        raise CommandError(
            f"--ways {args.ways} but {args.cluster} has {nodes} nodes: give 1..{nodes}",
            ExitCode.USAGE,
        )
    if args.ways is not None and args.interleave is None:
        raise CommandError(
            "--ways needs --interleave STRIDE (without it a region lives on one node)",
            ExitCode.USAGE,
        )
    ctl = _controller(args)
    try:
        region = ctl.alloc(
            args.size,
            args.interleave,
            ways=args.ways,
            rights=args.rights,
            tenant=args.tenant,
            tagged=not args.untagged,
        )
    except ControllerError as exc:
        if exc.status == Status.NO_SPACE:
            raise CommandError(_no_room(ctl, args), ExitCode.USAGE) from None
        if exc.status == Status.QUOTA:  # as NO_SPACE: a request the pool will not grant as it is
            raise CommandError(str(exc), ExitCode.USAGE) from None
        raise CommandError(str(exc), ExitCode.RUN_FAILED) from None
    vip = ctl.switch.vip
    credential = int(region.extra.get("credential", 0))
    if args.save_credential is not None and credential:
        try:
            write_private(args.save_credential, f"0x{credential:016x}\n")
        except OSError as exc:
            raise CommandError(
                f"--save-credential {args.save_credential}: {exc.strerror}: the region "
                f"0x{region.gaddr:x} is allocated; its credential is 0x{credential:016x}",
                ExitCode.RUN_FAILED,
            ) from None
    if args.save_tag_key is not None and region.tag_key:
        try:
            write_private(args.save_tag_key, tag_key_text(region.tag_key))
        except OSError as exc:
            raise CommandError(
                f"--save-tag-key {args.save_tag_key}: {exc.strerror}: the region 0x{region.gaddr:x} "
                "is allocated; `netdam pool read/write` find its key in the state file",
                ExitCode.RUN_FAILED,
            ) from None
    text = (
        f"gaddr 0x{region.gaddr:x} rkey 0x{region.rkey:08x} size {region.size} "
        f"stride {region.stride} ways {len(region.ways)} vip {vip[0]}:{vip[1]} "
        f"credential 0x{region.extra.get('credential', 0):016x}"
    )
    emit({"ok": True, **_region_json(region), "vip": f"{vip[0]}:{vip[1]}"}, args.json, text=text)
    return ExitCode.OK


def _no_room(ctl: Any, args: argparse.Namespace) -> str:
    """ALLOC refused for room: what the pool has free and what really helps (the switch's NACK
    carries only the status; its state file has the map)."""
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import ControllerError, room_hint

    head = f"no room for {format_size(args.size)} in the pool of {args.cluster}"
    try:
        return f"{head}: {room_hint(ctl.state(), args.size, args.interleave)}"
    except (ControllerError, OSError):  # no readable state file: say what is certain
        return (
            f"{head}: free regions (`netdam pool list` shows them), or start the cluster with more "
            "memory per node (`netdam up --switch --memory SIZE`)"
        )


def run_free(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import ControllerError

    try:
        region = _controller(args).free(args.gaddr)
    except ControllerError as exc:
        raise CommandError(str(exc), ExitCode.RUN_FAILED) from None
    emit({"ok": True, "freed": _region_json(region)}, args.json, text=f"freed 0x{region.gaddr:x}")
    return ExitCode.OK


def run_query(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import ControllerError

    try:
        region = _controller(args).query(args.gaddr)
    except ControllerError as exc:
        raise CommandError(str(exc), ExitCode.RUN_FAILED) from None
    emit(
        {"ok": True, **_region_json(region)},
        args.json,
        text=f"0x{region.gaddr:x} size {region.size} rkey 0x{region.rkey:08x} stride {region.stride} "
        f"ways {[w.node for w in region.ways]} {region.tenant}".rstrip(),
    )
    return ExitCode.OK


def _target(args: argparse.Namespace) -> tuple[Any, int, int, dict[int, bytes]]:
    """(controller, rkey, stride, tag keys) for args.gaddr: a tagged region's key comes from
    the state file with the rest of the region (SPEC.md 2.6)."""
    ctl = _controller(args)
    region = next((r for r in ctl.regions() if r.gaddr <= args.gaddr < r.end), None)
    rkey = args.rkey if args.rkey is not None else (region.rkey if region else None)
    if rkey is None:
        raise CommandError(
            f"0x{args.gaddr:x} is in no region of this pool: pass --rkey, or "
            "allocate with `netdam pool alloc`",
            ExitCode.USAGE,
        )
    from netdam.clients.pool import tag_keys_of  # imported here: see _with_client

    keys = tag_keys_of(region) if region else {}
    if args.tag_key_file is not None:
        try:
            keys = {rkey: read_tag_key_file(args.tag_key_file)}
        except KeyFileError as exc:
            raise CommandError(str(exc), ExitCode.USAGE) from None
    return ctl, rkey, region.stride if region else 0, keys


def _with_client(ctl: Any, keys: dict[int, bytes], action: Callable[[PoolClient], T]) -> T:
    """*action*(a PoolClient of ctl's pool), a failed request raised as a CommandError."""
    # Imported here: the client loads numba and its tag kernel (~1 s), which every other
    # command (even `netdam --version`) would pay at start-up otherwise.
    from netdam.clients.pool import PoolClient, PoolError

    try:
        with PoolClient(ctl.switch.vip, mtu=ctl.cluster.mtu, tag_keys=keys) as client:
            return action(client)
    except PoolError as exc:
        code = ExitCode.RUN_FAILED if exc.status is None else ExitCode.CHECK_FAILED
        raise CommandError(str(exc), code) from None


def run_write(args: argparse.Namespace) -> int:

    ctl, rkey, stride, keys = _target(args)
    if args.data is not None:
        data = args.data.encode()
    elif args.hex is not None:
        try:
            data = bytes.fromhex(args.hex)
        except ValueError:
            raise CommandError("--hex takes hex digits, e.g. 00ff10", ExitCode.USAGE) from None
    else:
        data = args.file.read_bytes()
    _with_client(ctl, keys, lambda client: client.write(args.gaddr, data, rkey, stride=stride))
    emit(
        {"ok": True, "gaddr": args.gaddr, "bytes": len(data)},
        args.json,
        text=f"wrote {len(data)} bytes at 0x{args.gaddr:x}",
    )
    return ExitCode.OK


def escape_text(data: bytes) -> str:
    """*data* as UTF-8 text a terminal shows safely and unambiguously: a byte that is no UTF-8
    becomes ``\\xNN``, a control character (NUL of unwritten memory, ESC of a terminal sequence)
    ``\\xNN`` below 0x80 and ``\\uNNNN`` above (so an escape never reads as both), a literal
    backslash two; newlines and tabs stay."""
    out = []
    for char in data.decode("utf-8", errors="surrogateescape"):
        code = ord(char)
        if (
            0xDC80 <= code <= 0xDCFF
        ):  # surrogateescape's stand-in for undecodable byte code - 0xdc00
            out.append(f"\\x{code - 0xDC00:02x}")
        elif char == "\\":
            out.append("\\\\")
        elif char in "\n\t" or char.isprintable():
            out.append(char)
        else:
            out.append(
                f"\\x{code:02x}"
                if code < 0x80
                else f"\\u{code:04x}"
                if code <= 0xFFFF
                else f"\\U{code:08x}"
            )
    return "".join(out)


def write_read_result(data: bytes, form: str) -> None:
    """Print the bytes `pool read` got in format *form* (one of READ_FORMATS) on stdout."""
    if form == "raw":
        # The exact bytes and nothing else: no newline, no encoding by the text layer.
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
        return
    text = escape_text(data) if form == "text" else data.hex()
    sys.stdout.write(text if text.endswith("\n") else text + "\n")


def run_read(args: argparse.Namespace) -> int:

    if args.json and args.format is not None:
        raise CommandError(
            "--format chooses the text output; --json always gives the bytes as "
            "'hex': drop one of them",
            ExitCode.USAGE,
        )
    ctl, rkey, stride, keys = _target(args)
    data = _with_client(
        ctl, keys, lambda client: client.read(args.gaddr, args.length, rkey, stride=stride)
    )
    if args.json:
        emit({"ok": True, "gaddr": args.gaddr, "bytes": len(data), "hex": data.hex()}, True)
    else:
        write_read_result(data, args.format or READ_FORMATS[0])
    return ExitCode.OK


def run_list(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import ControllerError

    ctl = _controller(args)
    try:
        state = ctl.state()  # groups and generation; the regions come over the wire (QUERY)
        listed = ctl.regions()
    except ControllerError as exc:
        raise CommandError(str(exc), ExitCode.RUN_FAILED) from None
    regions = [_region_json(r) for r in listed]
    groups = {f"{g[0]}:{g[1]}": [f"{m[0]}:{m[1]}" for m in ms] for g, ms in state.groups.items()}
    lines = [
        f"0x{r.gaddr:x} size {r.size} rkey 0x{r.rkey:08x} stride {r.stride} ways "
        f"{[w.node for w in r.ways]} {'tagged' if r.tag_key else 'untagged'} {r.tenant}".rstrip()
        for r in listed
    ]
    lines += [f"group {g}: {', '.join(ms)}" for g, ms in groups.items()]
    emit(
        {"ok": True, "generation": state.generation, "regions": regions, "groups": groups},
        args.json,
        text="\n".join(lines) or "no regions",
    )
    return ExitCode.OK


def run_stats(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.core import counters_from_payload

    ctl = _controller(args)
    entry = ctl.switch
    try:
        with ControlClient.for_cluster(ctl.cluster) as client:
            reply = client.request(
                entry.control_endpoint, Packet(Opcode.COUNTERS, rkey=ctl.cluster.admin_key)
            )
    except ControlError as exc:
        raise CommandError(
            f"switch {entry.address}:{entry.port}: {exc}", ExitCode.RUN_FAILED
        ) from None
    values = counters_from_payload(reply.payload)
    lines = [f"{'port':<8}{'rx_packets':>12}{'tx_packets':>12}{'fault_drops':>12}"]
    for p in values["ports"]:
        lines.append(
            f"{p['port']:<8}{p['rx_packets']:>12}{p['tx_packets']:>12}"
            f"{p['fault_drops_rx'] + p['fault_drops_tx']:>12}"
        )
    for r in values["regions"]:
        lines.append(
            f"region 0x{r['gaddr']:x}: forwarded {r['forwarded']}, reads {r['reads']}, "
            f"writes {r['writes']}, atomics {r['atomics']}, nacks {r['nacks']}"
        )
    emit({"ok": True, **values}, args.json, text="\n".join(lines))
    return ExitCode.OK


def run_quota(args: argparse.Namespace) -> int:
    # Imported here: it loads numba's compiled kernels (~0.7 s), which `netdam --help` and the light commands need not pay for.
    from netdam.switch.controller import ControllerError, PoolController
    from netdam.switch.state import (
        BUILTIN_QUOTA,
        Quota,
        find_tenant,
        load_state,
        set_quota,
        short_digest,
    )

    setting = args.bytes is not None or args.regions is not None
    if setting and not (args.default or args.tenant):
        raise CommandError(
            "--bytes and --regions set a quota: say whose, --default or --tenant LABEL",
            ExitCode.USAGE,
        )
    try:
        path = PoolController(args.cluster).state_path
        state = load_state(path)
        owner = find_tenant(state, args.tenant) if args.tenant else None
        if setting:
            size, percent = args.bytes if args.bytes is not None else (None, None)
            state = set_quota(path, owner, Quota(size, percent, args.regions))
    except (ControllerError, ValueError, OSError) as exc:
        raise CommandError(str(exc), ExitCode.USAGE) from None
    shown = [owner] if owner else sorted(state.tenants, key=lambda d: (state.tenants[d], d))
    rows = []
    for digest in shown:
        held, regions = state.usage(digest)
        rows.append(
            {
                "tenant": state.tenants[digest],
                "digest": digest,
                "bytes": held,
                "bytes_quota": state.byte_limit(digest),
                "regions": regions,
                "regions_quota": state.quota_of(digest).regions,
                "own": state.quotas.get(digest, Quota()).to_json(),
            }
        )
    default = BUILTIN_QUOTA.merged(state.default_quota)
    lines = [
        f"pool {format_size(state.capacity)}; default quota {_quota_text(default, state.capacity)}"
    ]
    lines += [
        f"{r['tenant'] or '-':<16} {short_digest(r['digest'])}  bytes {format_size(r['bytes'])} of "
        f"{format_size(r['bytes_quota'])}, regions {r['regions']} of {r['regions_quota']}"
        f"{' (own quota)' if r['own'] else ''}"
        for r in rows
    ]
    emit(
        {"ok": True, "capacity": state.capacity, "default": default.to_json(), "tenants": rows},
        args.json,
        text="\n".join(lines),
    )
    return ExitCode.OK


def _quota_text(quota: Any, capacity: int) -> str:
    share = (
        f"{quota.percent:g}% ({format_size(int(capacity * quota.percent / 100))})"
        if quota.percent is not None
        else format_size(quota.bytes)
    )
    return f"{share}, {quota.regions} regions"
