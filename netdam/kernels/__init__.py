"""Every numba kernel of the project (the only package that imports numba).

Importing this package first points numba's on-disk cache (``cache=True``) for the kernels
here at a per-user directory outside the installed package (netdam.kernels.cache_dir): an
install never holds compiled code that an uninstall would leave behind, and that directory's
name carries a hash of all kernel sources, since numba keys its cache by each function's own
file, not by the files it calls. It also types calls between the kernels by their arguments'
types, not their constant values (netdam.kernels.dispatch), which cuts a third of the compile.
"""

from __future__ import annotations

from netdam.kernels.cache_dir import announce_cold_cache, install_cache_locator
from netdam.kernels.dispatch import unliteral_calls

install_cache_locator()
unliteral_calls()  # before any kernel compiles: one specialization per type (dispatch.py)
# The kernel modules compile their typed signatures as they are imported: on a first run that
# is most of the compile, and the user should hear why nothing happens before it starts.
announce_cold_cache()
