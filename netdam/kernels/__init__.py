"""Every numba kernel of the project (the only package that imports numba).

numba's on-disk cache (``cache=True``) is keyed by each function's own source file, not by the
files it calls: after an upgrade that changes ``collective.py`` but not ``serve.py``, the cached
``serve._serve`` would still run the old engine. So the cache is tied to all kernel sources at
once: when their combined hash changes, this package's cache files are removed before any
kernel loads.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _invalidate_stale_cache() -> None:
    digest = hashlib.sha256()
    for source in sorted(_HERE.glob("*.py")):
        digest.update(source.name.encode())
        digest.update(source.read_bytes())
    stamp = _HERE / "__pycache__" / "kernels.sources.sha256"
    current = digest.hexdigest()
    try:
        if stamp.read_text() == current:
            return
    except OSError:
        pass
    try:
        stamp.parent.mkdir(exist_ok=True)
        for cached in stamp.parent.glob("*.nb[ic]"):
            cached.unlink(missing_ok=True)
        stamp.write_text(current)
    except OSError:
        pass  # a read-only install: numba then falls back to compiling in memory


_invalidate_stale_cache()
