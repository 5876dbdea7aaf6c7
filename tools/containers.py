"""Files a code interpreter run writes, kept as its container's files (OpenAI's containers API).

After each run the code interpreter hands the files the run wrote (tools/sandbox.py `written`) to
`ContainerFiles.keep`, which reads each one from the working folder (never following a link the
code may have planted, at most the sandbox's per-file limit) and stores it in the durable store
under the conversation's container (`schemas.keys.container`): the gateway serves them at
`/v1/containers/{id}/files`, to the container's tenant alone. File ids derive from the call and the
path, so a call run again after a processor died keeps the same ids. A container's files live
`CONTAINER_TTL_S` from its last write.
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
import time
from pathlib import Path

import redis.asyncio as aioredis

from common import sealing
from common.config import settings
from schemas import keys as K


def read_regular(path: Path, limit: int) -> bytes | None:
    """The bytes of a regular file (at most `limit`), or None for a link, a fifo or anything else."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            return None
        return f.read(limit + 1)


class ContainerFiles:
    def __init__(self, limit_bytes: int, redis_url: str | None = None) -> None:
        self.limit = limit_bytes
        self.redis = aioredis.Redis.from_url(redis_url or settings().redis_url, socket_timeout=10)

    async def keep(
        self, tenant: str, conversation_id: str, call_id: str, workdir: Path, files: list[dict]
    ) -> list[dict]:
        """Store the run's `files` in the conversation's container; returns them with their ids
        (a file over the limit is listed with `kept: false`)."""
        container = K.container_id(conversation_id)
        now = int(time.time())
        claim = self.redis.pipeline(transaction=True)
        claim.hsetnx(K.container(container), "tenant", tenant)
        claim.hget(K.container(container), "tenant")
        owner = (await claim.execute())[1]
        mine = owner is not None and owner.decode() == tenant  # never add to another tenant's container
        pipe = self.redis.pipeline(transaction=True)
        out = []
        for entry in files:
            file_id = K.container_file_id(call_id, entry["path"])
            data = (
                await asyncio.to_thread(read_regular, workdir / entry["path"], self.limit) if mine else None
            )
            kept = data is not None and len(data) <= self.limit
            out.append({**entry, "file_id": file_id, "container_id": container, "kept": kept})
            if not kept:
                continue
            record = {"id": file_id, "path": entry["path"], "bytes": len(data), "created_at": now}
            sealed = await sealing.unblocked(sealing.seal_stored, tenant, conversation_id, data)
            pipe.set(K.container_file(file_id), sealed, ex=K.CONTAINER_TTL_S)
            pipe.hset(K.container(container), f"file:{file_id}", json.dumps(record))
        pipe.expire(K.container(container), K.CONTAINER_TTL_S)
        await pipe.execute()
        return out
