"""Uploaded files and vector stores as records in Redis (keys in `schemas/keys.py`), always per tenant.

Every read names the caller's tenant and a record of another tenant is answered as missing, so
the routes give 404 for it exactly as for an id that never existed. The file's bytes are kept
beside its record, within a size cap per file and a quota per tenant (`GatewaySettings`).
"""

from __future__ import annotations

import json
import secrets
import time

from common import sealing
from schemas import keys as K
from schemas.files import IN_PROGRESS, STORE_FILE_STATES
from schemas.ids import new_file_id, new_vector_store_id


def _text(raw: dict) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in raw.items()
    }


class QuotaExceeded(Exception):
    pass


class Uploads:
    def __init__(self, redis, tenant_max_bytes: int) -> None:
        self.redis = redis
        self.tenant_max_bytes = tenant_max_bytes

    # ------------------------------------------------------------------ files

    async def create_file(self, tenant: str, filename: str, purpose: str, data: bytes) -> dict[str, str]:
        used = await self.redis.incrby(K.tenant_file_bytes(tenant), len(data))
        if used > self.tenant_max_bytes:
            await self.redis.decrby(K.tenant_file_bytes(tenant), len(data))
            raise QuotaExceeded(
                f"Your files would take {used:,} bytes; each tenant may keep "
                f"{self.tenant_max_bytes:,}. Delete files you no longer need."
            )
        file_id, now = new_file_id(), int(time.time())
        record = {
            "id": file_id,
            "tenant": tenant,
            "filename": filename,
            "purpose": purpose,
            "bytes": str(len(data)),
            "created_at": str(now),
        }
        sealed = await sealing.unblocked(sealing.seal_stored, tenant, "", data)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(K.file_data(file_id), sealed)
            pipe.hset(K.file_record(file_id), mapping=record)
            pipe.zadd(K.tenant_files(tenant), {file_id: time.time()})
            await pipe.execute()
        return record

    async def file(self, tenant: str, file_id: str) -> dict[str, str] | None:
        record = _text(await self.redis.hgetall(K.file_record(file_id)))
        return record if record.get("tenant") == tenant else None

    async def files(self, tenant: str) -> list[dict[str, str]]:
        """The tenant's files, oldest first."""
        ids = [i.decode() for i in await self.redis.zrange(K.tenant_files(tenant), 0, -1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hgetall(K.file_record(file_id))
            records = [_text(r) for r in await pipe.execute()]
        return [r for r in records if r.get("tenant") == tenant]

    async def content(self, file_id: str) -> bytes | None:
        """A file's bytes (None when gone or erased)."""
        return await sealing.unblocked(sealing.open_stored, await self.redis.get(K.file_data(file_id)))

    async def stores_of(self, file_id: str) -> list[str]:
        return sorted(s.decode() for s in await self.redis.smembers(K.file_stores(file_id)))

    async def delete_file(self, tenant: str, record: dict[str, str]) -> None:
        """Delete an owned file, and its entries in the vector stores it was in."""
        file_id = record["id"]
        stores = await self.stores_of(file_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(K.file_data(file_id), K.file_record(file_id), K.file_stores(file_id))
            pipe.zrem(K.tenant_files(tenant), file_id)
            pipe.decrby(K.tenant_file_bytes(tenant), int(record["bytes"]))
            for vs_id in stores:
                pipe.zrem(K.store_files(vs_id), file_id)
                pipe.delete(K.store_file(vs_id, file_id))
            await pipe.execute()

    # ------------------------------------------------------------------ vector stores

    async def create_store(
        self, tenant: str, name: str, description: str, metadata: dict[str, str]
    ) -> dict[str, str]:
        vs_id, now = new_vector_store_id(), int(time.time())
        record = {
            "id": vs_id,
            "tenant": tenant,
            "name": name,
            "description": description,
            "metadata": json.dumps(metadata),
            "created_at": str(now),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(K.vector_store(vs_id), mapping=record)
            pipe.zadd(K.tenant_vector_stores(tenant), {vs_id: time.time()})
            await pipe.execute()
        return record

    async def store(self, tenant: str, vs_id: str) -> dict[str, str] | None:
        record = _text(await self.redis.hgetall(K.vector_store(vs_id)))
        return record if record.get("tenant") == tenant else None

    async def stores(self, tenant: str) -> list[dict[str, str]]:
        ids = [i.decode() for i in await self.redis.zrange(K.tenant_vector_stores(tenant), 0, -1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for vs_id in ids:
                pipe.hgetall(K.vector_store(vs_id))
            records = [_text(r) for r in await pipe.execute()]
        return [r for r in records if r.get("tenant") == tenant]

    async def update_store(self, vs_id: str, fields: dict[str, str]) -> None:
        await self.redis.hset(K.vector_store(vs_id), mapping=fields)

    async def delete_store(self, tenant: str, vs_id: str) -> None:
        """Delete an owned store and its files' entries (the files themselves stay)."""
        entries = await self.store_files(vs_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(K.vector_store(vs_id), K.store_files(vs_id))
            pipe.zrem(K.tenant_vector_stores(tenant), vs_id)
            for entry in entries:
                pipe.delete(K.store_file(vs_id, entry["file_id"]))
                pipe.srem(K.file_stores(entry["file_id"]), vs_id)
            await pipe.execute()

    # ------------------------------------------------------------------ files in vector stores

    async def add_to_store(self, vs_id: str, file: dict[str, str]) -> dict[str, str]:
        """Record `file` as in progress in the store under a new generation (a new add of a file
        already there starts it again); returns the entry."""
        now = int(time.time())
        entry = {
            "file_id": file["id"],
            "status": IN_PROGRESS,
            "generation": secrets.token_hex(8),
            "created_at": str(now),
            "tenant": file["tenant"],
            "filename": file["filename"],
            "bytes": file["bytes"],
            "chunks": "0",
            "error_code": "",
            "error": "",
            "updated_at": str(now),
        }
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(K.store_file(vs_id, file["id"]))
            pipe.hset(K.store_file(vs_id, file["id"]), mapping=entry)
            pipe.zadd(K.store_files(vs_id), {file["id"]: time.time()})
            pipe.sadd(K.file_stores(file["id"]), vs_id)
            await pipe.execute()
        return entry

    async def store_file(self, vs_id: str, file_id: str) -> dict[str, str] | None:
        entry = _text(await self.redis.hgetall(K.store_file(vs_id, file_id)))
        return {**entry, "file_id": file_id} if entry else None

    async def store_files(self, vs_id: str) -> list[dict[str, str]]:
        """The store's file entries, oldest first."""
        ids = [i.decode() for i in await self.redis.zrange(K.store_files(vs_id), 0, -1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for file_id in ids:
                pipe.hgetall(K.store_file(vs_id, file_id))
            entries = await pipe.execute()
        return [{**_text(e), "file_id": f} for f, e in zip(ids, entries) if e]

    async def store_size(self, vs_id: str) -> int:
        return int(await self.redis.zcard(K.store_files(vs_id)))

    async def remove_from_store(self, vs_id: str, file_id: str) -> bool:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(K.store_file(vs_id, file_id))
            pipe.zrem(K.store_files(vs_id), file_id)
            pipe.srem(K.file_stores(file_id), vs_id)
            deleted, *_ = await pipe.execute()
        return bool(deleted)


def file_counts(entries: list[dict[str, str]]) -> dict[str, int]:
    counts = {state: 0 for state in STORE_FILE_STATES}
    for entry in entries:
        counts[entry.get("status", IN_PROGRESS)] = counts.get(entry.get("status", IN_PROGRESS), 0) + 1
    return {**counts, "total": len(entries)}
