"""What every ``--plot FILE`` shares: matplotlib on demand, units, and lines that stay visible.

- matplotlib comes from ``pip install matplotlib`` (or the checkout's ``[plot]`` extra: netdam is
  not on the package index, so ``'netdam[plot]'`` resolves nothing there); without it
  ``--plot`` is a usage error naming that command, checked before any work starts.
- Units as the text output gives them: sizes in KiB/MiB/GiB (axis ticks on powers of two),
  bandwidths in GB/s (10^9 bytes/s, as nccl-tests prints algbw and busbw; our JSON keeps
  ``*_gbps`` in 10^9 bits/s, BRIEF section 7), times in us.
- Two algorithms whose curves coincide (the model gives some the same time) must both stay
  visible: every series gets its own marker and line style, drawn thinner and with smaller
  markers the later it comes, so the one below shows around the one on top.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

from netdam.cli.common import CommandError, ExitCode
from netdam.units import format_size

PLOT_HINT = ("--plot needs matplotlib: pip install matplotlib (from a netdam checkout: pip install '.[plot]'), "
             "or drop --plot")

#: (marker, line style) per series, in order: distinct in both, so coincident lines stay visible.
_STYLES = (("o", "-"), ("s", "--"), ("^", "-."), ("D", ":"), ("v", (0, (5, 1))), ("x", (0, (3, 1, 1, 1))),
           ("P", (0, (1, 1))), ("*", "-"))  # fmt: skip


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


def styles() -> Iterator[dict[str, Any]]:
    """Keyword arguments for successive ``ax.plot`` calls (see the module docstring)."""
    for index, (marker, line) in enumerate(itertools.cycle(_STYLES)):
        shrink = min(index, 6)
        yield {"marker": marker, "linestyle": line, "markersize": 7 - 0.6 * shrink,
               "linewidth": 2.2 - 0.2 * shrink, "markerfacecolor": "none" if index % 2 else None,
               "zorder": 10 - shrink}  # fmt: skip


def size_axis(ax: Any, label: str = "bytes per node") -> None:
    """Log-2 x axis with ticks as 4KiB, 1MiB, 1GiB."""
    # Imported here: an optional or heavy dependency (matplotlib), loaded only by the commands that use it.
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_size(int(round(x))) if x >= 1 else ""))
    ax.set_xlabel(label)


def gbytes_per_s(gbps: float) -> float:
    """10^9 bits/s (our JSON) to GB/s (10^9 bytes/s, nccl-tests' unit)."""
    return gbps / 8.0


def finish(fig: Any, path: str, title: str) -> None:
    fig.suptitle(title)
    for ax in fig.axes:
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
