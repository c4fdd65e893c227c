"""The layout tables of protocol/layout.py against what else writes the layout down: every
offset table of SPEC.md row by row, the Wireshark dissector's field offsets, the codec's structs
and the named offsets the kernels use."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from netdam.protocol import layout as L
from netdam.protocol import packet, payloads

ROOT = Path(__file__).resolve().parents[2]
SPEC = (ROOT / "protocol" / "SPEC.md").read_text(encoding="utf-8")
LUA = (ROOT / "protocol" / "wireshark" / "netdam.lua").read_text(encoding="utf-8")

Row = tuple[int, int, str]


def spec_tables() -> list[tuple[str, list[Row]]]:
    """Every table of SPEC.md whose first column is an offset: (caption, rows). The caption is
    the text above the table back to the previous heading or table; rows are (offset, size, name)
    where offset and size are numbers (variable parts, like the sparse indices, are left out).
    The name is the field column's first `backticked` word, else its first word."""
    tables: list[tuple[str, list[Row]]] = []
    caption: list[str] = []
    lines = SPEC.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            caption = [line]
        elif line.startswith("| Offset"):
            rows: list[Row] = []
            i += 2  # the header and the |---| line
            while i < len(lines) and lines[i].startswith("|"):
                cells = [c.strip() for c in re.split(r"(?<!\\)\|", lines[i].strip())[1:-1]]
                if cells[0].isdigit() and cells[1].isdigit():
                    named = re.match(r"`(\w+)`", cells[2]) or re.match(r"(\w+)", cells[2])
                    assert named, lines[i]
                    rows.append((int(cells[0]), int(cells[1]), named.group(1)))
                i += 1
            tables.append(("\n".join(caption), rows))
            caption = []
            continue
        else:
            caption.append(line)
        i += 1
    return tables


def same_name(spec_name: str, field: L.Field) -> bool:
    """SPEC writes every reserved field `reserved`; the tables number them when there are two."""
    return spec_name == field.name or (
        spec_name == "reserved" and field.name.startswith("reserved")
    )


def test_every_offset_table_of_spec_is_a_layout() -> None:
    tables = spec_tables()
    assert len(tables) >= len(L.LAYOUTS)
    for caption, _ in tables:
        owners = [layout.name for layout in L.LAYOUTS if layout.spec in caption]
        assert len(owners) == 1, (caption[:200], owners)


@pytest.mark.parametrize("layout", L.LAYOUTS, ids=lambda layout: layout.name)
def test_spec_table_equals_the_layout(layout: L.Layout) -> None:
    found = [rows for caption, rows in spec_tables() if layout.spec in caption]
    assert len(found) == 1, f"SPEC.md has {len(found)} tables captioned {layout.spec!r}"
    rows = found[0]
    assert [(offset, size) for offset, size, _ in rows] == [
        (f.offset, f.width) for f in layout.fields
    ], layout.name
    for (offset, _, name), field in zip(rows, layout.fields):
        assert same_name(name, field), (
            f"SPEC.md {layout.spec}: offset {offset} is `{name}`, layout.py says {field.name}"
        )


def test_layout_rejects_gaps_and_wrong_widths() -> None:
    with pytest.raises(ValueError, match="gap or overlap"):
        L.Layout("x", "<", [L.Field("a", 0, 4, "u32", ""), L.Field("b", 5, 4, "u32", "")], spec="")
    with pytest.raises(ValueError, match="width 2 is not that of a u32"):
        L.Layout("x", "<", [L.Field("a", 0, 2, "u32", "")], spec="")


def test_codec_structs_derive_from_the_tables() -> None:
    assert packet.HEADER_STRUCT.format == "!BBHIIIIIIIQQBBBBBBBBIHH"
    assert packet.SEGMENT_STRUCT.format == "!IHH" and packet.SPARSE_PREFIX.format == "<II"
    assert (packet.REPLY_IDS.format, packet.REPLY_IDS_OFFSET) == ("!II", 8)
    expected = {
        "INFO": "<IIQIIII",
        "KEY_RIGHTS": "<II",
        "DESCRIPTOR": "<BBHIQQQIIQQII",
        "COMPLETION": "<QQ",
        "COMPLETION_PHASES": "<QIIII",
        "U64": "<Q",
        "CAS_OPERANDS": "<QQ",
        "ALLOC_REQUEST": "<QQIHBB16s",
        "CREDENTIAL": "<Q",
        "REGION_INFO": "<QQQIIHBBI16s",
        "REGION_WAY": "<IIQQ",
    }
    assert {name: getattr(payloads, name).format for name in expected} == expected


def test_named_offsets_are_the_tables() -> None:
    """H_<FIELD> for every header field, SEG_<FIELD> for every segment field, nothing else."""
    for prefix, layout in (("H_", L.HEADER), ("SEG_", L.SEGMENT)):
        names = {n for n in dir(L) if n.startswith(prefix)}
        assert names == {prefix + f.name.upper() for f in layout.fields}
        for f in layout.fields:
            assert getattr(L, prefix + f.name.upper()) == f.offset
    assert L.EP_IP + 4 == L.EP_PORT and L.EP_PORT + 2 == L.HEADER["addr"].width


def test_read_write_and_span() -> None:
    data = bytearray(L.HEADER.size)
    L.HEADER.write(data, "txn_id", 0x01020304)
    assert (
        data[L.HEADER.span("txn_id")] == b"\x01\x02\x03\x04"
        and L.HEADER.read(data, "txn_id") == 0x01020304
    )
    assert L.REGION_WAY.read(struct.pack("<IIQQ", 3, 0, 5, 7), "local") == 5


# ---------------------------------------------------------------- the Wireshark dissector

#: Dissector field (F.<key>) -> (layout, field, exact). exact False: the dissector shows part of
#: the field (an endpoint's IPv4 or port inside a u64), which must lie inside it.
LUA_FIELDS: dict[str, tuple[L.Layout, str, bool]] = {
    **{f.name: (L.HEADER, f.name, True) for f in L.HEADER.fields},
    "group_ip": (L.HEADER, "addr", False),
    "group_port": (L.HEADER, "addr", False),
    "member_ip": (L.HEADER, "aux_addr", False),
    "member_port": (L.HEADER, "aux_addr", False),
    "coll_message": (L.HEADER, "aux_addr", False),  # its low word: 1, 2, 3 (SPEC.md 4.1)
    "seg_ip": (L.SEGMENT, "ip", True),
    "seg_port": (L.SEGMENT, "port", True),
    "seg_reserved": (L.SEGMENT, "reserved", True),
    "sparse_nnz": (L.SPARSE_PREFIX, "nnz", True),
    "sparse_reserved": (L.SPARSE_PREFIX, "reserved", True),
    **{
        f"d_{f.name}": (L.DESCRIPTOR, f.name, True)
        for f in L.DESCRIPTOR.fields
        if f.name != "timeout_ms"
    },
    "d_timeout": (L.DESCRIPTOR, "timeout_ms", True),
    "d_sparse": (L.DESCRIPTOR, "flags", True),
    "d_update": (L.DESCRIPTOR, "flags", True),
    "d_tag_k0": (L.DESCRIPTOR_TAG_KEY, "tag_k0", True),
    "d_tag_k1": (L.DESCRIPTOR_TAG_KEY, "tag_k1", True),
    "reg_tag_k0": (L.DESCRIPTOR_TAG_KEY, "tag_k0", True),
    "reg_tag_k1": (L.DESCRIPTOR_TAG_KEY, "tag_k1", True),
    "region_tag_k0": (L.DESCRIPTOR_TAG_KEY, "tag_k0", True),
    "region_tag_k1": (L.DESCRIPTOR_TAG_KEY, "tag_k1", True),
    **{
        f"info_{f.name}": (L.INFO, f.name, True)
        for f in L.INFO.fields
        if f.name not in ("memory_bytes", "world_size")
    },
    "info_memory": (L.INFO, "memory_bytes", True),
    "info_world": (L.INFO, "world_size", True),
    "reg_rkey": (L.REGISTER, "rkey", True),
    "reg_rights": (L.REGISTER, "rights", True),
    "dereg_rkey": (L.DEREGISTER, "rkey", True),
    "dereg_reserved": (L.DEREGISTER, "reserved", True),
    **{f"alloc_{f.name}": (L.ALLOC, f.name, True) for f in L.ALLOC.fields},
    "pool_credential": (L.CREDENTIAL, "credential", True),
    **{
        f"region_{f.name}": (L.REGION_INFO, f.name, True)
        for f in L.REGION_INFO.fields
        if "reserved" not in f.name
    },
    **{
        f"way_{f.name}": (L.REGION_WAY, f.name, True)
        for f in L.REGION_WAY.fields
        if f.name != "reserved"
    },
    "addend": (L.FETCH_ADD, "addend", True),
    "old": (L.FETCH_ADD, "addend", True),
    "compare": (L.CAS, "compare", True),
    "swap": (L.CAS, "swap", True),
    "chains_resent": (L.COMPLETION, "chains_resent", True),
    "repair_reads": (L.COMPLETION, "repair_reads", True),
    "phase_start": (L.COMPLETION, "start_ns", True),
    "phase_chains": (L.COMPLETION, "chains_us", True),
    "phase_chunks": (L.COMPLETION, "chunks_us", True),
    "phase_done": (L.COMPLETION, "done_us", True),
    "first_missing": (L.COMPLETION_FAILURE, "first_missing", True),
    "last_missing": (L.COMPLETION_FAILURE, "last_missing", True),
}
#: Offset base in netdam.lua -> the block it points at (no base: the datagram, i.e. the header).
LUA_BASES = {None: L.HEADER, "off": L.SEGMENT, "w": L.REGION_WAY}
TVB = re.compile(
    r"(?:F\.(?P<key>\w+), )?tvb\((?:(?P<base>[a-z_]+)(?: \+ (?P<boff>\d+))?|(?P<off>\d+)), (?P<width>\d+)\)"
)


def lua_ranges() -> list[tuple[int, str | None, str | None, int, int]]:
    """(line, F key, base, offset, width) of every tvb(...) range with a literal offset or width."""
    found = []
    for number, line in enumerate(LUA.split("\n"), 1):
        for m in TVB.finditer(line):
            offset = int(m["off"] or m["boff"] or 0)
            found.append((number, m["key"], m["base"], offset, int(m["width"])))
    return found


def covers(layout: L.Layout, offset: int, width: int) -> bool:
    """The range lies inside one field, or starts and ends on field boundaries."""
    inside = any(f.offset <= offset and offset + width <= f.end for f in layout.fields)
    starts = {f.offset for f in layout.fields}
    ends = {f.end for f in layout.fields}
    return inside or (offset in starts and offset + width in ends)


def test_wireshark_field_offsets_are_the_tables() -> None:
    seen = set()
    for number, key, base, offset, width in lua_ranges():
        where = f"netdam.lua:{number}"
        if key is not None and key in LUA_FIELDS:
            layout, name, exact = LUA_FIELDS[key]
            field = layout[name]
            if exact:
                assert (offset, width) == (field.offset, field.width), (
                    f"{where}: F.{key} at ({offset}, {width}), {layout.name}.{name} is ({field.offset}, {field.width})"
                )
            else:
                assert field.offset <= offset and offset + width <= field.end, (
                    f"{where}: F.{key} outside {name}"
                )
            seen.add(key)
        elif key is not None and key not in ("payload", "region_way", "bitmap", "nack_text"):
            raise AssertionError(
                f"{where}: F.{key} reads ({offset}, {width}): add it to LUA_FIELDS"
            )
        elif base in LUA_BASES:
            assert covers(LUA_BASES[base], offset, width), (
                f"{where}: ({offset}, {width}) straddles {LUA_BASES[base].name} fields"
            )
    assert seen == set(LUA_FIELDS), set(LUA_FIELDS) - seen


def test_wireshark_raw_header_reads_are_fields() -> None:
    """Reads of the header outside F fields (validation, the Info column) hit whole fields or
    parts of one; at least the ones the validation needs are there."""
    raw = {
        (offset, width)
        for _, key, base, offset, width in lua_ranges()
        if key is None and base is None
    }
    for name in (
        "version",
        "opcode",
        "flags",
        "length",
        "dtype",
        "reduce_op",
        "status",
        "seg_type",
        "segments_left",
        "seg_count",
        "reserved1",
        "reserved2",
    ):
        assert (L.HEADER[name].offset, L.HEADER[name].width) in raw, name
