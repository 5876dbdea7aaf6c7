"""Contracts kept in Redis: the name of every Redis key tokenstream writes (with how long each
lives), API key records, and the conversation key that scopes a history to its tenant.

Two stores: every key below lives in the durable Redis (TOKENSTREAM_REDIS_URL, `noeviction`: a full
store refuses writes rather than drop an API key, a file or a ledger entry) except
`ts:cache:exact:*`, which alone lives in the evicting cache Redis (TOKENSTREAM_CACHE_REDIS_URL,
`allkeys-lru` under maxmemory).

    ts:gateway:req:<request_id>              JSON notes a resume on any gateway needs (owner tenant,
                                             model, created, include_usage); GATEWAY_META_TTL_S
    ts:tokens:first:<request_id>             "<partition>:<offset>" of the request's first record on the
                                             tokens topic, set once (NX) by the worker that wrote it, on
                                             its ack (or by a takeover read that found it); resumes and
                                             takeovers seek there (common/first_records.py);
                                             GATEWAY_META_TTL_S. Ends in ":v" where the input verdict
                                             is written in band and may come first:
    ts:tokens:verdict:<request_id>           "<partition>:<offset>" of that verdict, set (NX) by its
                                             writer on its ack; GATEWAY_META_TTL_S
    ts:gateway:attach:<request_id>           attachment generation of the connection serving the
                                             request (cancel after a disconnect); GATEWAY_ATTACH_TTL_S
    ts:done:<role>:<effect>:<request_id>     an effect a processor has emitted for the request
                                             (idempotence after a restart); EFFECT_TTL_S. A response
                                             run's in-band tool result is the effect `run-result` of
                                             its call id (ts:done:conversation:run-result:<call_id>)
    ts:apikeys / ts:apikey:<sha256>          the set of API key digests / one key's record (hash)
    ts:rl:<scope>:<ident>:<kind>:<minute>    one-minute rate-limit counters (requests, tokens)
    ts:usage:<key_id>:<day>                  token counts of one key on one UTC day
    ts:usage:settled:<request_id>            set once a request's usage was counted
    ts:cache:exact:<sha256>                  a cached deterministic answer
    ts:response:<run_id>                     a stored response object (/v1/responses, store=true);
                                             RESPONSE_TTL_S
    ts:chat:<request_id> / ts:chats:<tenant> a stored chat completion (store=true: the completion, its
                                             messages; RESPONSE_TTL_S) / a tenant's, by creation time
    ts:tool:{claim,result,published}:<call_id>
                                             the tool processor's once-per-call record (below)
    ts:file:<file_id> / ts:file:data:<file_id>   an uploaded file's record (hash) / its bytes
    ts:files:<tenant> / ts:files:bytes:<tenant>  a tenant's file ids (sorted by time) / bytes stored
    ts:file:stores:<file_id>                 the vector stores holding a file
    ts:vs:<vs_id> / ts:vss:<tenant>          a vector store's record (hash) / a tenant's store ids
    ts:vs:files:<vs_id>                      a store's file ids (sorted by time added)
    ts:vs:file:<vs_id>:<file_id>             a file's state in a store (hash, fields of STORE_FILE_FIELDS)
                                             files and stores live until deleted (no TTL)
    ts:conv:<conv_id>                        a conversation's record (hash: tenant, created_at, metadata,
                                             next: its items' position counter)
    ts:conv:items:<conv_id> / ts:conv:order:<conv_id>
                                             its items (item id -> JSON) / their order (sorted set);
                                             conversations live until deleted (no TTL)
    ts:conv:busy:<conv_id>                   the run id of the response in progress in it; CONVERSATION_BUSY_S

An API key is shown once, `sk-ts-<43 url-safe characters>`; Redis holds only its sha256
(`key_id` below is the first 16 hex digits of it, safe to print and to log). Every record is
a Redis hash under `api_key(sha256)`; `API_KEYS` is the set of the hashes, for listing.
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time

import msgspec

KEY_PREFIX = "sk-ts-"
TIERS = ("free", "paid", "enterprise")
#: Higher tiers are admitted first by the workers (larger number first); unknown tiers rank as free.
TIER_PRIORITY = {"free": 0, "paid": 1, "enterprise": 2}
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

API_KEYS = "ts:apikeys"  # set of sha256 hex digests
#: Weaviate collection of the semantic response cache (objects scoped by tenant, model, system message).
SEMANTIC_CACHE_COLLECTION = "TokenstreamSemanticCache"


def api_key(digest: str) -> str:
    """Redis hash of one key's record (fields of `ApiKey`)."""
    return f"ts:apikey:{digest}"


GATEWAY_META_TTL_S = 24 * 3600
GATEWAY_ATTACH_TTL_S = 24 * 3600
EFFECT_TTL_S = 7 * 24 * 3600  # as long as the processors' input topics keep their events


def gateway_request(request_id: str) -> str:
    """What the gateway remembers of an admitted request: owner tenant, model, usage option."""
    return f"ts:gateway:req:{request_id}"


def first_record(request_id: str) -> str:
    """Where the request's first record on the tokens topic lies: "<partition>:<offset>"
    (common/first_records.py)."""
    return f"ts:tokens:first:{request_id}"


def first_verdict(request_id: str) -> str:
    """Where the request's in-band input verdict lies on the tokens topic: "<partition>:<offset>"."""
    return f"ts:tokens:verdict:{request_id}"


def gateway_attachment(request_id: str) -> str:
    """The generation of the connection currently serving a request (cancel after disconnect)."""
    return f"ts:gateway:attach:{request_id}"


def effect_done(role: str, effect: str, request_id: str) -> str:
    """An effect a processor has emitted for a request (processors.effects.Ledger)."""
    return f"ts:done:{role}:{effect}:{request_id}"


def rate_bucket(scope: str, ident: str, kind: str) -> str:
    """Prefix of a one-minute counter: scope key|tenant, kind requests|tokens; the limiter's script
    appends `:<minute number of the Redis server's clock>`."""
    return f"ts:rl:{scope}:{ident}:{kind}"


def open_streams(key_id: str) -> str:
    """Sorted set of a key's open requests, shared by every gateway instance: member the request id,
    score the end of its lease (seconds of the Redis server's clock). The admitting instance renews
    the lease while the request is open and removes it when the request ends; the lease of an
    instance that died lapses, and lapsed members are dropped when the key's next request is admitted."""
    return f"ts:streams:{key_id}"


def usage(key_id: str, day: str) -> str:
    """Hash of token counts (prompt, cached, completion, requests) of one key on one UTC day (YYYY-MM-DD)."""
    return f"ts:usage:{key_id}:{day}"


def usage_settled(request_id: str) -> str:
    """Set once a request's usage was counted (whichever gateway instance saw its completion)."""
    return f"ts:usage:settled:{request_id}"


def usage_day(when: float | None = None) -> str:
    """The UTC day usage is counted under."""
    return time.strftime("%Y-%m-%d", time.gmtime(time.time() if when is None else when))


def exact_cache(digest: str) -> str:
    """A cached deterministic answer, keyed by the sha256 of tenant, model, messages and sampling."""
    return f"ts:cache:exact:{digest}"


RESPONSE_TTL_S = 30 * 24 * 3600  # as long as OpenAI keeps a stored response


CONTAINER_TTL_S = 7 * 24 * 3600  # a code interpreter's files, from their container's last write


def container_id(conversation_id: str) -> str:
    """The code interpreter's container of a conversation: its working folder, and the files kept from it."""
    return f"cntr_{conversation_id}"


def container_file_id(call_id: str, path: str) -> str:
    """A file a code interpreter call wrote: the same id whichever processor runs the call."""
    import hashlib

    return "cfile_" + hashlib.sha256(f"{call_id}\0{path}".encode()).hexdigest()[:32]


def container(container_id: str) -> str:
    """Hash: `tenant` (the owner), and `file:<file id>` -> the file's record (JSON: id, path, bytes,
    created_at) for every file kept from the container (durable store)."""
    return f"ts:container:{container_id}"


def container_file(file_id: str) -> str:
    """The bytes of a file kept from a container."""
    return f"ts:container:file:{file_id}"


def response_input(run_id: str) -> str:
    """The input items of a stored response (JSON list), for GET /v1/responses/{id}/input_items."""
    return f"ts:response:input:{run_id}"


def stored_response(run_id: str) -> str:
    """The final response object of a run (JSON), for GET /v1/responses/{id}; its owner and
    conversation are in the run's gateway_request notes."""
    return f"ts:response:{run_id}"


CONVERSATION_BUSY_S = 15 * 60  # the longest a response holds its conversation when nobody sees it end


def conversation(conv_id: str) -> str:
    """Hash: tenant, created_at, metadata (JSON), next (the last item position handed out)."""
    return f"ts:conv:{conv_id}"


def conversation_items(conv_id: str) -> str:
    """Hash: item id -> the item (JSON, OpenAI's shape), sealed with the conversation's key."""
    return f"ts:conv:items:{conv_id}"


def conversation_order(conv_id: str) -> str:
    """Sorted set: item ids scored by their position in the conversation."""
    return f"ts:conv:order:{conv_id}"


def conversation_busy(conv_id: str) -> str:
    """The run id of the response in progress in the conversation (one at a time)."""
    return f"ts:conv:busy:{conv_id}"


def stored_chat(request_id: str) -> str:
    """JSON: tenant, scope, the completion object (with its metadata), the request's messages; sealed
    with the key of the chat's conversation (`scope`)."""
    return f"ts:chat:{request_id}"


def tenant_chats(tenant: str) -> str:
    """Sorted set: a tenant's stored chat completions' request ids, scored by creation time."""
    return f"ts:chats:{tenant}"


def conversation_key(tenant: str, conversation_id: str) -> str:
    """The key of a conversation's history and of its chat requests on ts.chat.requests.

    Tenants never contain ':' (TENANT_PATTERN), so the key is unambiguous and one tenant's
    conversation id never names another tenant's history.
    """
    return f"{tenant}:{conversation_id}"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


class ApiKey(msgspec.Struct, kw_only=True):
    """One API key's record. rpm/tpm 0 means unlimited; expires_at 0 means never."""

    key_id: str
    tenant: str
    tier: str = "free"
    name: str = ""
    rpm: int = 0
    tpm: int = 0
    tenant_rpm: int = 0
    tenant_tpm: int = 0
    expires_at: float = 0.0
    revoked_at: float = 0.0
    created_at: float = 0.0
    max_streams: int = 0  # open requests at once, across every gateway; 0: the tier's default, -1: no limit
    admin: bool = False  # may read /metrics
    exact_cache: bool = True
    semantic_cache: bool = False
    region: str = ""  # home region: its tenant's content is served and kept there alone ("": the only one)

    def problem(self, now: float | None = None) -> str | None:
        """Why this key may not be used now, or None."""
        now = time.time() if now is None else now
        if self.revoked_at:
            return "revoked"
        if self.expires_at and now >= self.expires_at:
            return "expired"
        return None

    @property
    def priority(self) -> int:
        return TIER_PRIORITY.get(self.tier, 0)

    def to_redis(self) -> dict[str, str]:
        return {k: str(int(v) if isinstance(v, bool) else v) for k, v in msgspec.structs.asdict(self).items()}

    @classmethod
    def from_redis(cls, raw: dict) -> ApiKey:
        fields = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in raw.items()
        }
        return msgspec.convert(fields, cls, strict=False)


# The tool processor (tools/ledger.py): one call id, run to completion at most once.
#   ts:tool:claim:<call_id>       the processor running the call (its instance id); a lease of
#                                 TOKENSTREAM_TOOLS_CLAIM_LEASE_S,
#                                 renewed while it runs, so a dead processor's claim lapses
#   ts:tool:result:<call_id>      the encoded ToolResult once the call completed; EFFECT_TTL_S
#   ts:tool:published:<call_id>   set once that result is acknowledged on ts.tool.results; EFFECT_TTL_S
def tool_claim(call_id: str) -> str:
    return f"ts:tool:claim:{call_id}"


def tool_result(call_id: str) -> str:
    return f"ts:tool:result:{call_id}"


def tool_published(call_id: str) -> str:
    return f"ts:tool:published:{call_id}"


# Uploaded files and vector stores (gateway/files_store.py writes them, the tool processor's
# ingestion loop, tools/ingestion.py, records each store-file's outcome). No TTL: they live until
# deleted through the API. The bytes are capped per file and per tenant (GatewaySettings).
def file_record(file_id: str) -> str:
    """Hash: tenant, filename, bytes, purpose, created_at."""
    return f"ts:file:{file_id}"


def file_data(file_id: str) -> str:
    """The uploaded bytes."""
    return f"ts:file:data:{file_id}"


def speech_audio(request_id: str) -> str:
    """A recording sent for transcription, until the tool processor has read it (durable store, an hour)."""
    return f"ts:speech:audio:{request_id}"


def tenant_files(tenant: str) -> str:
    """Sorted set: the tenant's file ids, scored by creation time."""
    return f"ts:files:{tenant}"


def tenant_file_bytes(tenant: str) -> str:
    """Counter: bytes of the tenant's stored files (the quota)."""
    return f"ts:files:bytes:{tenant}"


def file_stores(file_id: str) -> str:
    """Set: the vector stores a file was added to (taken out of them when the file is deleted)."""
    return f"ts:file:stores:{file_id}"


def vector_store(vs_id: str) -> str:
    """Hash: tenant, name, created_at, metadata (JSON)."""
    return f"ts:vs:{vs_id}"


def tenant_vector_stores(tenant: str) -> str:
    """Sorted set: the tenant's vector store ids, scored by creation time."""
    return f"ts:vss:{tenant}"


def store_files(vs_id: str) -> str:
    """Sorted set: a store's file ids, scored by the time each was added."""
    return f"ts:vs:files:{vs_id}"


def store_file(vs_id: str, file_id: str) -> str:
    """Hash of STORE_FILE_FIELDS: a file's state in one store."""
    return f"ts:vs:file:{vs_id}:{file_id}"


#: status (schemas.files.STORE_FILE_STATES), generation (set per add; the ingestion event carries it),
#: created_at, tenant, filename, bytes, chunks, error_code, error (empty when none), updated_at
STORE_FILE_FIELDS = (
    "status",
    "generation",
    "created_at",
    "tenant",
    "filename",
    "bytes",
    "chunks",
    "error_code",
    "error",
    "updated_at",
)
