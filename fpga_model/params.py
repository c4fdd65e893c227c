"""Model parameters: frozen dataclasses, loadable from TOML, each value with its provenance.

Every parameter of a preset carries a status:

- ``sourced``: a published number, used as printed (the source names the document and table);
- ``derived``: arithmetic on sourced numbers (the source shows the arithmetic);
- ``fitted``: solved so that the model reproduces one published measurement (named), which
  is then never used as a validation point;
- ``assumed``: not published anywhere we could read; a design guess with its rationale;
- ``override``: set by a user TOML file without a status.

Units are SI: seconds, bytes, bytes per second, hertz; ``*_gbps`` is 10^9 bit/s.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Union

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 fallback
    import tomli as tomllib

COLL_DECISIONS = ("openmpi-4.1", "openmpi-4.0")
STATUSES = ("sourced", "derived", "fitted", "assumed", "override")
PRESET_DIR = Path(__file__).resolve().parent / "presets"


@dataclass(frozen=True)
class Provenance:
    """Where one parameter value comes from."""

    status: str
    source: str


def _p(doc: str, unit: str) -> Any:
    """A dataclass field with no default and its documentation in the metadata."""
    return field(metadata={"doc": doc, "unit": unit})


@dataclass(frozen=True)
class NetdamParams:
    """A NetDAM card: Ethernet port, FPGA datapath, card memory and the fabric around it."""

    kind: ClassVar[str] = "netdam"

    name: str = field(metadata={"doc": "preset or file name", "unit": ""})
    link_gbps: float = _p("port speed", "Gb/s")
    mtu: int = _p("IP MTU", "B")
    mac_clock_hz: float = _p("MAC user-bus clock (CMAC LBUS / AXI-S)", "Hz")
    mac_bus_bytes: int = _p("MAC user-bus width", "B")
    mac_phy_rx_s: float = _p("receive latency of transceiver + RS-FEC + PCS/MAC", "s")
    mac_phy_tx_s: float = _p("transmit latency of MAC/PCS + RS-FEC + transceiver", "s")
    clock_hz: float = _p("user-logic clock of the NetDAM pipeline", "Hz")
    bus_bytes: int = _p("user-logic datapath width (also the SIMD ALU width)", "B")
    parse_cycles: int = _p("RX pipeline depth: clock crossing, header parse, checks", "cycles")
    reply_cycles: int = _p("TX pipeline depth: header rewrite, checksum, clock crossing", "cycles")
    mem_kind: str = _p("memory technology: hbm, ddr4 or sram", "")
    mem_latency_s: float = _p("memory read latency seen by the pipeline (controller incl.)", "s")
    mem_jitter_s: float = _p("standard deviation of the memory latency", "s")
    mem_jitter_max_s: float = _p("largest extra memory latency above the mean", "s")
    mem_channels: int = _p("memory channels the address space is interleaved over", "")
    mem_channel_bytes_per_s: float = _p("peak bandwidth of one memory channel", "B/s")
    mem_efficiency: float = _p("achieved / peak memory bandwidth", "")
    mem_access_bytes: int = _p("smallest memory access (burst)", "B")
    mem_max_outstanding: int = _p("memory reads in flight; completions retire in order", "")
    alu_latency_cycles: int = _p("pipeline latency of the fp32 adder", "cycles")
    rx_buffer_packets: int = _p("packets each pipeline queue holds (RX FIFO depth)", "packets")
    propagation_s: float = _p("cable propagation per hop", "s")
    switch_latency_s: float = _p("port-to-port latency of the switch between nodes", "s")
    provenance: tuple[tuple[str, Provenance], ...] = field(
        default=(), compare=False, repr=False, metadata={"doc": "", "unit": ""}
    )

    def __post_init__(self) -> None:
        _check_positive(self)
        if self.mem_kind not in ("hbm", "ddr4", "sram"):
            raise ValueError(f"mem_kind must be hbm, ddr4 or sram, got {self.mem_kind!r}")
        if not 0.0 < self.mem_efficiency <= 1.0:
            raise ValueError(f"mem_efficiency must be in (0, 1], got {self.mem_efficiency}")

    @property
    def mem_bytes_per_s(self) -> float:
        """Achievable memory bandwidth: channels x per-channel peak x efficiency."""
        return self.mem_channels * self.mem_channel_bytes_per_s * self.mem_efficiency

    @property
    def datapath_bytes_per_s(self) -> float:
        """Bytes per second one user-logic bus moves."""
        return self.bus_bytes * self.clock_hz

    def source_of(self, name: str) -> Provenance:
        """Provenance of parameter *name* (``assumed``/"unknown" if none was recorded)."""
        return dict(self.provenance).get(name, Provenance("assumed", "no provenance recorded"))


@dataclass(frozen=True)
class RoceParams:
    """A RoCE host: ConnectX-class NIC on PCIe, host DRAM, one CPU core doing reductions."""

    kind: ClassVar[str] = "roce"

    name: str = field(metadata={"doc": "preset or file name", "unit": ""})
    link_gbps: float = _p("port speed", "Gb/s")
    mtu: int = _p("IP MTU of the Ethernet fabric", "B")
    roce_mtu_bytes: int = _p("RoCE path MTU (data bytes per packet)", "B")
    nic_side_s: float = _p("one NIC side: MAC/PHY + NIC pipeline, per direction", "s")
    nic_max_mpps: float = _p("NIC message (packet) rate limit", "Mpps")
    pcie_gen: int = _p("PCIe generation (x16)", "")
    pcie_raw_bytes_per_s: float = _p("PCIe x16 raw bandwidth per direction", "B/s")
    pcie_bytes_per_s: float = _p("PCIe x16 achieved DMA bandwidth per direction", "B/s")
    pcie_read_16b_s: float = _p("PCIe DMA read latency of 16 B (round trip)", "s")
    pcie_read_per_byte_s: float = _p("extra DMA read latency per byte above 16 B", "s/B")
    pcie_max_outstanding: int = _p("DMA reads in flight (PCIe tags)", "")
    host_dram_bytes_per_s: float = _p("host DRAM bandwidth available to I/O + reduction", "B/s")
    ddio_hit_rate: float = _p("fraction of DMA writes that stay in the LLC (DDIO)", "")
    cpu_reduce_bytes_per_s: float = _p("one core: bytes of vector reduced per second", "B/s")
    cpu_memcpy_bytes_per_s: float = _p("one core: bytes copied per second", "B/s")
    rx_buffer_packets: int = _p("packets each pipeline queue holds", "packets")
    propagation_s: float = _p("cable propagation per hop", "s")
    switch_latency_s: float = _p("port-to-port latency of the switch between nodes", "s")
    # Host-library (MPI over verbs) costs of the `roce-ring` model; zero them for `roce-ideal`.
    sw_message_s: float = _p("software per message: verbs post + doorbell + CQ poll", "s")
    sw_step_s: float = _p("MPI progress engine per algorithm step (matching, requests)", "s")
    eager_limit_bytes: int = _p("largest message sent eagerly; above it rendezvous", "B")
    eager_copies: int = _p("memory copies per eager byte (into and out of bounce buffers)", "")
    coll_decision: str = _p(
        "the library's algorithm choice: openmpi-4.1 (coll/tuned table of "
        "Open MPI >= 4.1) or openmpi-4.0 (its older fixed rule)",
        "",
    )
    send_buffer_copies: int = _p(
        "whole-vector copies before the algorithm starts (send buffer "
        "into receive buffer when not in place)",
        "",
    )
    small_allreduce_bytes: int = _p(
        "openmpi-4.0: below this vector size recursive doubling, else ring", "B"
    )
    ring_segment_bytes: int = _p(
        "openmpi-4.0: segment of the segmented ring (comm/reduce pipelined)", "B"
    )
    provenance: tuple[tuple[str, Provenance], ...] = field(
        default=(), compare=False, repr=False, metadata={"doc": "", "unit": ""}
    )

    def __post_init__(self) -> None:
        _check_positive(self)
        if not 0.0 <= self.ddio_hit_rate <= 1.0:
            raise ValueError(f"ddio_hit_rate must be in [0, 1], got {self.ddio_hit_rate}")
        if self.coll_decision not in COLL_DECISIONS:
            raise ValueError(
                f"coll_decision must be one of {', '.join(COLL_DECISIONS)}, "
                f"got {self.coll_decision!r}"
            )

    @property
    def pcie_half_rtt_s(self) -> float:
        """One PCIe crossing (posted write, doorbell): half the 16 B DMA read round trip."""
        return self.pcie_read_16b_s / 2.0

    def pcie_read_s(self, nbytes: int) -> float:
        """DMA read latency of *nbytes* (linear between the pcie-bench 16 B and 1 KiB points)."""
        return self.pcie_read_16b_s + max(0, nbytes - 16) * self.pcie_read_per_byte_s

    def source_of(self, name: str) -> Provenance:
        """Provenance of parameter *name*."""
        return dict(self.provenance).get(name, Provenance("assumed", "no provenance recorded"))


NicParams = Union[NetdamParams, RoceParams]  # noqa: UP007 (a runtime alias; 3.10 target)
_CLASSES: dict[str, type[NetdamParams] | type[RoceParams]] = {
    "netdam": NetdamParams,
    "roce": RoceParams,
}
_ALLOW_ZERO = {
    "mem_jitter_s",
    "mem_jitter_max_s",
    "ddio_hit_rate",
    "propagation_s",
    "switch_latency_s",
    "parse_cycles",
    "reply_cycles",
    "alu_latency_cycles",
    "pcie_read_per_byte_s",
    "sw_message_s",
    "sw_step_s",
    "eager_limit_bytes",
    "eager_copies",
    "small_allreduce_bytes",
    "send_buffer_copies",
}


def _check_positive(params: NetdamParams | RoceParams) -> None:
    for f in fields(params):
        value = getattr(params, f.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if value != value or value < 0 or (value == 0 and f.name not in _ALLOW_ZERO):
                raise ValueError(f"parameter {f.name} must be positive, got {value}")


def param_names(kind: str) -> list[str]:
    """Names of the tunable parameters of *kind* (``netdam`` or ``roce``)."""
    return [f.name for f in fields(_CLASSES[kind]) if f.name not in ("name", "provenance")]


def param_doc(kind: str, name: str) -> tuple[str, str]:
    """(description, unit) of parameter *name*."""
    for f in fields(_CLASSES[kind]):
        if f.name == name:
            return str(f.metadata["doc"]), str(f.metadata["unit"])
    raise KeyError(name)


@dataclass(frozen=True)
class ParamSet:
    """What a ``--params`` file may define: a NetDAM card, a RoCE host, or both."""

    netdam: NetdamParams | None = None
    roce: RoceParams | None = None


def preset_names() -> list[str]:
    """Names of the shipped presets (``fpga_model/presets/*.toml``)."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def load_preset(name: str) -> NicParams:
    """Load the shipped preset *name* (e.g. ``netdam-100g``, ``roce-gen3``)."""
    path = PRESET_DIR / f"{name}.toml"
    if not path.is_file():
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(preset_names())}")
    with path.open("rb") as fh:
        return params_from_mapping(tomllib.load(fh), origin=f"preset {name}", depth=0)


def load_params_file(path: str | Path) -> ParamSet:
    """Load a user TOML file: either one system (top-level ``kind``) or ``[netdam]``/``[roce]``.

    Each system table may name a ``base`` preset and then override parameters, either as a
    plain value (status ``override``) or as ``{value = ..., status = ..., source = ...}``.
    """
    file = Path(path)
    try:
        with file.open("rb") as fh:
            doc = tomllib.load(fh)
    except OSError as exc:
        raise ValueError(f"cannot read parameter file {str(file)!r}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"parameter file {str(file)!r} is not valid TOML: {exc}") from None
    if "kind" in doc:
        single = params_from_mapping(doc, origin=str(file), depth=0)
        if isinstance(single, NetdamParams):
            return ParamSet(netdam=single)
        return ParamSet(roce=single)
    unknown = set(doc) - {"netdam", "roce"}
    if unknown or not doc:
        raise ValueError(
            f'parameter file {str(file)!r}: give a top-level kind = "netdam"|"roce" or '
            f"[netdam] / [roce] tables (unexpected keys: {sorted(unknown)})"
        )
    out: dict[str, Any] = {}
    for kind in ("netdam", "roce"):
        if kind in doc:
            table = dict(doc[kind])
            table.setdefault("kind", kind)
            table.setdefault("base", _default_base(kind))
            out[kind] = params_from_mapping(table, origin=f"{file}[{kind}]", depth=0)
    return ParamSet(**out)


def _default_base(kind: str) -> str:
    return "netdam-100g" if kind == "netdam" else "roce-gen3"


def params_from_mapping(doc: Mapping[str, Any], origin: str, depth: int) -> NicParams:
    """Build parameters from a parsed TOML mapping (resolving ``base`` presets)."""
    if depth > 8:
        raise ValueError(f"{origin}: base presets nest too deeply (a cycle?)")
    kind = doc.get("kind")
    if kind not in _CLASSES:
        raise ValueError(f'{origin}: kind must be "netdam" or "roce", got {kind!r}')
    cls = _CLASSES[kind]
    values: dict[str, Any] = {}
    prov: dict[str, Provenance] = {}
    if "base" in doc:
        base_name = str(doc["base"])
        path = PRESET_DIR / f"{base_name}.toml"
        if not path.is_file():
            raise ValueError(f"{origin}: unknown base preset {base_name!r}")
        with path.open("rb") as fh:
            base = params_from_mapping(tomllib.load(fh), f"preset {base_name}", depth + 1)
        if base.kind != kind:
            raise ValueError(f"{origin}: base {base_name!r} is a {base.kind} preset, not {kind}")
        values = {f.name: getattr(base, f.name) for f in fields(base) if f.name != "provenance"}
        prov = dict(base.provenance)
    allowed = set(param_names(kind))
    reserved = {"kind", "base", "name", "description", "params"}
    params_table = dict(doc.get("params", {}))
    for key in set(doc) - reserved:  # flat keys next to kind/base are parameters too
        params_table[key] = doc[key]
    for key, raw in params_table.items():
        if key not in allowed:
            raise ValueError(
                f"{origin}: unknown {kind} parameter {key!r}; known: {', '.join(sorted(allowed))}"
            )
        if isinstance(raw, Mapping):
            status = str(raw.get("status", "override"))
            if status not in STATUSES:
                raise ValueError(f"{origin}: {key}: status must be one of {STATUSES}")
            values[key] = raw["value"]
            prov[key] = Provenance(status, str(raw.get("source", origin)))
        else:
            values[key] = raw
            prov[key] = Provenance("override", origin)
    values["name"] = str(doc.get("name", values.get("name", origin)))
    missing = allowed - set(values)
    if missing:
        raise ValueError(f"{origin}: missing parameters {sorted(missing)} (or give a base)")
    typed = {
        f.name: _coerce(f.type, values[f.name], f.name, origin)
        for f in fields(cls)
        if f.name != "provenance"
    }
    return cls(**typed, provenance=tuple(sorted(prov.items())))


def _coerce(type_name: Any, value: Any, key: str, origin: str) -> Any:
    text = str(type_name)
    if text == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{origin}: {key} must be an integer, got {value!r}")
        return value
    if text == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{origin}: {key} must be a number, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{origin}: {key} must be a string, got {value!r}")
    return value


def with_link(params: NicParams, link_gbps: float) -> NicParams:
    """A copy of *params* at another port speed (recorded as an override)."""
    if link_gbps == params.link_gbps:
        return params
    prov = dict(params.provenance)
    prov["link_gbps"] = Provenance("override", "--link-gbps")
    return dataclasses.replace(
        params, link_gbps=float(link_gbps), provenance=tuple(sorted(prov.items()))
    )


def default_presets(link_gbps: float) -> tuple[str, str]:
    """(NetDAM preset, RoCE preset) used for a port speed: 100G class or 200G class."""
    if link_gbps <= 100.0:
        return "netdam-100g", "roce-gen3"
    return "netdam-200g", "roce-gen4"
