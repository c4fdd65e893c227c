"""Readable output: `pool read --format`, -v/-vv that show netdam's logs and not numba's, one
throughput unit (Gb/s) in every table, plots with a compact legend outside the data.

The pool read tests stand a fake client in for the switch (tests/switch/test_pool.py runs the real one);
the logging test runs a real command in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import netdam.cli.pool as pool_cli
import netdam.clients.pool as pool_client
from netdam.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
#: Memory as a node holds it: text, a byte that is no UTF-8, NUL padding, an ESC sequence.
STORED = "héllo\\ wörld\n".encode() + b"\xff\x00\x00\x1b[2J\xc2\x85"


# ---------------------------------------------------------------- pool read --format


class _FakeClient:
    """PoolClient's context manager and read(), returning STORED."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __enter__(self) -> _FakeClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        return None

    def read(self, gaddr: int, length: int, rkey: int, *, stride: int = 0) -> bytes:
        return STORED[:length]


@pytest.fixture
def fake_pool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[str]:
    """The argv prefix of `netdam pool read` against a fake switch."""

    class Ctl:
        switch = type("S", (), {"vip": ("127.0.0.1", 1)})()
        cluster = type("C", (), {"mtu": 9000})()

    monkeypatch.setattr(pool_cli, "_target", lambda args: (Ctl(), 0x1234, 0, {}))
    # The command imports the client when it runs (netdam.cli.pool._with_client).
    monkeypatch.setattr(pool_client, "PoolClient", _FakeClient)
    cluster = tmp_path / "c.toml"
    cluster.write_text("")  # --cluster must name a readable file; _target is faked
    return [
        "pool",
        "read",
        "--cluster",
        str(cluster),
        "--gaddr",
        "0x0",
        "--length",
        f"{len(STORED)}B",
    ]


def test_escape_text_is_unambiguous() -> None:
    assert pool_cli.escape_text(STORED) == "héllo\\\\ wörld\n\\xff\\x00\\x00\\x1b[2J\\u0085"
    assert pool_cli.escape_text(b"plain") == "plain"


def test_pool_read_default_is_hex(fake_pool: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(fake_pool) == 0
    assert capsys.readouterr().out == STORED.hex() + "\n"
    assert main([*fake_pool, "--format", "hex"]) == 0
    assert capsys.readouterr().out == STORED.hex() + "\n"


def test_pool_read_text(fake_pool: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*fake_pool, "--format", "text"]) == 0
    assert capsys.readouterr().out == pool_cli.escape_text(STORED) + "\n"


def test_pool_read_raw_is_the_exact_bytes(
    fake_pool: list[str], capfdbinary: pytest.CaptureFixture[bytes]
) -> None:
    assert main([*fake_pool, "--format", "raw", "-q"]) == 0
    assert capfdbinary.readouterr().out == STORED


def test_pool_read_json_keeps_hex(fake_pool: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*fake_pool, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {
        "ok": True,
        "gaddr": 0,
        "bytes": len(STORED),
        "hex": STORED.hex(),
    }
    assert main([*fake_pool, "--json", "--format", "raw"]) == 2
    assert "--format" in json.loads(capsys.readouterr().out)["error"]
    with pytest.raises(SystemExit) as usage:
        main([*fake_pool, "--format", "base64"])
    assert usage.value.code == 2


# ---------------------------------------------------------------- -v / -vv


#: After netdam's own set-up (the CLI's or the switch's), compile a fresh numba function: at
#: DEBUG numba logs every bytecode and SSA step of it (megabytes for the node kernels).
_COMPILE_AND_LOG = """
import logging, numba
numba.njit(lambda x: x * 3 + 1)(2)
logging.getLogger("netdam.cluster").debug("netdam debug line")
logging.getLogger("netdam.cluster").info("netdam info line")
print("launcher passes -vv on:", logging.getLogger().isEnabledFor(logging.DEBUG))
"""

_SETUPS = {
    "cli": "from netdam.cli.main import main\nmain(['-vv', 'decode', '0109'])\n",
    "switch": (
        "import netdam.switch.cli as s\ns.run_switch = lambda args: 0\n"
        "s.main(['--cluster', 'c.toml', '--vip', '127.0.0.1:9', '-vv'])\n"
    ),
}


@pytest.mark.parametrize("process", sorted(_SETUPS))
def test_vv_shows_netdam_logs_not_numba(process: str, tmp_path: Path) -> None:
    """-vv of the CLI (and so of node processes, which run `netdam node`) and of the switch:
    netdam's DEBUG lines show, numba's do not, and the root level still tells the launcher to
    pass -vv to the processes it starts."""
    done = subprocess.run(
        [sys.executable, "-c", _SETUPS[process] + _COMPILE_AND_LOG],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert "launcher passes -vv on: True" in done.stdout, done.stderr[-2000:]
    assert "netdam.cluster DEBUG netdam debug line" in done.stderr
    assert "netdam.cluster INFO netdam info line" in done.stderr
    assert "numba" not in done.stderr
    assert len(done.stderr) < 4000, done.stderr[:2000]


# ---------------------------------------------------------------- plots


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every figure netdam.tools.plot.finish writes, kept for inspection after it is saved."""
    pytest.importorskip("matplotlib", reason="the figure checks need matplotlib (the [plot] extra)")
    from netdam.tools import plot as plotting

    kept: list[Any] = []
    real = plotting.finish

    def keep(fig: Any, path: Any, title: str, key: plotting.Key) -> None:
        real(fig, path, title, key)
        kept.append(fig)

    monkeypatch.setattr(plotting, "finish", keep)
    return kept


def _check_layout(fig: Any, max_entries: int, texts: bool = False) -> None:
    """One compact legend outside every panel; no per-panel legend, no text on the data
    (unless *texts*: the values above a bar chart's bars)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)  # plt.close detached the saved figure from its canvas
    canvas.draw()  # lays the figure out again, as savefig did
    renderer = canvas.get_renderer()
    (legend,) = fig.legends
    assert len(legend.get_texts()) <= max_entries
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        assert ax.get_legend() is None and (texts or not ax.texts)
        assert not box.overlaps(ax.get_window_extent(renderer)), ax.get_title()


def test_bench_allreduce_plot_colour_per_algorithm(figures: list[Any], tmp_path: Path) -> None:
    import matplotlib.colors as mcolors

    import netdam.tools.bench.allreduce as B
    from netdam.tools import plot as plotting

    def runner(
        algo: str, nodes: int, count: int, warmup: int, repeat: int, timeout_s: float
    ) -> B._Outcome:
        return B._Outcome(times=[(1e-3 + count * 4e-9) * nodes] * repeat, ok=True)

    cfg = B.AllReduceBenchConfig(
        nodes=(2, 4, 8),
        sizes=(4096, 1 << 20),
        peers=("chain-resident", "ring-host"),
        repeat=1,
        plot=tmp_path / "b.png",
        progress=False,
    )
    B.run_allreduce_bench(cfg, runner=runner)
    (fig,) = figures
    # Before: 20 entries, one per line; now 3 algorithms + 3 node counts + measured + model.
    _check_layout(fig, max_entries=8)
    assert len(fig.axes) == 3
    algos = {mcolors.to_hex(plotting.color(a)): a for a in ("chain", "chain-resident", "ring-host")}
    styles: dict[str, set[str]] = {}
    for line in fig.axes[0].get_lines():
        styles.setdefault(algos[mcolors.to_hex(line.get_color())], set()).add(line.get_linestyle())
    # Measured solid and the model dashed in the algorithm's colour; ring-host's model is
    # chain-resident's netdam-chain, drawn once in chain's colour.
    assert styles == {"chain": {"-", "--"}, "chain-resident": {"-"}, "ring-host": {"-", "--"}}


def test_bench_pool_plot_legend_outside(figures: list[Any], tmp_path: Path) -> None:
    from netdam.tools import plot as plotting
    from netdam.tools.bench.pool import plot_pool

    def phase(ops: float) -> dict[str, Any]:
        return {"ops": ops, "p50_us": 100.0, "p99_us": 300.0}

    res = {
        "nodes": 2,
        "window": 32,
        "ratio": 0.5,
        "results": {"echo": phase(3e5), "read_64": phase(1e5), "memcached_get_64": phase(2e5)},
    }
    plot_pool(plotting.pyplot(), res, str(tmp_path / "p.png"))
    (fig,) = figures
    _check_layout(fig, max_entries=5, texts=True)


@pytest.mark.parametrize(
    "argv",
    [
        ["model", "sweep", "--sizes", "64KiB..16MiB", "--nodes", "2,4,8"],
        ["model", "allreduce", "--nodes", "4", "--size", "1MiB", "--algo", "roce-ring"],
    ],
)
def test_model_plots_dashed_legend_outside(
    argv: list[str], figures: list[Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*argv, "--plot", str(tmp_path / "m.png"), "-q"]) == 0
    (fig,) = figures
    _check_layout(fig, max_entries=8)
    for ax in fig.axes:
        curves = [line for line in ax.get_lines() if len(line.get_xdata()) > 2]
        assert curves and {line.get_linestyle() for line in curves} == {
            "--"
        }  # every curve is a model


# ---------------------------------------------------------------- one rate unit: Gb/s


def test_allreduce_line_prints_the_json_gbps(capsys: pytest.CaptureFixture[str]) -> None:
    """`netdam allreduce` used to print GB/s beside `netdam bench allreduce`'s Gb/s."""
    from netdam.cli.allreduce import _text

    row: dict[str, object] = {
        "algo": "chain",
        "ok": True,
        "nodes": 4,
        "bytes": 1 << 26,
        "dtype": "f32",
        "op": "sum",
        "seconds": 0.2412,
        "algbw_gbps": 2.2259,
        "busbw_gbps": 3.3388,
        "packets": 1,
        "retransmits": 0,
        "kernel_drops": 0,
        "model_seconds_100g": 0.008,
    }
    assert "(algbw 2.226 Gb/s, busbw 3.339 Gb/s)" in _text(row)


def test_model_allreduce_text_matches_json_gbps(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["model", "allreduce", "--nodes", "8", "--size", "64MiB", "--algo", "netdam-chain"]
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert f"algbw {data['algbw_gbps']:.2f} Gb/s, busbw {data['busbw_gbps']:.2f} Gb/s" in text
    assert main(["model", "sweep", "--sizes", "1MiB", "--nodes", "8"]) == 0
    assert capsys.readouterr().out.startswith("all-reduce busbw in Gb/s")


def test_no_gigabyte_rates_left() -> None:
    """Every rate a human reads is in Gb/s; GB/s appears only where nccl-tests' unit is named as
    an outside figure."""
    pattern = ("GB/s", "GiB/s", "Gbps")
    files = [
        *sorted((ROOT / "netdam").rglob("*.py")),
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
    ]
    offending = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in files
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if any(p in line for p in pattern) and "nccl-tests" not in line
    ]
    assert not offending, "\n".join(offending)


@pytest.mark.slow
def test_up_at_an_emulation_mtu_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`netdam up --mtu 65000` names the larger payloads its MTU gives (SPEC.md 2.7); the
    default MTU's start says nothing of it."""
    lines = {}
    for mtu in ("9000", "65000"):
        path = tmp_path / f"c{mtu}.toml"
        argv = ["up", "--nodes", "2", "--memory", "1MiB", "--mtu", mtu, "--detach"]
        assert main([*argv, "--cluster", str(path)]) == 0
        lines[mtu] = capsys.readouterr().out
        assert main(["down", "--cluster", str(path)]) == 0
    assert "an emulation MTU" not in lines["9000"]
    assert (
        "MTU 65000: an emulation MTU, payloads up to 61440 bytes where 9000 carries 8192"
        in lines["65000"]
    )
