"""The RoCE models against published host all-reduce measurements.

Each set in ``measurements/sets.toml`` pairs a CSV of measured all-reduce times (one row per
node count and size, its source in the '#' lines) with a parameter file for the hosts it ran
on. ``compare_set`` runs a model on every row and reports measured, modelled and their ratio;
the geometric mean of the ratio over the rows from ``validate_from_bytes`` up is the figure
fpga_model/README.md quotes and tests/fpga_model/test_fpga_validation.py bounds to [0.67, 1.5].
"""

from __future__ import annotations

import csv
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from .collectives import roce_ideal, roce_ring
from .params import RoceParams, load_params_file

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 fallback
    import tomli as tomllib

MEASUREMENTS_DIR = Path(__file__).resolve().parent / "measurements"
VALIDATION_MODELS = ("roce-ring", "roce-ideal")
BOUNDS = (0.67, 1.5)  # issue 16: geometric mean of model / measured over each set


@dataclass(frozen=True)
class MeasuredPoint:
    """One published all-reduce time: *nbytes* per rank over *nodes* hosts."""

    nodes: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class MeasuredSet:
    """A published set of host all-reduce times and the hosts it ran on."""

    key: str
    title: str
    citation: str
    library: str
    hosts: str
    metric: str
    validate_from_bytes: int
    params: RoceParams
    points: tuple[MeasuredPoint, ...]


@dataclass(frozen=True)
class ComparedPoint:
    """One row: measured time, the model's time and the algorithm the model ran."""

    point: MeasuredPoint
    model_seconds: float
    algorithm: str

    @property
    def ratio(self) -> float:
        return self.model_seconds / self.point.seconds


@dataclass(frozen=True)
class SetComparison:
    """A model against one set: every row, and the geometric means over validated rows."""

    measured: MeasuredSet
    model: str
    rows: tuple[ComparedPoint, ...]

    @property
    def validated(self) -> tuple[ComparedPoint, ...]:
        return tuple(r for r in self.rows if r.point.nbytes >= self.measured.validate_from_bytes)

    @property
    def geomean(self) -> float:
        return geometric_mean([r.ratio for r in self.validated])

    def geomean_by_nodes(self) -> dict[int, float]:
        nodes = sorted({r.point.nodes for r in self.validated})
        return {
            n: geometric_mean([r.ratio for r in self.validated if r.point.nodes == n])
            for n in nodes
        }

    def as_dict(self) -> dict[str, object]:
        return {
            "set": self.measured.key,
            "model": self.model,
            "params": self.measured.params.name,
            "validate_from_bytes": self.measured.validate_from_bytes,
            "geomean_ratio": self.geomean,
            "geomean_ratio_by_nodes": {str(k): v for k, v in self.geomean_by_nodes().items()},
            "within_bounds": BOUNDS[0] <= self.geomean <= BOUNDS[1],
            "rows": [
                {
                    "nodes": r.point.nodes,
                    "bytes": r.point.nbytes,
                    "measured_seconds": r.point.seconds,
                    "model_seconds": r.model_seconds,
                    "ratio": r.ratio,
                    "host_algorithm": r.algorithm or None,
                }
                for r in self.rows
            ],
        }


def geometric_mean(values: list[float]) -> float:
    if not values:
        raise ValueError("geometric mean of no values")
    return math.exp(sum(math.log(v) for v in values) / len(values))


def _read_points(path: Path) -> tuple[MeasuredPoint, ...]:
    with path.open(newline="") as fh:
        rows = csv.DictReader(line for line in fh if not line.startswith("#"))
        points = []
        for row in rows:
            if int(row["ppn"]) != 1:
                raise ValueError(
                    f"{path.name}: the model is one process per node, got ppn {row['ppn']}"
                )
            points.append(
                MeasuredPoint(int(row["nodes"]), int(row["bytes"]), float(row["latency_us"]) * 1e-6)
            )
    if not points:
        raise ValueError(f"{path.name}: no rows")
    return tuple(points)


def load_sets(directory: Path = MEASUREMENTS_DIR) -> list[MeasuredSet]:
    """Every set listed in *directory*/sets.toml, with its rows and host parameters."""
    with (directory / "sets.toml").open("rb") as fh:
        doc = tomllib.load(fh)
    sets = []
    for key, meta in doc.items():
        params = load_params_file(directory / str(meta["params"])).roce
        if params is None:
            raise ValueError(f"{meta['params']}: a measurement set needs RoCE host parameters")
        sets.append(
            MeasuredSet(
                key=key,
                title=str(meta["title"]),
                citation=str(meta["citation"]),
                library=str(meta["library"]),
                hosts=str(meta["hosts"]),
                metric=str(meta["metric"]),
                validate_from_bytes=int(meta["validate_from_bytes"]),
                params=params,
                points=_read_points(directory / f"{key}.csv"),
            )
        )
    return sets


def compare_set(measured: MeasuredSet, model: str = "roce-ring") -> SetComparison:
    """Run *model* (``roce-ring`` or ``roce-ideal``) on every row of *measured*."""
    if model not in VALIDATION_MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(VALIDATION_MODELS)}")
    run = roce_ring if model == "roce-ring" else roce_ideal
    rows = []
    for pt in measured.points:
        est = run(measured.params, pt.nodes, pt.nbytes)
        rows.append(ComparedPoint(pt, est.seconds, est.algorithm))
    return SetComparison(measured, model, tuple(rows))


__all__ = [
    "BOUNDS",
    "MEASUREMENTS_DIR",
    "VALIDATION_MODELS",
    "ComparedPoint",
    "MeasuredPoint",
    "MeasuredSet",
    "SetComparison",
    "compare_set",
    "geometric_mean",
    "load_sets",
]
