"""Progress and notes on stderr for work that takes more than a second (issue 14).

Two kinds of output, both on stderr so that stdout keeps exactly the result (one JSON object
under ``--json``, BRIEF section 7):

- ``note(text)``: one line a user should see once (the first run compiles the kernels, how long
  it took). Printed unless ``-q``.
- ``Progress``: a single line redrawn in place (``\\r``) while work runs, erased at the end.
  Drawn only when stderr is a terminal, and never under ``--json`` or ``-q``: a log file or a
  pipe gets no carriage-return noise.

No dependency: a one-line redraw needs no library, and netdam's core install stays light.
"""

from __future__ import annotations

import shutil
import sys
import threading
import time
from types import TracebackType

_SETTINGS = {"quiet": False, "bars": True}


def configure(*, quiet: bool = False, json_output: bool = False) -> None:
    """Set by the ``netdam`` entry point from ``-q`` and ``--json``."""
    _SETTINGS["quiet"] = quiet
    _SETTINGS["bars"] = not quiet and not json_output


def quiet() -> bool:
    return bool(_SETTINGS["quiet"])


#: The progress line being drawn now (notes clear it first, then it redraws).
_CURRENT: list[Progress] = []


def note(text: str) -> None:
    """One line on stderr (unless ``-q``), above the progress line when one is drawn."""
    if _SETTINGS["quiet"]:
        return
    current = _CURRENT[-1] if _CURRENT else None
    if current is not None:
        current.clear()
    print(f"netdam: {text}", file=sys.stderr, flush=True)
    if current is not None:
        current.update()


def finish() -> None:
    """End every progress line now (before the result goes to stdout, or when a command turns
    from work into waiting, as `up` in the foreground does)."""
    for current in list(_CURRENT):
        current.close()


def describe(text: str) -> None:
    """Say what the whole command does on its progress line (``netdam flood: 60 s at the node``);
    ``status`` then names the phase beside it."""
    if _CURRENT:
        current = _CURRENT[-1]
        current.label = f"{current.label.split(':')[0]}: {text}"
        current.update()


def status(text: str) -> None:
    """What the command does now, shown on the progress line (no-op without one)."""
    if _CURRENT:
        _CURRENT[-1].update(text)


def bars_enabled() -> bool:
    """Whether a progress line may be drawn now: stderr is a terminal, no -q, no --json."""
    return bool(_SETTINGS["bars"]) and sys.stderr.isatty()


def format_seconds(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


class Progress:
    """``with Progress("all-reduce", total=5) as p: ... p.advance()``: a line such as
    ``all-reduce  3/5  12.4 s`` redrawn at most ten times a second, with the elapsed time ticking
    on its own thread while a step blocks (a compile, a start-up). Without *total* it shows the
    elapsed time and the latest ``status``."""

    def __init__(self, label: str, total: int | None = None, delay: float = 0.0) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.status = ""
        self._start = time.monotonic()
        self._enabled = bars_enabled()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._width = 0
        #: Seconds before the line first shows: quick commands never flash one.
        self._delay = delay

    def __enter__(self) -> Progress:
        _CURRENT.append(self)
        if self._enabled:
            self._thread = threading.Thread(target=self._tick, name="netdam-progress", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self in _CURRENT:
            _CURRENT.remove(self)
        self.clear()

    def clear(self) -> None:
        """Erase the line (before other output, and at the end)."""
        if self._enabled and self._width:
            with self._lock:
                sys.stderr.write("\r" + " " * self._width + "\r")
                sys.stderr.flush()
                self._width = 0

    def advance(self, steps: int = 1, status: str | None = None) -> None:
        self.done += steps
        self.update(status)

    def update(self, status: str | None = None) -> None:
        if status is not None:
            self.status = status
        if self._enabled:
            self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(0.1):
            self._draw()

    def _draw(self) -> None:
        if self._stop.is_set() or time.monotonic() - self._start < self._delay:
            return
        count = f"  {self.done}/{self.total}" if self.total else ""
        status = f"  {self.status}" if self.status else ""
        text = f"{self.label}{count}  {format_seconds(time.monotonic() - self._start)}{status}"
        text = text[
            : max(shutil.get_terminal_size().columns - 1, 20)
        ]  # a wrapped line never erases
        with self._lock:
            pad = max(self._width - len(text), 0)
            sys.stderr.write("\r" + text + " " * pad)
            sys.stderr.flush()
            self._width = len(text)
