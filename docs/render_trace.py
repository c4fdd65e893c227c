"""Render a netdam trace in a browser's trace viewer, headless, for docs/trace.png.

Nothing here reaches a service: speedscope (npm, a browser trace viewer that opens the Chrome
trace event format) runs from its own files in Debian's Chromium, driven by Playwright.

    npm install speedscope@1.25.0            # into ./node_modules
    pip install playwright                   # its driver; the browser is the system's
    apt-get install chromium
    netdam allreduce --nodes 4 --size 1MiB --loss 0.03 --seed 4 --repeat 2 --trace t.json
    python docs/render_trace.py t.json docs/trace.png
"""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path


def main(trace: Path, out: Path, viewer: Path = Path("node_modules/speedscope")) -> None:
    # Imported here: only this script needs it.
    from playwright.sync_api import sync_playwright

    page_file = (viewer / "dist" / "release" / "index.html").resolve()
    loader = out.with_suffix(".load.js")
    encoded = base64.b64encode(trace.read_bytes()).decode()
    # How speedscope's own command line hands a file to its page.
    loader.write_text(
        f"speedscope.loadFileFromBase64({json.dumps(trace.name)}, {json.dumps(encoded)})"
    )
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 260})
            page.goto(f"file://{page_file}#localProfilePath={loader.resolve()}")
            page.wait_for_timeout(3000)
            page.screenshot(path=str(out))
            browser.close()
    finally:
        loader.unlink(missing_ok=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
