"""``python -m netdam.switch``: run one switch process (what ``netdam switch`` runs)."""

from __future__ import annotations

import sys

from netdam.switch.cli import main

if __name__ == "__main__":
    sys.exit(main())
