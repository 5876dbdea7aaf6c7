"""`tokenstream erase`: a tenant's (or one conversation's) content made unreadable everywhere at once.

The log is append-only and replicated; rewriting it to remove a tenant's records would break the
ledger's chain and leave copies in every replica and consumer. Instead every content field was sealed
with a key of the tenant's conversation (common/sealing.py); erasing destroys those keys. Then:

- the topics' records of the tenant read as erased (`audit` shows them so; their digests still verify);
- its conversation histories, held sealed in the conversation processor's table, read as absent;
- the caches' entries (sealed with the same keys) miss; the vector stores' Weaviate tenant is deleted
  (its shard leaves the disk), the semantic cache's entries of the tenant are deleted;
- its records in the durable store (conversations, stored chat completions, files, vector stores,
  container files) are deleted, and the store's append-only file and snapshot are rewritten, so that
  neither a destroyed key nor a deleted record stays in its files.

Running roles drop a destroyed key as soon as they hear of it (common/key_feed.py), and within
common.sealing.KEY_TTL_S seconds where their feed was down.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import redis

from common import sealing
from common.config import settings
from schemas import keys as K


@dataclass
class Erasure:
    keys: list[tuple[str, str]] = field(default_factory=list)
    records: dict[str, int] = field(default_factory=dict)  # durable store: kind -> records deleted
    weaviate: dict[str, int] = field(default_factory=dict)
    rewritten: bool = False

    def count(self, kind: str, n: int) -> None:
        self.records[kind] = self.records.get(kind, 0) + n


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else (value or "")


def _owned(client: redis.Redis, keys: list[str], tenant: str) -> list[str]:
    """Those of `keys` (hashes) whose `tenant` field names `tenant` as their owner."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.hget(key, "tenant")
    return [key for key, owner in zip(keys, pipe.execute()) if _text(owner) == tenant]


def _hashes(client: redis.Redis, prefix: str) -> list[str]:
    """The hashes named `<prefix><id>` (not those under a longer prefix such as `<prefix>items:`)."""
    return [
        k
        for k in map(_text, client.scan_iter(match=f"{prefix}*", count=1000, _type="HASH"))
        if ":" not in k.removeprefix(prefix)
    ]


def _durable_records(client: redis.Redis, tenant: str, conversation: str | None, done: Erasure) -> None:
    convs = _owned(
        client,
        [K.conversation(conversation)] if conversation is not None else _hashes(client, K.conversation("")),
        tenant,
    )
    for key in convs:
        conv = key.removeprefix(K.conversation(""))
        done.count(
            "conversations",
            client.delete(
                key, K.conversation_items(conv), K.conversation_order(conv), K.conversation_busy(conv)
            )
            and 1,
        )
    containers = _owned(
        client,
        [K.container(K.container_id(conversation))]
        if conversation is not None
        else _hashes(client, K.container("")),
        tenant,
    )
    for container in containers:
        files = [
            f.removeprefix("file:") for f in map(_text, client.hkeys(container)) if f.startswith("file:")
        ]
        done.count("container files", client.delete(*(K.container_file(f) for f in files)) if files else 0)
        client.delete(container)
    if conversation is not None:
        return
    chats = [_text(r) for r in client.zrange(K.tenant_chats(tenant), 0, -1)]
    done.count("stored chat completions", client.delete(*(K.stored_chat(r) for r in chats)) if chats else 0)
    client.delete(K.tenant_chats(tenant))
    for file_id in map(_text, client.zrange(K.tenant_files(tenant), 0, -1)):
        done.count(
            "files", client.delete(K.file_record(file_id), K.file_data(file_id), K.file_stores(file_id)) and 1
        )
    client.delete(K.tenant_files(tenant), K.tenant_file_bytes(tenant))
    for vs in map(_text, client.zrange(K.tenant_vector_stores(tenant), 0, -1)):
        entries = [_text(f) for f in client.zrange(K.store_files(vs), 0, -1)]
        client.delete(K.vector_store(vs), K.store_files(vs), *(K.store_file(vs, f) for f in entries))
        done.count("vector stores", 1)
    client.delete(K.tenant_vector_stores(tenant))


def _rewrite(client: redis.Redis, timeout_s: float = 60.0) -> bool:
    """Rewrite the store's append-only file and snapshot so that deleted values leave its files."""
    persistence = client.info("persistence")
    if not persistence.get("aof_enabled") and not client.config_get("save").get("save"):
        return False
    if persistence.get("aof_enabled"):
        client.bgrewriteaof()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        p = client.info("persistence")
        if not (
            p.get("aof_rewrite_in_progress")
            or p.get("aof_rewrite_scheduled")
            or p.get("rdb_bgsave_in_progress")
        ):
            break
        time.sleep(0.1)
    try:
        client.bgsave()
    except redis.ResponseError:  # a save already under way
        pass
    while time.monotonic() < deadline:
        if not client.info("persistence").get("rdb_bgsave_in_progress"):
            return True
        time.sleep(0.1)
    raise TimeoutError("the durable store did not finish rewriting its files in time")


def _weaviate(tenant: str, conversation: str | None, done: Erasure) -> None:
    import weaviate
    from weaviate.classes.query import Filter

    from common.vectordb import client_config
    from tools.search.index import COLLECTION, weaviate_tenant

    cfg = settings()
    client = weaviate.connect_to_local(
        host=cfg.weaviate_host,
        port=cfg.weaviate_http_port,
        grpc_port=cfg.weaviate_grpc_port,
        skip_init_checks=True,
        additional_config=client_config(10.0),
    )
    try:
        if conversation is None and client.collections.exists(COLLECTION):
            chunks = client.collections.get(COLLECTION)
            name = weaviate_tenant(tenant)
            if chunks.tenants.exists(name):
                chunks.tenants.remove([name])
                done.weaviate["vector store shards"] = 1
        if client.collections.exists(K.SEMANTIC_CACHE_COLLECTION):
            cache = client.collections.get(K.SEMANTIC_CACHE_COLLECTION)
            where = Filter.by_property("tenant").equal(tenant)
            if (
                conversation is not None
            ):  # only a lone chat completion is cached: its request id is its conversation's
                where = where & Filter.by_property("request_id").equal(conversation)
            done.weaviate["semantic cache entries"] = int(cache.data.delete_many(where=where).successful)
    finally:
        client.close()


def erase(tenant: str, conversation: str | None = None) -> Erasure:
    done = Erasure()
    client = redis.Redis.from_url(settings().redis_url)
    try:
        done.keys = sealing.destroy(client, tenant, conversation)
        _durable_records(client, tenant, conversation, done)
        _weaviate(tenant, conversation, done)
        done.rewritten = _rewrite(client)
    finally:
        client.close()
    return done
