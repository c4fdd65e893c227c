"""What every ``--plot FILE`` shares: matplotlib on demand, units, colours, line styles, legend.

- matplotlib comes from ``pip install matplotlib`` (or the checkout's ``[plot]`` extra: netdam is
  not on the package index, so ``'netdam[plot]'`` resolves nothing there); without it
  ``--plot`` is a usage error naming that command, checked before any work starts.
- Units as the text output gives them: sizes in KiB/MiB/GiB (axis ticks on powers of two),
  rates in Gb/s (10^9 bits/s, the JSON's ``*_gbps`` and the model's link speeds), times in us
  or seconds as the axis says.
- One colour per algorithm or peer, the same in every figure (chain is blue in the benchmark
  and in the model); the line style says where a number comes from: measured solid, model
  dashed. Coincident curves stay visible: each series gets its own marker, drawn thinner and
  smaller the later it comes, so the one below shows around the one on top.
- One compact legend for the whole figure, outside the axes (below them): a key of colours,
  markers and line styles, never one entry per line, never over the data.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from netdam.outcome import CommandError, ExitCode
from netdam.units import format_size

PLOT_HINT = (
    "--plot needs matplotlib: pip install matplotlib (from a netdam checkout: pip install '.[plot]'), "
    "or drop --plot"
)

#: Line styles by where the numbers come from.
MEASURED = "-"
MODEL = "--"
#: Markers in order for series a colour does not tell apart (node counts, several curves).
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*")

#: Fixed colours (matplotlib's tab10) of the algorithms and peers every figure draws, so one name
#: has one colour everywhere; a model algorithm takes the colour of what it models.
_NAMED_COLORS = {
    "chain": "C0",
    "netdam-chain": "C0",
    "netdam": "C0",
    "chain-resident": "C4",
    # The same at the emulation MTU (SPEC.md 2.7): tab20's light shade of their colour.
    "chain-emu": "#aec7e8",
    "chain-resident-emu": "#c5b0d5",
    "ring-host": "C1",
    "roce-ring": "C1",
    "gloo": "C2",
    "mpi": "C3",
    "mpi-shm": "C7",
    "memcached": "C3",
    "roce-ideal": "C5",
    "halving-doubling": "C6",
    "ideal": "C8",
    "echo": "C7",
}


def color(name: str, order: Sequence[str] = ()) -> str:
    """The colour of algorithm or peer *name*; other names (node counts) take matplotlib's
    colour cycle by their place in *order*."""
    if name in _NAMED_COLORS:
        return _NAMED_COLORS[name]
    return f"C{order.index(name) % 10}" if name in order else "C9"


def pyplot() -> Any:
    """matplotlib.pyplot with a file backend, or a usage error naming the extra."""

    try:
        # Imported here: an optional or heavy dependency (matplotlib), loaded only by the commands that use it.
        import matplotlib

        matplotlib.use("Agg")
        # Imported here: an optional or heavy dependency (matplotlib), loaded only by the commands that use it.
        import matplotlib.pyplot as plt
    except ImportError:
        raise CommandError(PLOT_HINT, ExitCode.USAGE) from None
    return plt


def figure(
    plt: Any, rows: int, cols: int, *, width: float = 5.2, height: float = 3.9
) -> tuple[Any, list[Any]]:
    """A figure of rows x cols panels (in reading order) with room for the legend below them:
    constrained layout places a legend given as ``loc="outside ..."`` outside every axes."""
    fig, axes = plt.subplots(
        rows, cols, figsize=(width * cols, height * rows + 0.6), layout="constrained", squeeze=False
    )
    return fig, list(axes.flat)


def series_style(
    index: int, name: str, *, model: bool = False, order: Sequence[str] = ()
) -> dict[str, Any]:
    """``ax.plot`` keywords of the index-th series of algorithm *name*: its colour, measured
    solid or model dashed, marker index (see the module docstring)."""
    shrink = min(index, 6)
    return {
        "color": color(name, order),
        "linestyle": MODEL if model else MEASURED,
        "marker": MARKERS[index % len(MARKERS)],
        "markersize": 6.5 - 0.5 * shrink,
        "linewidth": 2.0 - 0.2 * shrink,
        "markerfacecolor": "none" if model else None,
        "zorder": 10 - shrink,
    }


@dataclass
class Key:
    """The figure's legend: what each colour, marker and line style means, one entry each."""

    #: (label, style, is_patch): a line/marker sample, or a filled patch for bar charts.
    entries: list[tuple[str, dict[str, Any], bool]] = field(default_factory=list)

    def colors(self, names: Iterable[str], order: Sequence[str] = ()) -> Key:
        for name in names:
            self.entries.append((name, {"color": color(name, order), "linewidth": 6}, False))
        return self

    def markers(self, labels: Iterable[str]) -> Key:
        for index, label in enumerate(labels):
            self.entries.append(
                (
                    label,
                    {"color": "0.3", "linestyle": "none", "marker": MARKERS[index % len(MARKERS)]},
                    False,
                )
            )
        return self

    def line(self, label: str, **style: Any) -> Key:
        self.entries.append((label, {"color": "0.3", **style}, False))
        return self

    def patch(self, label: str, **style: Any) -> Key:
        """A bar sample (e.g. hatched for p99)."""
        self.entries.append((label, {"facecolor": "0.6", "edgecolor": "0.3", **style}, True))
        return self

    def sources(self, measured: str | None = "measured", model: str | None = "model") -> Key:
        """The line styles: measured solid, model dashed (either left out with None)."""
        if measured:
            self.line(measured, linestyle=MEASURED)
        if model:
            self.line(model, linestyle=MODEL)
        return self


def size_axis(ax: Any, label: str = "bytes per node") -> None:
    """Log-2 x axis with ticks as 4KiB, 1MiB, 1GiB."""
    # Imported here: an optional or heavy dependency (matplotlib), loaded only by the commands that use it.
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(
        FuncFormatter(lambda x, _: format_size(int(round(x))) if x >= 1 else "")
    )
    ax.set_xlabel(label)


def nodes_axis(ax: Any, nodes: Sequence[int]) -> None:
    """Log-2 x axis of node counts, a tick at each count that ran."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(nodes), [str(n) for n in nodes])
    ax.minorticks_off()
    ax.set_xlabel("nodes")


def finish(fig: Any, path: Any, title: str, key: Key) -> None:
    """Title, grids, the one legend below the panels, then write *path* and free the figure."""
    # Imported here: an optional or heavy dependency (matplotlib), loaded only by the commands that use it.
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    fig.suptitle(title, fontsize=10)
    for ax in fig.axes:
        ax.grid(True, which="both", alpha=0.3)
    if key.entries:
        handles = [
            Patch(**style) if is_patch else Line2D([], [], **style)
            for _, style, is_patch in key.entries
        ]
        labels = [label for label, _, _ in key.entries]
        # One row when it fits the figure's width (about 14 characters per inch at this font
        # size, with the handle), else as few rows as fit: matplotlib fills columns first.
        width = fig.get_figwidth() * 14
        chars = sum(len(label) + 8 for label in labels)
        rows = max(1, -(-chars // int(width)))
        fig.legend(
            handles,
            labels,
            loc="outside lower center",
            ncol=-(-len(labels) // rows),
            fontsize=8,
            frameon=False,
        )
    fig.savefig(path, dpi=110)
    plt.close(fig)
