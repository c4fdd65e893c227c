-- SPDX-License-Identifier: Apache-2.0
-- This file is part of netdam.
--
-- Wireshark / tshark dissector of the NetDAM v1 wire protocol (protocol/SPEC.md).
--
--   wireshark -X lua_script:protocol/wireshark/netdam.lua capture.pcap
--   tshark -X lua_script:protocol/wireshark/netdam.lua -r capture.pcap -V
--
-- or copy this file into ~/.local/lib/wireshark/plugins/ (see protocol/wireshark/README.md).
--
-- Rules of this file:
-- 1. The value tables below (opcodes, statuses, dtypes, reduce ops, flags, segment types,
--    rights, element sizes, limits, opcode classes) mirror netdam.protocol.constants and the
--    codec (netdam.protocol.packet); tests/protocol/test_wireshark.py parses them with a regex and fails
--    when one drifts. Keep the one-entry-per-line form `[value] = "NAME",`.
-- 2. Validation mirrors netdam.protocol.packet.decode_packet: the same checks in the same
--    order, the first failure decides, with the codec's status and its exact message (shown as
--    expert info and in the generated fields netdam.error.status / netdam.error.text).
-- 3. Packets on UDP port 7744 (or the ports of the preference netdam.ports, e.g. a cluster's,
--    which `netdam capture` prints) are always dissected; on any other port a heuristic
--    recognises a plausible v1 header (local clusters use free ports).
-- 4. A loopback capture holds a UDP-GSO send as one super-frame (several datagrams of one size,
--    the last maybe shorter); it is split as netdam.cli.decode.split_gso splits it.
-- 5. Field offsets are written as `tvb(<offset>, <width>)` (header), `tvb(poff + <offset>, <width>)`
--    (payload), `tvb(off + ...)` (SR segment) and `tvb(w + ...)` (region way): tests/protocol/test_layout.py
--    parses them and holds each F.<field> to the table of protocol/layout.py.
-- Written for Wireshark 3.6 and later (Lua 5.2 up to 5.4); tested with tshark 4.0.

local netdam = Proto("netdam", "NetDAM v1")

-- Bit operations: every Wireshark with Lua ships LuaBitOp as the global `bit` (bit32 is gone
-- in Lua 5.4). Its results are signed 32-bit; every use here stays below 2^31.
local band, bnot, rshift = bit.band, bit.bnot, bit.rshift
local function btest(a, b) return band(a, b) ~= 0 end
local function byte_at(value, shift) return band(rshift(value, shift), 0xFF) end

---------------------------------------------------------------------------------------------
-- Wire constants (checked against protocol/constants.py by tests/protocol/test_wireshark.py)

local PROTOCOL_VERSION = 1
local NETDAM_UDP_PORT = 7744
local HEADER_SIZE = 64
local SEGMENT_SIZE = 8
local MAX_SEGMENTS = 64
local MAX_PAYLOAD_BYTES = 8192
local FLAGS_V1_MASK = 0x003F
local TAG_SIZE = 8 -- SPEC.md 2.6: the trailer of a TAGGED datagram
local FLAG_TAGGED = 0x0020

-- Opcode (constants.Opcode)
local OPCODE = {
    [0x01] = "READ",
    [0x02] = "READ_RESP",
    [0x03] = "WRITE",
    [0x04] = "ADD",
    [0x05] = "CHAIN_ADD",
    [0x06] = "ALL_WRITE",
    [0x07] = "FETCH_ADD",
    [0x08] = "CAS",
    [0x09] = "PING",
    [0x0A] = "INFO",
    [0x0B] = "ACK",
    [0x0C] = "NACK",
    [0x0D] = "UPDATE",
    [0x20] = "REGISTER",
    [0x21] = "DEREGISTER",
    [0x22] = "JOIN",
    [0x23] = "LEAVE",
    [0x24] = "START_COLL",
    [0x25] = "COUNTERS",
    [0x26] = "ALLOC",
    [0x27] = "FREE",
    [0x28] = "QUERY",
}

-- Status (constants.Status)
local STATUS = {
    [0] = "OK",
    [1] = "BAD_VERSION",
    [2] = "BAD_OPCODE",
    [3] = "TRUNCATED",
    [4] = "BAD_LENGTH",
    [5] = "BAD_DTYPE",
    [6] = "BAD_OP",
    [7] = "BAD_SEGMENT",
    [8] = "BAD_RKEY",
    [9] = "NO_RIGHTS",
    [10] = "OUT_OF_BOUNDS",
    [11] = "MISALIGNED",
    [12] = "TOO_LARGE",
    [13] = "STALE",
    [14] = "NOT_MEMBER",
    [15] = "EXISTS",
    [16] = "NO_SPACE",
    [17] = "UNAUTHORIZED",
    [18] = "BAD_FIELD",
    [19] = "SPANS_NODES",
    [20] = "NO_ROUTE",
    [21] = "STALE_EPOCH",
    [22] = "BUSY",
    [23] = "TIMEOUT",
    [24] = "IN_USE",
    [25] = "QUOTA",
    [26] = "OUT_OF_STEP",
}

-- DType (constants.DType)
local DTYPE = {
    [0] = "RAW",
    [1] = "F32",
    [2] = "F16",
    [3] = "I32",
    [4] = "I64",
    [5] = "U64",
    [6] = "F64",
    [7] = "BF16",
}

-- Bytes per element (constants.ELEMENT_SIZE)
local ELEMENT_SIZE = {
    [0] = 1,
    [1] = 4,
    [2] = 2,
    [3] = 4,
    [4] = 8,
    [5] = 8,
    [6] = 8,
    [7] = 2,
}

-- ReduceOp (constants.ReduceOp)
local REDUCE_OP = {
    [0] = "SUM",
    [1] = "MIN",
    [2] = "MAX",
}

-- Flags (constants.Flags), one bit each
local FLAGS = {
    [0x0001] = "ACK_REQ",
    [0x0002] = "SPARSE",
    [0x0004] = "MCAST",
    [0x0008] = "RELAYED",
    [0x0010] = "RETRY",
    [0x0020] = "TAGGED",
}

-- SegmentType (constants.SegmentType)
local SEG_TYPE = {
    [0] = "NONE",
    [1] = "IPV4",
    [2] = "IPV6",
}

-- Rights (constants.Rights), REGISTER payload bits
local RIGHTS = {
    [0x1] = "READ",
    [0x2] = "WRITE",
    [0x4] = "ATOMIC",
    [0x8] = "MEMBERS",
}

-- START_COLL descriptor byte 0 (netdam.core.collective.Algo)
local ALGO = {
    [0] = "ALL_REDUCE",
    [1] = "REDUCE_SCATTER",
    [2] = "ALL_GATHER",
    [3] = "BROADCAST",
}

-- Collective control messages: ACK/NACK aux_addr (SPEC.md 4.1)
local COLL_MESSAGE = {
    [1] = "completion",
    [2] = "DONE",
    [3] = "non-zero bitmap",
}

-- Names of the scalar counters of a COUNTERS reply (netdam.protocol.counters; SPEC.md 6.3)
local COUNTER = {
    [0] = "rx_packets",
    [1] = "rx_bytes",
    [2] = "tx_packets",
    [3] = "tx_bytes",
    [4] = "forwarded",
    [5] = "stored",
    [6] = "chain_reacks",
    [7] = "dup_replays",
    [8] = "dup_silent",
    [9] = "punted",
    [10] = "bytes_combined",
    [11] = "drop_truncated",
    [12] = "drop_bad_reply",
    [13] = "drop_stale_epoch",
    [14] = "drop_tx_full",
    [15] = "drop_oversize",
    [16] = "drop_unexpected_reply",
    [17] = "drop_fault",
    [18] = "kernel_drops",
    [19] = "retransmits",
    [20] = "rcvbuf_bytes",
    [21] = "sndbuf_bytes",
    [22] = "drop_coll_early",
    [23] = "send_drops",
    [24] = "drop_lockout",
    [25] = "auth_failures",
    [26] = "lockouts",
    [27] = "drop_amplification",
    [28] = "drop_coll_forged",
    [29] = "drop_region_forged",
    [30] = "drop_control_forged",
    [31] = "drop_control_replayed",
}
local COUNTER_OPCODE_BASE = 32
local COUNTER_NACK_BASE = 96
local NODE_COUNTERS = 128

local function names(list)
    local set = {}
    for _, name in ipairs(list) do set[name] = true end
    return set
end

-- Opcode classes of the codec (constants.py and packet.py), by name
local REPLY_OPCODES = names{ "READ_RESP", "INFO", "ACK", "NACK" }
local CONTROL_OPCODES = names{ "REGISTER", "DEREGISTER", "JOIN", "LEAVE", "START_COLL", "COUNTERS" }
local DATA_OPCODES = names{ "WRITE", "ADD", "CHAIN_ADD", "ALL_WRITE", "READ_RESP", "UPDATE" }
local COMBINE_OPCODES = names{ "ADD", "CHAIN_ADD" }
local OPAQUE_OPCODES = names{ "INFO", "ACK", "NACK", "START_COLL" }
local EMPTY_OPCODES = names{ "PING", "JOIN", "LEAVE", "COUNTERS" }
local SR_OPCODES = names{ "CHAIN_ADD", "START_COLL" }
local SPARSE_OPCODES = names{ "CHAIN_ADD", "ALL_WRITE", "WRITE" }
-- Fixed payloads: {length field, payload bytes}
local FIXED_PAYLOAD = {
    FETCH_ADD = {8, 8},
    CAS = {8, 16},
    REGISTER = {8, 8},
    DEREGISTER = {8, 8},
    ALLOC = {40, 40},
    FREE = {8, 8},
    QUERY = {8, 8},
}
-- A second size a fixed payload may have: REGISTER with a region's tag key (SPEC.md 6.1).
local FIXED_PAYLOAD_ALT = {
    REGISTER = {24, 24},
}

local STATUS_CODE = {}
for value, name in pairs(STATUS) do STATUS_CODE[name] = value end

local function sorted_keys(t)
    local keys = {}
    for k in pairs(t) do keys[#keys + 1] = k end
    table.sort(keys)
    return keys
end

---------------------------------------------------------------------------------------------
-- Fields

local F = {}
local function field(key, f)
    F[key] = f
    return f
end

-- Fixed header, SPEC.md 2.1
field("version", ProtoField.uint8("netdam.version", "Version", base.DEC))
field("opcode", ProtoField.uint8("netdam.opcode", "Opcode", base.HEX, OPCODE))
field("flags", ProtoField.uint16("netdam.flags", "Flags", base.HEX))
local FLAG_FIELDS = {}
for _, bit in ipairs(sorted_keys(FLAGS)) do
    local name = FLAGS[bit]
    FLAG_FIELDS[#FLAG_FIELDS + 1] = field("flags." .. name,
        ProtoField.bool("netdam.flags." .. string.lower(name), name, 16, nil, bit))
end
field("flags.undefined", ProtoField.uint16("netdam.flags.undefined", "Undefined bits", base.HEX,
    nil, band(0xFFFF, bnot(FLAGS_V1_MASK))))
field("seq", ProtoField.uint32("netdam.seq", "Sequence / chunk index", base.DEC))
field("client_id", ProtoField.uint32("netdam.client_id", "Client id", base.DEC))
field("txn_id", ProtoField.uint32("netdam.txn_id", "Transaction id", base.DEC))
field("coll_id", ProtoField.uint32("netdam.coll_id", "Collective id", base.DEC))
field("epoch", ProtoField.uint32("netdam.epoch", "Collective epoch", base.DEC))
field("rkey", ProtoField.uint32("netdam.rkey", "Rkey", base.HEX))
field("length", ProtoField.uint32("netdam.length", "Length", base.DEC))
field("addr", ProtoField.uint64("netdam.addr", "Address", base.HEX))
field("aux_addr", ProtoField.uint64("netdam.aux_addr", "Aux address", base.HEX))
field("dtype", ProtoField.uint8("netdam.dtype", "Data type", base.DEC, DTYPE))
field("reduce_op", ProtoField.uint8("netdam.reduce_op", "Reduce op", base.DEC, REDUCE_OP))
field("status", ProtoField.uint8("netdam.status", "Status", base.DEC, STATUS))
field("credit", ProtoField.uint8("netdam.credit", "Credit (send-queue occupancy)", base.DEC))
field("seg_type", ProtoField.uint8("netdam.seg_type", "Segment type", base.DEC, SEG_TYPE))
field("segments_left", ProtoField.uint8("netdam.segments_left", "Segments left", base.DEC))
field("seg_count", ProtoField.uint8("netdam.seg_count", "Segment count", base.DEC))
field("reserved1", ProtoField.uint8("netdam.reserved1", "Reserved (byte 55)", base.HEX))
field("ret_ip", ProtoField.ipv4("netdam.ret_ip", "Return IPv4"))
field("ret_port", ProtoField.uint16("netdam.ret_port", "Return port", base.DEC))
field("reserved2", ProtoField.uint16("netdam.reserved2", "Reserved (bytes 62-63)", base.HEX))
-- Derived from addr / aux_addr when they hold an endpoint `ip << 16 | port`
field("group_ip", ProtoField.ipv4("netdam.group.ip", "Group IPv4"))
field("group_port", ProtoField.uint16("netdam.group.port", "Group port", base.DEC))
field("member_ip", ProtoField.ipv4("netdam.member.ip", "Member IPv4"))
field("member_port", ProtoField.uint16("netdam.member.port", "Member port", base.DEC))
field("coll_message", ProtoField.uint8("netdam.coll.message", "Collective message", base.DEC,
    COLL_MESSAGE))

-- SR list, SPEC.md 2.2
field("seg_index", ProtoField.uint8("netdam.seg.index", "Segment index", base.DEC))
field("seg_ip", ProtoField.ipv4("netdam.seg.ip", "Hop IPv4"))
field("seg_port", ProtoField.uint16("netdam.seg.port", "Hop port", base.DEC))
field("seg_reserved", ProtoField.uint16("netdam.seg.reserved", "Reserved", base.HEX))

-- Payload
field("payload", ProtoField.bytes("netdam.payload", "Payload"))
field("tag", ProtoField.uint64("netdam.tag", "Tag (SipHash-2-4 of header and SR list)", base.HEX))
field("elements", ProtoField.uint32("netdam.elements", "Elements", base.DEC))
field("f32", ProtoField.float("netdam.data.f32", "f32"))
field("f16", ProtoField.float("netdam.data.f16", "f16"))
field("bf16", ProtoField.float("netdam.data.bf16", "bf16"))
field("i32", ProtoField.int32("netdam.data.i32", "i32", base.DEC))
field("i64", ProtoField.int64("netdam.data.i64", "i64", base.DEC))
field("u64", ProtoField.uint64("netdam.data.u64", "u64", base.DEC))
field("f64", ProtoField.double("netdam.data.f64", "f64"))
-- Sparse payload, SPEC.md 2.5
field("sparse_nnz", ProtoField.uint32("netdam.sparse.nnz", "Entries (nnz)", base.DEC))
field("sparse_reserved", ProtoField.uint32("netdam.sparse.reserved", "Reserved", base.HEX))
field("sparse_index", ProtoField.uint16("netdam.sparse.index", "Index", base.DEC))
field("sparse_padding", ProtoField.bytes("netdam.sparse.padding", "Padding"))
-- Atomics, SPEC.md 3
field("addend", ProtoField.uint64("netdam.atomic.addend", "Addend", base.DEC))
field("compare", ProtoField.uint64("netdam.atomic.compare", "Compare", base.DEC))
field("swap", ProtoField.uint64("netdam.atomic.swap", "Swap", base.DEC))
field("old", ProtoField.uint64("netdam.atomic.old", "Old value", base.DEC))
-- REGISTER / DEREGISTER, SPEC.md 6.1 / 6.2
field("reg_rkey", ProtoField.uint32("netdam.register.rkey", "Requested rkey", base.HEX))
field("reg_rights", ProtoField.uint32("netdam.register.rights", "Rights", base.HEX))
local RIGHT_FIELDS = {}
for _, bit in ipairs(sorted_keys(RIGHTS)) do
    local name = RIGHTS[bit]
    RIGHT_FIELDS[#RIGHT_FIELDS + 1] = field("rights." .. name,
        ProtoField.bool("netdam.rights." .. string.lower(name), name, 32, nil, bit))
end
field("dereg_rkey", ProtoField.uint32("netdam.deregister.rkey", "Rkey to remove", base.HEX))
field("dereg_reserved", ProtoField.uint32("netdam.deregister.reserved", "Reserved", base.HEX))
-- ALLOC / FREE / QUERY and the region record of their ACKs, SPEC.md 11.9 (little-endian)
field("alloc_size", ProtoField.uint64("netdam.alloc.size", "Size", base.DEC))
field("alloc_credential", ProtoField.uint64("netdam.alloc.credential", "Tenant credential", base.HEX))
field("alloc_stride", ProtoField.uint32("netdam.alloc.stride", "Stride", base.DEC))
field("alloc_ways", ProtoField.uint16("netdam.alloc.ways", "Ways", base.DEC))
field("alloc_rights", ProtoField.uint8("netdam.alloc.rights", "Rights", base.HEX))
field("alloc_flags", ProtoField.uint8("netdam.alloc.flags", "Flags (bit 0 TAGGED)", base.HEX))
field("alloc_label", ProtoField.string("netdam.alloc.label", "Label"))
field("pool_credential", ProtoField.uint64("netdam.pool.credential", "Tenant credential", base.HEX))
field("region_gaddr", ProtoField.uint64("netdam.region.gaddr", "Global address", base.HEX))
field("region_size", ProtoField.uint64("netdam.region.size", "Size", base.DEC))
field("region_credential", ProtoField.uint64("netdam.region.credential", "Tenant credential", base.HEX))
field("region_rkey", ProtoField.uint32("netdam.region.rkey", "Rkey", base.HEX))
field("region_stride", ProtoField.uint32("netdam.region.stride", "Stride", base.DEC))
field("region_ways", ProtoField.uint16("netdam.region.ways", "Ways", base.DEC))
field("region_rights", ProtoField.uint8("netdam.region.rights", "Rights", base.HEX))
field("region_flags", ProtoField.uint8("netdam.region.flags", "Flags (bit 0 TAGGED)", base.HEX))
field("region_label", ProtoField.string("netdam.region.label", "Label"))
field("region_tag_k0", ProtoField.uint64("netdam.region.tag_k0", "Tag key k0", base.HEX))
field("region_tag_k1", ProtoField.uint64("netdam.region.tag_k1", "Tag key k1", base.HEX))
field("reg_tag_k0", ProtoField.uint64("netdam.register.tag_k0", "Tag key k0", base.HEX))
field("reg_tag_k1", ProtoField.uint64("netdam.register.tag_k1", "Tag key k1", base.HEX))
field("region_way", ProtoField.bytes("netdam.region.way", "Way"))
field("way_node", ProtoField.uint32("netdam.region.way.node", "Node rank", base.DEC))
field("way_local", ProtoField.uint64("netdam.region.way.local", "Local address", base.HEX))
field("way_size", ProtoField.uint64("netdam.region.way.size", "Backing bytes", base.DEC))
-- INFO, SPEC.md 6.4
field("info_version", ProtoField.uint32("netdam.info.version", "Protocol version", base.DEC))
field("info_mtu", ProtoField.uint32("netdam.info.mtu", "MTU", base.DEC))
field("info_memory", ProtoField.uint64("netdam.info.memory", "Memory bytes", base.DEC))
field("info_max_payload", ProtoField.uint32("netdam.info.max_payload", "Largest payload", base.DEC))
field("info_max_segments", ProtoField.uint32("netdam.info.max_segments", "Largest SR list",
    base.DEC))
field("info_rank", ProtoField.uint32("netdam.info.rank", "Rank", base.DEC))
field("info_world", ProtoField.uint32("netdam.info.world", "World size", base.DEC))
-- COUNTERS reply, SPEC.md 6.3
field("counter", ProtoField.uint64("netdam.counter", "Counter", base.DEC))
-- NACK text, SPEC.md 3
field("nack_text", ProtoField.string("netdam.nack.text", "Reason"))
-- Collective completion (SPEC.md 4.1) and bitmap
field("chains_resent", ProtoField.uint64("netdam.coll.chains_resent", "Chains re-sent", base.DEC))
field("repair_reads", ProtoField.uint64("netdam.coll.repair_reads", "Repair READs", base.DEC))
field("phase_start", ProtoField.uint64("netdam.coll.start_ns", "Started at (node clock, ns)", base.DEC))
field("phase_chains", ProtoField.uint32("netdam.coll.chains_us", "Chains ACKed after (us)", base.DEC))
field("phase_chunks", ProtoField.uint32("netdam.coll.chunks_us", "Every chunk here after (us)", base.DEC))
field("phase_done", ProtoField.uint32("netdam.coll.done_us", "Every DONE here after (us)", base.DEC))
field("first_missing", ProtoField.uint64("netdam.coll.first_missing", "First missing chunk",
    base.DEC))
field("last_missing", ProtoField.uint64("netdam.coll.last_missing", "Last missing chunk",
    base.DEC))
field("bitmap", ProtoField.bytes("netdam.coll.bitmap", "Non-zero chunk bitmap"))
-- START_COLL descriptor, SPEC.md 6.5
field("d_algo", ProtoField.uint8("netdam.desc.algo", "Algorithm", base.DEC, ALGO))
field("d_flags", ProtoField.uint8("netdam.desc.flags", "Flags", base.HEX))
field("d_sparse", ProtoField.bool("netdam.desc.flags.sparse", "Sparse mode", 8, nil, 0x01))
field("d_update", ProtoField.bool("netdam.desc.flags.update", "Fused reduce and update", 8, nil, 0x02))
field("d_window", ProtoField.uint16("netdam.desc.window", "Window", base.DEC))
field("d_rank", ProtoField.uint32("netdam.desc.rank", "Rank", base.DEC))
field("d_count", ProtoField.uint64("netdam.desc.count", "Count", base.DEC))
field("d_in_addr", ProtoField.uint64("netdam.desc.in_addr", "Input address", base.HEX))
field("d_out_addr", ProtoField.uint64("netdam.desc.out_addr", "Output address", base.HEX))
field("d_rkey", ProtoField.uint32("netdam.desc.rkey", "Data rkey", base.HEX))
field("d_root", ProtoField.uint32("netdam.desc.root", "Root rank", base.DEC))
field("d_group", ProtoField.uint64("netdam.desc.group", "All-gather group", base.HEX))
field("d_group_ip", ProtoField.ipv4("netdam.desc.group.ip", "Group IPv4"))
field("d_group_port", ProtoField.uint16("netdam.desc.group.port", "Group port", base.DEC))
field("d_host", ProtoField.uint64("netdam.desc.host", "Completion to", base.HEX))
field("d_host_ip", ProtoField.ipv4("netdam.desc.host.ip", "Host IPv4"))
field("d_host_port", ProtoField.uint16("netdam.desc.host.port", "Host port", base.DEC))
field("d_timeout", ProtoField.uint32("netdam.desc.timeout_ms", "Watchdog (ms)", base.DEC))
field("d_reserved", ProtoField.uint32("netdam.desc.reserved", "Reserved", base.HEX))
-- its tag key (80-byte descriptors, SPEC.md 6.5 "Tag key")
field("d_tag_k0", ProtoField.uint64("netdam.desc.tag_k0", "Tag key k0", base.HEX))
field("d_tag_k1", ProtoField.uint64("netdam.desc.tag_k1", "Tag key k1", base.HEX))
-- Verdict of the codec's checks (generated)
field("error_status", ProtoField.uint8("netdam.error.status", "NACK status", base.DEC, STATUS))
field("error_text", ProtoField.string("netdam.error.text", "Error"))
-- UDP-GSO super-frames (section "Dissector"): datagram size and index, derived
field("gso_size", ProtoField.uint32("netdam.gso.size", "GSO segment size", base.DEC))
field("gso_segment", ProtoField.uint32("netdam.gso.segment", "GSO datagram", base.DEC))

local all_fields = {}
for _, f in pairs(F) do all_fields[#all_fields + 1] = f end
netdam.fields = all_fields

---------------------------------------------------------------------------------------------
-- Expert info: one entry per status the codec's structural checks raise, plus notes

local E = {
    short = ProtoExpert.new("netdam.expert.short",
        "Shorter than the 64-byte header: a node drops it silently",
        expert.group.MALFORMED, expert.severity.ERROR),
    TRUNCATED = ProtoExpert.new("netdam.expert.truncated", "Truncated (TRUNCATED)",
        expert.group.MALFORMED, expert.severity.ERROR),
    BAD_VERSION = ProtoExpert.new("netdam.expert.bad_version", "Bad version (BAD_VERSION)",
        expert.group.MALFORMED, expert.severity.ERROR),
    BAD_OPCODE = ProtoExpert.new("netdam.expert.bad_opcode", "Unknown opcode (BAD_OPCODE)",
        expert.group.MALFORMED, expert.severity.ERROR),
    BAD_LENGTH = ProtoExpert.new("netdam.expert.bad_length",
        "Length field disagrees with the payload (BAD_LENGTH)",
        expert.group.MALFORMED, expert.severity.ERROR),
    BAD_DTYPE = ProtoExpert.new("netdam.expert.bad_dtype", "Bad data type (BAD_DTYPE)",
        expert.group.MALFORMED, expert.severity.ERROR),
    BAD_OP = ProtoExpert.new("netdam.expert.bad_op", "Unknown reduce op (BAD_OP)",
        expert.group.MALFORMED, expert.severity.ERROR),
    BAD_SEGMENT = ProtoExpert.new("netdam.expert.bad_segment", "Bad SR list (BAD_SEGMENT)",
        expert.group.MALFORMED, expert.severity.ERROR),
    TOO_LARGE = ProtoExpert.new("netdam.expert.too_large", "Length over 8192 (TOO_LARGE)",
        expert.group.MALFORMED, expert.severity.ERROR),
    BAD_FIELD = ProtoExpert.new("netdam.expert.bad_field", "Bad field (BAD_FIELD)",
        expert.group.MALFORMED, expert.severity.ERROR),
    nack = ProtoExpert.new("netdam.expert.nack", "NACK",
        expert.group.RESPONSE_CODE, expert.severity.NOTE),
    snapped = ProtoExpert.new("netdam.expert.snapped",
        "Capture cut the datagram short (snaplen): checks use the bytes captured",
        expert.group.UNDECODED, expert.severity.WARN),
}
local all_experts = {}
for _, e in pairs(E) do all_experts[#all_experts + 1] = e end
netdam.experts = all_experts

---------------------------------------------------------------------------------------------
-- Helpers

local function u64hex(tvb, offset)
    local hi, lo = tvb(offset, 4):uint(), tvb(offset + 4, 4):uint()
    if hi ~= 0 then return string.format("0x%x%08x", hi, lo) end
    return string.format("0x%x", lo)
end

local function ipv4_string(value)
    return string.format("%d.%d.%d.%d", byte_at(value, 24), byte_at(value, 16), byte_at(value, 8),
        byte_at(value, 0))
end

local function flag_names(flags)
    local parts = {}
    for _, bit in ipairs(sorted_keys(FLAGS)) do
        if btest(flags, bit) then parts[#parts + 1] = FLAGS[bit] end
    end
    return #parts > 0 and table.concat(parts, "|") or "none"
end

-- A 16-bit float's bits -> Lua number, exactly (every f16 and bf16 value is a double): sign,
-- then *exponent_bits* of exponent and *fraction_bits* of fraction (f16: 5, 10; bf16: 8, 7).
local function small_float_to_number(bits, exponent_bits, fraction_bits)
    local sign = btest(bits, 0x8000) and -1 or 1
    local top = 2 ^ exponent_bits - 1
    local bias = 2 ^ (exponent_bits - 1) - 1
    local exponent = band(rshift(bits, fraction_bits), top)
    local fraction = band(bits, 2 ^ fraction_bits - 1)
    if exponent == 0 then return sign * fraction * 2 ^ (1 - bias - fraction_bits) end
    if exponent == top then
        if fraction == 0 then return sign * math.huge end
        return 0 / 0
    end
    return sign * (1 + fraction / 2 ^ fraction_bits) * 2 ^ (exponent - bias)
end

local function sparse_payload_size(nnz, size)
    return 8 + math.floor((2 * nnz + 7) / 8) * 8 + nnz * size
end

---------------------------------------------------------------------------------------------
-- Validation: netdam.protocol.packet.decode_packet, check by check.
-- Returns nil when the datagram decodes, else {status = NAME, text = message, offset, len}.

local function fail(status, text, offset, len)
    return { status = status, text = text, offset = offset, len = len }
end

local function check_multiple(length, dtype)
    local element = ELEMENT_SIZE[dtype]
    if length % element ~= 0 then
        return fail("BAD_LENGTH", string.format(
            "length %d is not a multiple of the %s element size %d",
            length, string.lower(DTYPE[dtype]), element), 28, 4)
    end
end

local function expect_payload(name, length, size)
    if length ~= size then
        return fail("BAD_LENGTH", string.format(
            "%s length field says %d bytes but the payload has %d", name, length, size), 28, 4)
    end
end

local function check_sparse(tvb, poff, size, length, dtype)
    if size < 8 then
        return fail("TRUNCATED", "sparse payload shorter than its 8-byte prefix", poff, size)
    end
    local nnz, reserved = tvb(poff, 4):le_uint(), tvb(poff + 4, 4):le_uint()
    if reserved ~= 0 then
        return fail("BAD_FIELD", "sparse prefix reserved word must be zero", poff + 4, 4)
    end
    local element = ELEMENT_SIZE[dtype]
    local elements = math.floor(length / element)
    if nnz > elements then
        return fail("BAD_LENGTH", string.format(
            "sparse nnz %d exceeds the %d elements of length %d", nnz, elements, length), poff, 4)
    end
    local want = sparse_payload_size(nnz, element)
    if size ~= want then
        return fail("BAD_LENGTH", string.format(
            "sparse payload of %d entries must be %d bytes, got %d", nnz, want, size), poff, size)
    end
    local pad_start, pad_end = 8 + 2 * nnz, want - nnz * element
    for i = pad_start, pad_end - 1 do
        if tvb(poff + i, 1):uint() ~= 0 then
            return fail("BAD_FIELD", "sparse index padding must be zero", poff + pad_start,
                pad_end - pad_start)
        end
    end
    local previous = -1
    for i = 0, nnz - 1 do
        local index = tvb(poff + 8 + 2 * i, 2):le_uint()
        if index <= previous or (i == nnz - 1 and index >= elements) then
            return fail("BAD_FIELD", string.format(
                "sparse indices must increase strictly and stay below %d", elements),
                poff + 8, 2 * nnz)
        end
        previous = index
    end
end

local function validate(tvb)
    local total = tvb:len()
    if total < HEADER_SIZE then
        return fail("TRUNCATED", string.format(
            "packet truncated: %d bytes, the fixed header needs %d", total, HEADER_SIZE), 0, total)
    end
    local version, opcode, flags = tvb(0, 1):uint(), tvb(1, 1):uint(), tvb(2, 2):uint()
    if version ~= PROTOCOL_VERSION then
        return fail("BAD_VERSION", string.format(
            "unsupported version %d (this node speaks %d)", version, PROTOCOL_VERSION), 0, 1)
    end
    local name = OPCODE[opcode]
    if name == nil then
        return fail("BAD_OPCODE", string.format("unknown opcode 0x%02x", opcode), 1, 1)
    end
    if tvb(55, 1):uint() ~= 0 or tvb(62, 2):uint() ~= 0 then
        return fail("BAD_FIELD", "reserved header bytes 55 and 62-63 must be zero", 55, 9)
    end
    local undefined = band(flags, bnot(FLAGS_V1_MASK))
    if undefined ~= 0 then
        return fail("BAD_FIELD", string.format("undefined flag bits 0x%04x set", undefined), 2, 2)
    end
    local dtype, reduce_op, status = tvb(48, 1):uint(), tvb(49, 1):uint(), tvb(50, 1):uint()
    if DTYPE[dtype] == nil then
        return fail("BAD_DTYPE", string.format("unknown dtype %d", dtype), 48, 1)
    end
    if REDUCE_OP[reduce_op] == nil then
        return fail("BAD_OP", string.format("unknown reduce op %d", reduce_op), 49, 1)
    end
    if STATUS[status] == nil then
        return fail("BAD_FIELD", string.format("unknown status %d", status), 50, 1)
    end
    -- SR list (codec: _pull_segments)
    local seg_type, segments_left = tvb(52, 1):uint(), tvb(53, 1):uint()
    local seg_count = tvb(54, 1):uint()
    if seg_type == 2 then
        return fail("BAD_SEGMENT", "segment type 2 (IPv6) is reserved in v1", 52, 1)
    end
    if seg_type ~= 0 and seg_type ~= 1 then
        return fail("BAD_SEGMENT", string.format("unknown segment type %d", seg_type), 52, 1)
    end
    if seg_count > MAX_SEGMENTS then
        return fail("BAD_SEGMENT", string.format(
            "SR list has %d segments, the maximum is %d", seg_count, MAX_SEGMENTS), 54, 1)
    end
    if (seg_type == 0) ~= (seg_count == 0) then
        return fail("BAD_SEGMENT", string.format(
            "segment type %d does not match a list of %d segments", seg_type, seg_count), 52, 3)
    end
    if segments_left >= math.max(seg_count, 1) then
        return fail("BAD_SEGMENT", string.format(
            "segments_left %d out of range for %d segments", segments_left, seg_count), 53, 1)
    end
    local available = math.floor((total - HEADER_SIZE) / SEGMENT_SIZE)
    if available < seg_count then
        return fail("TRUNCATED", string.format(
            "SR list truncated (%d of %d segments)", available, seg_count), HEADER_SIZE,
            total - HEADER_SIZE)
    end
    for index = 0, seg_count - 1 do
        local off = HEADER_SIZE + SEGMENT_SIZE * index
        if tvb(off + 6, 2):uint() ~= 0 then
            return fail("BAD_SEGMENT", string.format(
                "segment %d has non-zero reserved bytes", index), off + 6, 2)
        end
    end
    -- Per opcode (codec: check_fields)
    local length = tvb(28, 4):uint()
    local poff = HEADER_SIZE + SEGMENT_SIZE * seg_count
    local size = total - poff
    if btest(flags, FLAG_TAGGED) then
        if size < TAG_SIZE then
            return fail("TRUNCATED", string.format("TAGGED datagram without its %d-byte tag", TAG_SIZE),
                poff, size)
        end
        size = size - TAG_SIZE
    end
    if seg_count > 0 and not SR_OPCODES[name] then
        return fail("BAD_SEGMENT", string.format("%s does not take an SR list", name), 52, 3)
    end
    local max_payload = netdam.prefs.max_payload or MAX_PAYLOAD_BYTES
    if length > max_payload and not CONTROL_OPCODES[name] then
        return fail("TOO_LARGE", string.format(
            "length %d exceeds the maximum payload of %d bytes", length, max_payload), 28, 4)
    end
    if COMBINE_OPCODES[name] and dtype == 0 then
        return fail("BAD_DTYPE", string.format(
            "%s cannot combine raw bytes; give an element dtype", name), 48, 1)
    end
    if (name == "FETCH_ADD" or name == "CAS") and DTYPE[dtype] ~= "U64" then
        return fail("BAD_DTYPE", string.format("%s operates on u64 only", name), 48, 1)
    end
    if name == "UPDATE" and not (DTYPE[dtype] == "F32" or DTYPE[dtype] == "F16"
            or DTYPE[dtype] == "BF16") then
        return fail("BAD_DTYPE", string.format(
            "an UPDATE's gradient is f32, f16 or bf16, not %s", DTYPE[dtype]), 48, 1)
    end
    if name == "READ" then
        if size ~= 0 then
            return fail("BAD_LENGTH", string.format(
                "READ carries no payload but %d bytes follow the header", size), poff, size)
        end
        if length == 0 then return fail("BAD_LENGTH", "READ of length 0", 28, 4) end
        return check_multiple(length, dtype)
    elseif DATA_OPCODES[name] then
        if btest(flags, 0x0002) then -- SPARSE
            if not SPARSE_OPCODES[name] then
                return fail("BAD_FIELD", string.format("%s has no sparse form", name), 2, 2)
            end
            return check_multiple(length, dtype) or check_sparse(tvb, poff, size, length, dtype)
        end
        if length == 0 then
            return fail("BAD_LENGTH", string.format("%s of length 0", name), 28, 4)
        end
        return expect_payload(name, length, size) or check_multiple(length, dtype)
    elseif OPAQUE_OPCODES[name] then
        return expect_payload(name, length, size)
    elseif EMPTY_OPCODES[name] then
        if length ~= 0 or size ~= 0 then
            return fail("BAD_LENGTH", string.format(
                "%s carries no payload (length %d, %d bytes follow)", name, length, size), 28, 4)
        end
    else
        local want = FIXED_PAYLOAD[name]
        local alt = FIXED_PAYLOAD_ALT[name]
        if (length ~= want[1] or size ~= want[2]) and not (alt and length == alt[1] and size == alt[2]) then
            return fail("BAD_LENGTH", string.format(
                "%s needs length %d and a payload of %d bytes (got length %d, %d bytes)",
                name, want[1], want[2], length, size), 28, 4)
        end
    end
    return nil
end

---------------------------------------------------------------------------------------------
-- Payload dissection (only for datagrams that decode, so sizes are as SPEC.md says)

local function add_endpoint_u64_le(tree, tvb, offset, f_ip, f_port)
    -- `ip << 16 | port` as u64 little-endian: port in bytes 0-1, IPv4 in bytes 2-5
    tree:add_le(f_ip, tvb(offset + 2, 4))
    tree:add_le(f_port, tvb(offset, 2))
end

local function add_elements(tree, tvb, offset, count, dtype, indices)
    local size = ELEMENT_SIZE[dtype]
    local dname = string.lower(DTYPE[dtype])
    for i = 0, count - 1 do
        local range = tvb(offset + i * size, size)
        local item
        if dname == "f16" then
            local bits = range:le_uint()
            item = tree:add(F.f16, range, small_float_to_number(bits, 5, 10))
            item:append_text(string.format(" (0x%04x)", bits))
        elseif dname == "bf16" then
            local bits = range:le_uint()
            item = tree:add(F.bf16, range, small_float_to_number(bits, 8, 7))
            item:append_text(string.format(" (0x%04x)", bits))
        else
            item = tree:add_le(F[dname], range)
        end
        item:prepend_text(string.format("[%d] ", indices and indices[i] or i))
    end
end

local function dissect_sparse(tree, tvb, poff, size, dtype)
    local nnz = tvb(poff, 4):le_uint()
    tree:add_le(F.sparse_nnz, tvb(poff, 4))
    tree:add_le(F.sparse_reserved, tvb(poff + 4, 4))
    local element = ELEMENT_SIZE[dtype]
    local values = poff + sparse_payload_size(nnz, element) - nnz * element
    local indices = {}
    for i = 0, nnz - 1 do
        local range = tvb(poff + 8 + 2 * i, 2)
        indices[i] = range:le_uint()
        tree:add_le(F.sparse_index, range)
    end
    if values > poff + 8 + 2 * nnz then
        tree:add(F.sparse_padding, tvb(poff + 8 + 2 * nnz, values - poff - 8 - 2 * nnz))
    end
    if dtype == 0 then
        if nnz > 0 then tree:add(F.payload, tvb(values, nnz)) end
        return
    end
    local sub = tree:add(netdam, tvb(values, nnz * element), string.format("Values (%d)", nnz))
    add_elements(sub, tvb, values, nnz, dtype, indices)
end

local function dissect_payload(tree, tvb, pinfo, name, poff, size)
    local flags, dtype, aux_lo = tvb(2, 2):uint(), tvb(48, 1):uint(), tvb(44, 4):uint()
    local aux_hi, coll_id = tvb(40, 4):uint(), tvb(16, 4):uint()
    local prange = tvb(poff, size)
    local ptree = tree:add(F.payload, prange)
    if name == "START_COLL" and (size == 64 or size == 80) then
        ptree:set_text(string.format("START_COLL descriptor (%d bytes)", size))
        ptree:add_le(F.d_algo, tvb(poff, 1))
        local fl = ptree:add_le(F.d_flags, tvb(poff + 1, 1))
        fl:add(F.d_sparse, tvb(poff + 1, 1))
        fl:add(F.d_update, tvb(poff + 1, 1))
        ptree:add_le(F.d_window, tvb(poff + 2, 2))
        ptree:add_le(F.d_rank, tvb(poff + 4, 4))
        ptree:add_le(F.d_count, tvb(poff + 8, 8))
        ptree:add_le(F.d_in_addr, tvb(poff + 16, 8))
        ptree:add_le(F.d_out_addr, tvb(poff + 24, 8))
        ptree:add_le(F.d_rkey, tvb(poff + 32, 4))
        ptree:add_le(F.d_root, tvb(poff + 36, 4))
        local g = ptree:add_le(F.d_group, tvb(poff + 40, 8))
        add_endpoint_u64_le(g, tvb, poff + 40, F.d_group_ip, F.d_group_port)
        local h = ptree:add_le(F.d_host, tvb(poff + 48, 8))
        add_endpoint_u64_le(h, tvb, poff + 48, F.d_host_ip, F.d_host_port)
        ptree:add_le(F.d_timeout, tvb(poff + 56, 4))
        ptree:add_le(F.d_reserved, tvb(poff + 60, 4))
        if size == 80 then
            local key = poff + 64 -- the tag key block follows the 64-byte descriptor
            ptree:add_le(F.d_tag_k0, tvb(key, 8))
            ptree:add_le(F.d_tag_k1, tvb(key + 8, 8))
        end
    elseif name == "INFO" and size == 32 then
        ptree:set_text("INFO (32 bytes)")
        ptree:add_le(F.info_version, tvb(poff, 4))
        ptree:add_le(F.info_mtu, tvb(poff + 4, 4))
        ptree:add_le(F.info_memory, tvb(poff + 8, 8))
        ptree:add_le(F.info_max_payload, tvb(poff + 16, 4))
        ptree:add_le(F.info_max_segments, tvb(poff + 20, 4))
        ptree:add_le(F.info_rank, tvb(poff + 24, 4))
        ptree:add_le(F.info_world, tvb(poff + 28, 4))
    elseif name == "REGISTER" then
        ptree:add_le(F.reg_rkey, tvb(poff, 4))
        local r = ptree:add_le(F.reg_rights, tvb(poff + 4, 4))
        for _, f in ipairs(RIGHT_FIELDS) do r:add_le(f, tvb(poff + 4, 4)) end
        if size == 24 then
            local key = poff + 8 -- a tagged region's key (SPEC.md 6.1)
            ptree:add_le(F.reg_tag_k0, tvb(key, 8))
            ptree:add_le(F.reg_tag_k1, tvb(key + 8, 8))
        end
    elseif name == "DEREGISTER" then
        ptree:add_le(F.dereg_rkey, tvb(poff, 4))
        ptree:add_le(F.dereg_reserved, tvb(poff + 4, 4))
    elseif name == "ALLOC" and size == 40 then
        ptree:set_text("ALLOC request (40 bytes)")
        ptree:add_le(F.alloc_size, tvb(poff, 8))
        ptree:add_le(F.alloc_credential, tvb(poff + 8, 8))
        ptree:add_le(F.alloc_stride, tvb(poff + 16, 4))
        ptree:add_le(F.alloc_ways, tvb(poff + 20, 2))
        ptree:add_le(F.alloc_rights, tvb(poff + 22, 1))
        ptree:add_le(F.alloc_flags, tvb(poff + 23, 1))
        ptree:add(F.alloc_label, tvb(poff + 24, 16), tvb(poff + 24, 16):stringz())
    elseif (name == "FREE" or name == "QUERY") and size == 8 then
        ptree:add_le(F.pool_credential, tvb(poff, 8))
    elseif name == "ACK" and size >= 56 and ((size - 56) % 24 == 0 or (size - 72) % 24 == 0)
        and tvb(poff, 8):le_uint64() == tvb(32, 8):uint64()
        and tvb(poff + 24, 4):le_uint() == tvb(24, 4):uint() then
        -- The region record of an ALLOC/FREE/QUERY answer: its gaddr and rkey are the header's.
        local ways = tvb(poff + 32, 2):le_uint()
        ptree:set_text(string.format("Region record (%d ways)", ways))
        ptree:add_le(F.region_gaddr, tvb(poff, 8))
        ptree:add_le(F.region_size, tvb(poff + 8, 8))
        ptree:add_le(F.region_credential, tvb(poff + 16, 8))
        ptree:add_le(F.region_rkey, tvb(poff + 24, 4))
        ptree:add_le(F.region_stride, tvb(poff + 28, 4))
        ptree:add_le(F.region_ways, tvb(poff + 32, 2))
        ptree:add_le(F.region_rights, tvb(poff + 34, 1))
        ptree:add_le(F.region_flags, tvb(poff + 35, 1))
        ptree:add(F.region_label, tvb(poff + 40, 16), tvb(poff + 40, 16):stringz())
        local tagged = band(tvb(poff + 35, 1):uint(), 1) == 1
        if tagged and size >= 72 + 24 * ways then
            local key = poff + 56 + 24 * ways -- the tag key follows the ways
            ptree:add_le(F.region_tag_k0, tvb(key, 8))
            ptree:add_le(F.region_tag_k1, tvb(key + 8, 8))
        end
        for k = 0, math.min(ways, math.floor((size - 56) / 24)) - 1 do
            local w = poff + 56 + 24 * k
            local wt = ptree:add(F.region_way, tvb(w, 24))
            wt:set_text(string.format("Way %d", k))
            wt:add_le(F.way_node, tvb(w, 4))
            wt:add_le(F.way_local, tvb(w + 8, 8))
            wt:add_le(F.way_size, tvb(w + 16, 8))
        end
    elseif name == "FETCH_ADD" then
        ptree:add_le(F.addend, tvb(poff, 8))
    elseif name == "CAS" then
        ptree:add_le(F.compare, tvb(poff, 8))
        ptree:add_le(F.swap, tvb(poff + 8, 8))
    elseif (name == "ACK" or name == "NACK") and coll_id ~= 0 and aux_hi == 0
        and COLL_MESSAGE[aux_lo] ~= nil then
        if aux_lo == 1 and size >= 16 and name == "ACK" then
            ptree:add_le(F.chains_resent, tvb(poff, 8))
            ptree:add_le(F.repair_reads, tvb(poff + 8, 8))
            if size >= 40 then  -- the phases (SPEC.md 4.1)
                ptree:add_le(F.phase_start, tvb(poff + 16, 8))
                ptree:add_le(F.phase_chains, tvb(poff + 24, 4))
                ptree:add_le(F.phase_chunks, tvb(poff + 28, 4))
                ptree:add_le(F.phase_done, tvb(poff + 32, 4))
            end
        elseif aux_lo == 1 and size == 16 then
            ptree:add_le(F.first_missing, tvb(poff, 8))
            ptree:add_le(F.last_missing, tvb(poff + 8, 8))
        elseif aux_lo == 3 then
            ptree:add(F.bitmap, prange)
        end
    elseif name == "ACK" and size == 8 then
        ptree:add_le(F.old, tvb(poff, 8))
    elseif name == "ACK" and size > 16 and size % 8 == 0 then
        -- COUNTERS reply: u64 LE each (node layout, SPEC.md 6.3; a switch appends more)
        local count = math.floor(size / 8)
        ptree:set_text(string.format("Counters (%d)", count))
        for i = 0, count - 1 do
            local label = COUNTER[i]
            if label == nil and i >= COUNTER_OPCODE_BASE and i < COUNTER_NACK_BASE then
                local op = OPCODE[i - COUNTER_OPCODE_BASE]
                label = op and ("op_" .. string.lower(op))
            elseif label == nil and i >= COUNTER_NACK_BASE and i < NODE_COUNTERS then
                local st = STATUS[i - COUNTER_NACK_BASE]
                label = st and ("nack_" .. string.lower(st))
            end
            local item = ptree:add_le(F.counter, tvb(poff + 8 * i, 8))
            item:prepend_text(string.format("[%d] %s ", i, label or ""))
        end
    elseif name == "NACK" then
        ptree:add(F.nack_text, prange)
    elseif DATA_OPCODES[name] then
        if btest(flags, 0x0002) then
            ptree:set_text(string.format("Sparse payload (%d bytes)", size))
            dissect_sparse(ptree, tvb, poff, size, dtype)
        elseif dtype ~= 0 then
            local count = math.floor(size / ELEMENT_SIZE[dtype])
            ptree:add(F.elements, count):set_generated()
            add_elements(ptree, tvb, poff, count, dtype)
        end
    end
end

---------------------------------------------------------------------------------------------
-- Dissector

local function dissect(tvb, pinfo, tree)
    pinfo.cols.protocol = "NetDAM"
    local total = tvb:len()
    local root = tree:add(netdam, tvb(0, total))
    if tvb:reported_len() > total then
        root:add_proto_expert_info(E.snapped)
    end
    local problem = validate(tvb)
    if total < HEADER_SIZE then
        root:add_tvb_expert_info(E.short, tvb(0, total), problem.text)
        root:add(F.error_status, STATUS_CODE[problem.status]):set_generated()
        root:add(F.error_text, problem.text):set_generated()
        root:append_text(string.format(" [%s]", problem.status))
        local short = string.format("NetDAM [%s: %s]", problem.status, problem.text)
        pinfo.cols.info:set(short)
        return total, short
    end

    local opcode = tvb(1, 1):uint()
    local name = OPCODE[opcode] or string.format("opcode 0x%02x", opcode)
    local flags = tvb(2, 2):uint()
    local seg_count = tvb(54, 1):uint()
    local length = tvb(28, 4):uint()

    root:add(F.version, tvb(0, 1))
    root:add(F.opcode, tvb(1, 1))
    local fl = root:add(F.flags, tvb(2, 2))
    fl:append_text(" (" .. flag_names(flags) .. ")")
    for _, f in ipairs(FLAG_FIELDS) do fl:add(f, tvb(2, 2)) end
    if band(flags, bnot(FLAGS_V1_MASK)) ~= 0 then
        fl:add(F["flags.undefined"], tvb(2, 2))
    end
    root:add(F.seq, tvb(4, 4))
    root:add(F.client_id, tvb(8, 4))
    root:add(F.txn_id, tvb(12, 4))
    root:add(F.coll_id, tvb(16, 4))
    root:add(F.epoch, tvb(20, 4))
    root:add(F.rkey, tvb(24, 4))
    root:add(F.length, tvb(28, 4))
    local addr = root:add(F.addr, tvb(32, 8))
    if (name == "JOIN" or name == "LEAVE") and tvb(32, 2):uint() == 0 then
        addr:append_text(string.format(" (group %s:%d)", ipv4_string(tvb(34, 4):uint()),
            tvb(38, 2):uint()))
        addr:add(F.group_ip, tvb(34, 4))
        addr:add(F.group_port, tvb(38, 2))
    end
    local aux = root:add(F.aux_addr, tvb(40, 8))
    if (name == "JOIN" or name == "LEAVE") and tvb(40, 2):uint() == 0
        and (tvb(42, 4):uint() ~= 0 or tvb(46, 2):uint() ~= 0) then
        aux:add(F.member_ip, tvb(42, 4))
        aux:add(F.member_port, tvb(46, 2))
    end
    local coll_id = tvb(16, 4):uint()
    if (name == "ACK" or name == "NACK") and coll_id ~= 0 and tvb(40, 4):uint() == 0
        and COLL_MESSAGE[tvb(44, 4):uint()] ~= nil then
        aux:add(F.coll_message, tvb(44, 4):uint()):set_generated()
    end
    root:add(F.dtype, tvb(48, 1))
    root:add(F.reduce_op, tvb(49, 1))
    local st = root:add(F.status, tvb(50, 1))
    root:add(F.credit, tvb(51, 1))
    root:add(F.seg_type, tvb(52, 1))
    root:add(F.segments_left, tvb(53, 1))
    root:add(F.seg_count, tvb(54, 1))
    root:add(F.reserved1, tvb(55, 1))
    local ret_ip, ret_port = tvb(56, 4):uint(), tvb(60, 2):uint()
    local ret_note = (ret_ip == 0 and ret_port == 0) and " (the UDP source)" or ""
    local ret = root:add(netdam, tvb(56, 6), string.format("Return segment: %s:%d%s",
        ipv4_string(ret_ip), ret_port, ret_note))
    ret:add(F.ret_ip, tvb(56, 4))
    ret:add(F.ret_port, tvb(60, 2))
    root:add(F.reserved2, tvb(62, 2))

    -- SR list: as many segments as were captured
    local shown = math.min(seg_count, math.floor((total - HEADER_SIZE) / SEGMENT_SIZE))
    if seg_count > 0 then
        local segments_left = tvb(53, 1):uint()
        local sr = root:add(netdam, tvb(HEADER_SIZE, SEGMENT_SIZE * math.max(shown, 0)),
            string.format("SR list (%d segments)", seg_count))
        for index = 0, shown - 1 do
            local off = HEADER_SIZE + SEGMENT_SIZE * index
            local role = ""
            if name == "START_COLL" then
                role = string.format(" (rank %d)", index)
            elseif index == seg_count - 1 - segments_left then
                role = " (this hop)"
            elseif index == seg_count - 1 then
                role = " (last hop)"
            end
            local seg = sr:add(netdam, tvb(off, SEGMENT_SIZE), string.format("Segment %d: %s:%d%s",
                index, ipv4_string(tvb(off, 4):uint()), tvb(off + 4, 2):uint(), role))
            seg:add(F.seg_index, index):set_generated()
            seg:add(F.seg_ip, tvb(off, 4))
            seg:add(F.seg_port, tvb(off + 4, 2))
            seg:add(F.seg_reserved, tvb(off + 6, 2))
        end
    end

    local poff = HEADER_SIZE + SEGMENT_SIZE * seg_count
    local pend = total
    if btest(flags, FLAG_TAGGED) and total >= poff + TAG_SIZE then
        pend = total - TAG_SIZE
        root:add_le(F.tag, tvb(pend, TAG_SIZE))
    end
    if problem == nil and pend > poff then
        dissect_payload(root, tvb, pinfo, name, poff, pend - poff)
    elseif problem ~= nil and pend > poff then
        root:add(F.payload, tvb(poff, pend - poff))
    end

    local status = tvb(50, 1):uint()
    local info = string.format("%s addr=%s len=%d status=%s", name, u64hex(tvb, 32), length,
        STATUS[status] or tostring(status))
    if coll_id ~= 0 then
        info = info .. string.format(" coll=%d seq=%d", coll_id, tvb(4, 4):uint())
    end
    info = info .. string.format(" txn=%d", tvb(12, 4):uint())
    if name == "NACK" and STATUS[status] ~= nil then
        st:add_proto_expert_info(E.nack, "NACK " .. STATUS[status])
    end
    if problem ~= nil then
        local blamed = math.max(math.min(problem.len, total - problem.offset), 0)
        local range = tvb(problem.offset, blamed)
        root:add_tvb_expert_info(E[problem.status], range, problem.text)
        root:add(F.error_status, STATUS_CODE[problem.status]):set_generated()
        root:add(F.error_text, problem.text):set_generated()
        info = info .. string.format(" [%s: %s]", problem.status, problem.text)
    end
    root:append_text(string.format(", %s%s", name, REPLY_OPCODES[name] and " (reply)" or ""))
    if problem ~= nil then root:append_text(string.format(" [%s]", problem.status)) end
    pinfo.cols.info:set(info)
    return total, info
end

-- UDP-GSO super-frames. The header carries no segment size, so it comes from the datagrams: the
-- first one's dense size (header + SR list + length), else the smallest size at which the first
-- datagram validates; a size counts only if every boundary it implies starts a v1 header with a
-- known opcode (one GSO send may batch different packets of one size: a READ_RESP, then an ACK).
local function header_at(tvb, offset)
    return offset + 2 <= tvb:len() and tvb(offset, 1):uint() == tvb(0, 1):uint()
        and OPCODE[tvb(offset + 1, 1):uint()] ~= nil
end

local function gso_fits(tvb, size)
    local total = tvb:len()
    if size < HEADER_SIZE or size >= total then return false end
    for offset = size, total - 1, size do
        if not header_at(tvb, offset) then return false end
    end
    return validate(tvb(0, size):tvb()) == nil
end

local function gso_size(tvb)
    local total = tvb:len()
    if total < 2 * HEADER_SIZE or validate(tvb) == nil then return nil end
    local dense = HEADER_SIZE + SEGMENT_SIZE * tvb(54, 1):uint() + tvb(28, 4):uint()
    if gso_fits(tvb, dense) then return dense end
    for size = HEADER_SIZE, total - 1 do
        if header_at(tvb, size) and gso_fits(tvb, size) then return size end
    end
    return nil
end

local function dissect_frame(tvb, pinfo, tree)
    local size = gso_size(tvb)
    if size == nil then
        return (dissect(tvb, pinfo, tree))
    end
    local total = tvb:len()
    local count = math.ceil(total / size)
    local first
    local index = 0
    for offset = 0, total - 1, size do
        index = index + 1
        local part = tvb(offset, math.min(size, total - offset)):tvb("GSO datagram " .. index)
        local _, info = dissect(part, pinfo, tree)
        first = first or info
    end
    local top = tree:add(netdam, tvb(0, total), string.format(
        "UDP-GSO super-frame: %d datagrams of %d bytes (the last %d)", count, size,
        total - size * (count - 1)))
    top:add(F.gso_size, size):set_generated()
    top:add(F.gso_segment, count):set_generated()
    pinfo.cols.info:set(string.format("NetDAM GSO x%d: %s", count, first))
    return total
end

function netdam.dissector(tvb, pinfo, tree)
    return dissect_frame(tvb, pinfo, tree)
end

-- Heuristic for other ports: a plausible v1 header (SPEC.md 2.1: version 1, a known opcode,
-- reserved bytes and undefined flag bits zero, known enums, a consistent SR list that fits).
local function looks_like_netdam(tvb)
    local total = tvb:len()
    if total < HEADER_SIZE then return false end
    if tvb(0, 1):uint() ~= PROTOCOL_VERSION or OPCODE[tvb(1, 1):uint()] == nil then return false end
    if band(tvb(2, 2):uint(), bnot(FLAGS_V1_MASK)) ~= 0 then return false end
    if tvb(55, 1):uint() ~= 0 or tvb(62, 2):uint() ~= 0 then return false end
    if DTYPE[tvb(48, 1):uint()] == nil or REDUCE_OP[tvb(49, 1):uint()] == nil
        or STATUS[tvb(50, 1):uint()] == nil then
        return false
    end
    local seg_type, seg_count = tvb(52, 1):uint(), tvb(54, 1):uint()
    if seg_type > 1 or (seg_type == 0) ~= (seg_count == 0) then return false end
    return total >= HEADER_SIZE + SEGMENT_SIZE * seg_count
end

local function heuristic(tvb, pinfo, tree)
    if not looks_like_netdam(tvb) then return false end
    dissect_frame(tvb, pinfo, tree)
    return true
end

netdam.prefs.udp_port = Pref.uint("UDP port", NETDAM_UDP_PORT,
    "UDP port always dissected as NetDAM (other ports: heuristic)")
netdam.prefs.ports = Pref.range("UDP ports", "",
    "More UDP ports always dissected as NetDAM, e.g. a cluster's (`netdam capture` prints them): "
    .. "17744-17747,40001", 65535)
netdam.prefs.max_payload = Pref.uint("Largest payload", MAX_PAYLOAD_BYTES,
    "The capture's largest payload, SPEC.md 2.7: 8192 at MTU 9000, 61440 at an emulation MTU "
    .. "of 65000 (`-o netdam.max_payload:61440`)")

local udp_table = DissectorTable.get("udp.port")
local registered_port = NETDAM_UDP_PORT
local registered_ports = ""
udp_table:add(registered_port, netdam)
netdam:register_heuristic("udp", heuristic)

function netdam.prefs_changed()
    if netdam.prefs.udp_port ~= registered_port then
        udp_table:remove(registered_port, netdam)
        registered_port = netdam.prefs.udp_port
        udp_table:add(registered_port, netdam)
    end
    local ports = tostring(netdam.prefs.ports or "")
    if ports ~= registered_ports then
        if registered_ports ~= "" then udp_table:remove(registered_ports, netdam) end
        registered_ports = ports
        if ports ~= "" then udp_table:add(ports, netdam) end
    end
end
