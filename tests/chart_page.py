"""The chat page's rendering of a code interpreter's results, in a real headless Chromium: the finished
code_interpreter_call item and the file citations that gateway/responses_framing.py streams for a real
tool result, handed to the page's own functions; the picture and the file are fetched by the page from
the real gateway with the page's key. (The step before, a model writing the chart's code, is beyond the
135M model the tests run: it does not copy a three-statement script into a call.)"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path

from tests.gateway_support import Chromium, default_key
from tests.voice_page import CHROMIUM


def framed(result, conversation_id: str) -> tuple[dict, list[dict]]:
    """The call item and the citations the framer streams for a run whose code step had `result`'s files
    (its output and call id those of a two-step run's; its container the conversation's)."""
    import msgspec

    from gateway.responses_framing import ResponseFramer, base_response
    from tests.test_responses_units import RID, _events_of_a_two_step_run

    spec, events = _events_of_a_two_step_run()
    events[4] = msgspec.structs.replace(events[4], meta=result.meta)
    framer = ResponseFramer(RID, spec, base_response(RID, 1, "m", {}), conversation_id)
    out = framer.start() + framer.feed(events)
    citations = [e["annotation"] for e in out if e["type"] == "response.output_text.annotation.added"]
    return out[-1]["response"]["output"][0], citations


async def chart_on_the_page(gateway: str, item: dict, citations: list[dict], tmp_path: Path) -> list:
    """Show the run's code step and its answer's citations on the page; returns the chart's size and the
    cited data.csv as the page downloads it. Fails unless the chart is drawn."""
    browser = Chromium(tmp_path / "profile", CHROMIUM)
    try:
        await asyncio.to_thread(browser.connect)
        await asyncio.to_thread(browser.call, "Page.enable")
        await asyncio.to_thread(browser.call, "Page.navigate", url=f"{gateway}/#key={default_key()}")
        await asyncio.to_thread(browser.wait_for, "document.body.dataset.state === 'idle'", 60)
        await asyncio.to_thread(
            browser.js,
            f"""(() => {{
            const div = bubble("assistant", "The chart and its table: ");
            showStep(callView(div), {json.dumps(item)});
            for (const note of {json.dumps(citations)}) fileLink(div, note);
        }})()""",
        )
        drawn = "(() => { const i = document.querySelector('img.chart'); return i && i.naturalWidth > 0; })()"
        await asyncio.to_thread(browser.wait_for, drawn, 30)
        size = await asyncio.to_thread(
            browser.js,
            "[document.querySelector('img.chart').naturalWidth, "
            "document.querySelector('img.chart').naturalHeight]",
        )
        assert size[0] >= 300 and size[1] >= 200, size  # matplotlib's figure, not a broken-image icon
        # the cited table, downloaded through the page's link (fetched with the key into a blob)
        table = (
            "Array.from(document.querySelectorAll('a.file')).find(a => a.textContent.endsWith('data.csv'))"
        )
        await asyncio.to_thread(browser.js, f"{table}.click()")
        await asyncio.to_thread(browser.wait_for, f"{table}.href.startsWith('blob:')", 30)
        text = await asyncio.to_thread(browser.js, f"fetch({table}.href).then(r => r.text())")
        picture = tmp_path / "code-interpreter-chart.png"
        await asyncio.to_thread(browser.screenshot, picture)
        if os.environ.get("TOKENSTREAM_SCREENSHOTS"):  # for bench/results
            shutil.copy(picture, Path(os.environ["TOKENSTREAM_SCREENSHOTS"]) / picture.name)
        return [size, text]
    finally:
        browser.close()
