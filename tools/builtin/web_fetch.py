"""web_fetch: a page's readable text, from allowlisted hosts only (tools/web.py).

Arguments: {"url": "https://..."}. Output: a JSON object with url (after redirects), status,
content_type, text and truncated.
"""

from __future__ import annotations

import json

from schemas import ToolCall
from tools.base import Outcome, ToolError
from tools.config import tool_settings
from tools.web import fetch

MAX_URL_CHARS = 2048


class WebFetch:
    name = "web_fetch"

    async def run(self, call: ToolCall, args: dict) -> Outcome:
        url = args.get("url")
        if not isinstance(url, str) or not url or len(url) > MAX_URL_CHARS:
            raise ToolError(
                f'web_fetch needs {{"url": "http(s)://..."}} of at most {MAX_URL_CHARS} characters'
            )
        page = await fetch(url, tool_settings())
        output = json.dumps(
            {
                "url": page.url,
                "status": page.status,
                "content_type": page.content_type,
                "text": page.text,
                "truncated": page.truncated,
            }
        )
        ok = page.status < 400
        return Outcome(
            output,
            ok=ok,
            error=None if ok else f"HTTP {page.status} from {page.url}",
            meta={"status": str(page.status), "chars": str(len(page.text))},
        )


TOOL = WebFetch()
