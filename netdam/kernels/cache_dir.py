"""Where numba caches the compiled kernels: a per-user directory, never the installed package.

numba's default puts ``*.nbi``/``*.nbc`` files in ``__pycache__`` beside each source file, that
is inside ``site-packages/netdam`` for a regular install. pip does not know those files, so
``pip uninstall`` leaves them, and the folder they keep alive shadows a later editable install
of the same package (``netdam --version`` then failed with ``AttributeError: __version__``).
So the kernels of this package get a locator of their own, consulted before numba's:

    <root>/kernels-<netdam version>-<hash of every kernel source>-numba<numba version>

``<root>`` is ``$NETDAM_CACHE_DIR``, else ``$NUMBA_CACHE_DIR/netdam``, else
``$XDG_CACHE_HOME/netdam`` (``~/.cache/netdam``), else ``<tmp>/netdam-cache-<uid>``.

- The sources' hash: numba keys a cached function by its own file's stamp, not by the files it
  calls (after an upgrade that changes ``collective.py`` but not ``serve.py``, a cached
  ``serve._serve_nics`` would still run the old engine); a new directory per source set settles it.
- Keyed by content, not place: a cached function's stamp is that hash, not its file's time
  (numba's default), so every install of the same sources (a second venv, a fresh clone, the
  wheel beside the checkout) loads what the first one compiled instead of compiling for minutes
  again, and two installs used in turn do not invalidate each other. numba's version is in the
  name (its index holds one version's code).
- The KEEP most recently used directories stay; older ones are removed, so upgrades and
  branches do not pile up (~21 MB each).
- Cache files are pickles that numba loads and runs: a directory that another user can write
  would let them run code as ours. The root must belong to us and be writable by nobody else;
  otherwise the kernels compile into a private temporary directory for this process alone
  (slower, never unsafe) and one warning says why and what to fix.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import logging
import os
import shutil
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

import numba
from numba.core import caching

import netdam
from netdam import progress
from netdam.protocol import layout as protocol_layout

log = logging.getLogger(__name__)

_KERNELS = Path(__file__).resolve().parent
#: Protocol modules whose module-level ints the kernels compile in as constants (field offsets,
#: opcodes, statuses, counter indices): a change there must not run kernels cached with the old
#: values, so they count as kernel sources.
_PROTOCOL = Path(protocol_layout.__file__).resolve().parent
_PROTOCOL_INPUTS = ("layout.py", "constants.py", "counters.py")

# numba >= 0.61 made these names public; the tested range starts at 0.59 (udp_io.NUMBA_TESTED).
_CacheImpl: Any = getattr(caching, "CacheImpl", None) or caching._CacheImpl
_CacheLocator: Any = caching._CacheLocator
_SourceBacked: Any = caching._SourceFileBackedLocatorMixin

_chosen: Path | None = None
#: Cache directories kept (the most recently used): two or three branches or versions in turn
#: never recompile, and the folder stays under ~100 MB.
KEEP = 4
#: When this process first found its cache empty and said so (monotonic seconds), else None.
cold_since: float | None = None


def cache_root() -> Path:
    """The per-user folder holding every netdam kernel cache (see the module's docstring)."""
    if os.environ.get("NETDAM_CACHE_DIR"):
        return Path(os.environ["NETDAM_CACHE_DIR"])
    if os.environ.get("NUMBA_CACHE_DIR"):
        return Path(os.environ["NUMBA_CACHE_DIR"]) / "netdam"
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg:
        return Path(xdg) / "netdam"
    try:
        home = Path.home()
    except RuntimeError:  # no HOME and no passwd entry
        home = None
    # A service user such as nobody has a home that does not exist or is not its own.
    if home is not None and home.is_dir() and os.access(home, os.W_OK):
        return home / ".cache" / "netdam"
    return Path(tempfile.gettempdir()) / f"netdam-cache-{os.getuid()}"


@functools.cache
def sources_digest() -> str:
    """A hash of every kernel source file and of the protocol modules they compile in (name and
    bytes)."""
    digest = hashlib.sha256()
    for source in sorted(_KERNELS.glob("*.py")) + [_PROTOCOL / name for name in _PROTOCOL_INPUTS]:
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def kernel_cache_dir() -> Path:
    """This install's cache directory (created on first use, mode 0700)."""
    global _chosen
    if _chosen is None:
        _chosen = _choose()
    return _chosen


def _choose() -> Path:
    root = cache_root()
    name = f"kernels-{netdam.__version__}-{sources_digest()}-numba{numba.__version__}"
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = _unsafe(root)
        if problem is None:
            folder = root / name
            folder.mkdir(mode=0o700, exist_ok=True)
            problem = _unsafe(folder)
            if problem is None:
                os.utime(folder)  # used now: what _remove_unused keeps
                _remove_unused(root)
                return folder
    except OSError as exc:
        problem = f"cannot create it ({exc.strerror})"
    private = Path(tempfile.mkdtemp(prefix="netdam-kernels-"))
    atexit.register(shutil.rmtree, private, True)
    log.warning(
        "kernel cache %s not used: %s; compiling into %s for this process only "
        "(set NETDAM_CACHE_DIR to a folder of your own)",
        root,
        problem,
        private,
    )
    return private


def _unsafe(folder: Path) -> str | None:
    """Why numba must not load pickled code from *folder*, or None when it is ours alone."""
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        return "it is not a plain directory"
    if info.st_uid != os.getuid():
        return f"it belongs to uid {info.st_uid}, not to us ({os.getuid()})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"others may write to it (mode {stat.S_IMODE(info.st_mode):o}; chmod go-w fixes it)"
    if not os.access(folder, os.W_OK):
        return "it is not writable"
    return None


def _remove_unused(root: Path) -> None:
    """Remove all but the KEEP most recently used cache directories (best effort: a process of
    other sources may still read one; it then compiles in memory)."""

    def used(folder: Path) -> float:
        try:
            return folder.stat().st_mtime
        except OSError:
            return 0.0

    folders = sorted(root.glob("kernels-*"), key=used, reverse=True)
    for old in folders[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


class _KernelCacheLocator(_SourceBacked, _CacheLocator):
    """numba's cache locator for the functions defined in this package, and only those."""

    def __init__(self, py_func: Any, py_file: str) -> None:
        self._py_file = py_file
        self._lineno = py_func.__code__.co_firstlineno
        self._cache_path = str(kernel_cache_dir())

    def get_cache_path(self) -> str:
        return self._cache_path

    def get_source_stamp(self) -> str:
        # The sources' hash (also the directory's name), not the file's mtime: a fresh clone
        # or another venv of the same sources finds the index fresh.
        return sources_digest()

    @classmethod
    def from_function(cls, py_func: Any, py_file: str) -> Any:
        if Path(py_file).resolve().parent != _KERNELS:
            return None
        return super().from_function(py_func, py_file)


def announce_cold_cache() -> None:
    """Say once, on stderr, that this run compiles the kernels (its cache holds none yet)."""
    global cold_since
    folder = kernel_cache_dir()
    if cold_since is None and not any(folder.glob("*.nbi")):
        cold_since = time.monotonic()
        progress.note(
            f"first run: compiling the kernels once (1-3 min on 2 cores, longer on a busy "
            f"machine; cached in {folder} for later runs)"
        )
        progress.status("compiling the kernels (once)")


def install_cache_locator() -> None:
    """Put the kernels' locator first in numba's list (once), and remove the cache files that
    versions before it left in the package's ``__pycache__`` (best effort: a read-only install
    keeps them, unused)."""
    classes = _CacheImpl._locator_classes
    if _KernelCacheLocator not in classes:
        classes.insert(0, _KernelCacheLocator)
        pycache = _KERNELS / "__pycache__"
        for leftover in [*pycache.glob("*.nb[ic]"), pycache / "kernels.sources.sha256"]:
            try:
                leftover.unlink()
            except OSError:
                break
