"""code_interpreter: run Python in the conversation's sandbox (tools/sandbox.py).

Arguments: {"code": "<python>"}. Output: a JSON object with stdout, stderr, the last expression's
value (repr), the files the run wrote (path, bytes, text preview) and the exit status; the files are
kept in the conversation's container (tools/containers.py), their ids in the result's meta
(`container_id`, `files`) for the client, not in what the model reads.
"""

from __future__ import annotations

import json

from schemas import ToolCall
from schemas import keys as K
from tools.base import Outcome, ToolError
from tools.config import tool_settings
from tools.containers import ContainerFiles
from tools.sandbox import Sandbox

MAX_CODE_CHARS = 100_000


class CodeInterpreter:
    name = "code_interpreter"

    def __init__(self) -> None:
        self._sandbox: Sandbox | None = None
        self._containers: ContainerFiles | None = None

    @property
    def containers(self) -> ContainerFiles:
        if self._containers is None:
            self._containers = ContainerFiles(tool_settings().file_mb << 20)
        return self._containers

    @property
    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            self._sandbox = Sandbox(tool_settings())
        return self._sandbox

    def warm_up(self) -> None:
        """Run `1 + 1` in a sandbox once, so a processor that cannot sandbox fails at start, not per call."""
        import asyncio

        run = asyncio.run(self.sandbox.run("tokenstream-probe", "start-up", "1 + 1"))
        if run.value != "2":
            raise RuntimeError(
                f"the code interpreter's sandbox does not work: {run.error}\n{run.stderr[-2000:]}\n"
                f"(bubblewrap must be installed, and {self.sandbox.root} and every folder above it "
                f"searchable by uid {self.sandbox.cfg.sandbox_uid}: set TOKENSTREAM_TOOLS_SANDBOX_DIR, "
                "see tools/README.md)"
            )

    async def run(self, call: ToolCall, args: dict) -> Outcome:
        code = args.get("code")
        if not isinstance(code, str) or not code.strip():
            raise ToolError('code_interpreter needs {"code": "<python source>"}')
        if len(code) > MAX_CODE_CHARS:
            raise ToolError(f"code is longer than {MAX_CODE_CHARS} characters")
        if not call.conversation_id:
            raise ToolError("code_interpreter needs the call's conversation_id (its working folder)")
        run = await self.sandbox.run(call.tenant, call.conversation_id, code)
        output = json.dumps(
            {
                "stdout": run.stdout,
                "stderr": run.stderr,
                "value": run.value,
                "files": run.files,
                "exit_code": run.exit_code,
                "truncated": run.truncated,
            }
        )
        meta = {"wall_s": f"{run.wall_s:.3f}", "exit_code": str(run.exit_code)}
        if run.files:  # kept as the container's files, for the client to list and download (the model reads
            # `output`; the ids are for the client, in meta)
            kept = await self.containers.keep(
                call.tenant,
                call.conversation_id,
                call.call_id,
                self.sandbox.workdir(call.tenant, call.conversation_id),
                run.files,
            )
            meta["container_id"] = K.container_id(call.conversation_id)
            meta["files"] = json.dumps(
                [{k: f[k] for k in ("path", "bytes", "file_id", "kept")} for f in kept]
            )
        if run.cpu_s is not None:
            meta["cpu_s"] = f"{run.cpu_s:.3f}"
        if run.max_rss_kb is not None:
            meta["max_rss_kb"] = str(run.max_rss_kb)
        return Outcome(output, ok=run.error is None, error=run.error, meta=meta)


TOOL = CodeInterpreter()
