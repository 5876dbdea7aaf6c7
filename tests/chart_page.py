"""The chat page's rendering of a code interpreter's results, in a real headless Chromium: a finished
code_interpreter_call item in the shape gateway/responses_framing.py streams it, and the citation of a
file the answer names, handed to the page's own functions; the picture and the file are fetched by
the page from the real gateway with the page's key. (The step before, a model writing the chart's code,
is beyond the 135M model the tests run: it does not copy a three-statement script into a call.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

from tests.gateway_support import Chromium, default_key
from tests.voice_page import CHROMIUM


async def chart_on_the_page(gateway: str, container: str, image_id: str, csv_id: str, tmp_path: Path) -> list:
    """Show the run on the page; returns the links it offers. Fails unless the chart is drawn."""
    browser = Chromium(tmp_path / "profile", CHROMIUM)
    try:
        await asyncio.to_thread(browser.connect)
        await asyncio.to_thread(browser.call, "Page.enable")
        await asyncio.to_thread(browser.call, "Page.navigate", url=f"{gateway}/#key={default_key()}")
        await asyncio.to_thread(browser.wait_for, "document.body.dataset.state === 'idle'", 60)
        item = {"type": "code_interpreter_call", "status": "completed", "code": "plt.savefig('plot.png')",
                "container_id": container, "outputs": [
                    {"type": "logs", "logs": "16\n"},
                    {"type": "image", "url": f"/v1/containers/{container}/files/{image_id}/content"}]}
        cite = {"type": "container_file_citation", "container_id": container, "file_id": csv_id,
                "filename": "data.csv", "start_index": 0, "end_index": 0}
        await asyncio.to_thread(browser.js, f"""(() => {{
            const div = bubble("assistant", "The chart and its table: ");
            showStep(callView(div), {json.dumps(item)});
            fileLink(div, {json.dumps(cite)});
        }})()""")
        drawn = "(() => { const i = document.querySelector('img.chart'); return i && i.naturalWidth > 0; })()"
        await asyncio.to_thread(browser.wait_for, drawn, 30)
        size = await asyncio.to_thread(browser.js, "[document.querySelector('img.chart').naturalWidth, "
                                                   "document.querySelector('img.chart').naturalHeight]")
        assert size[0] >= 300 and size[1] >= 200, size  # matplotlib's figure, not a broken-image icon
        # the cited file, downloaded through the page's link (fetched with the key into a blob)
        await asyncio.to_thread(browser.js, "document.querySelector('a.file').click()")
        await asyncio.to_thread(browser.wait_for, "document.querySelector('a.file').href.startsWith('blob:')", 30)
        text = await asyncio.to_thread(browser.js, "fetch(document.querySelector('a.file').href).then(r => r.text())")
        picture = tmp_path / "code-interpreter-chart.png"
        await asyncio.to_thread(browser.screenshot, picture)
        if os.environ.get("TOKENSTREAM_SCREENSHOTS"):  # for bench/results
            shutil.copy(picture, Path(os.environ["TOKENSTREAM_SCREENSHOTS"]) / picture.name)
        return [size, text]
    finally:
        browser.close()
