"""The tool processor's ingestion loop: FileIngest events on ts.files.ingest -> Weaviate, outcome in Redis.

Its own consumer group (`ts-ingest`), in the same process as the tool calls so the two share one
MiniLM embedder. Events of one partition are handled in order (a file's add and remove share a
key, so they never overtake each other); an event's offset is committed only after its outcome is
recorded in the store-file record (`schemas.keys.store_file`), so a processor that dies
mid-ingestion leaves the event to the next one, which indexes the file again from the start
(`ChunkIndex.add` replaces a file's chunks: ids derived from store, file and chunk number).

Once per file and store: an add is done only while the record holds the event's generation and
is still in progress; one already completed or failed, removed, or added again later (a new
generation, with its own event) is passed over. A remove takes the file's chunks out of the
store whatever the record says.
"""

from __future__ import annotations

import asyncio
import logging
import time

import redis.asyncio as aioredis

from common import sealing, vectordb
from common.config import settings
from producers import start_consumer
from schemas import FileIngest
from schemas import keys as K
from schemas.files import COMPLETED, FAILED, IN_PROGRESS
from tools.config import ToolSettings, tool_settings
from tools.search.retry import IndexRetry, IndexUnavailable
from tools.serial import ONE_AT_A_TIME, SerialConsumer
from topics.registry import FILE_INGEST, INGEST_GROUP

log = logging.getLogger("tools.ingestion")

# Write the outcome only if the record still holds this add's generation (it was not removed or
# added again meanwhile): KEYS[1] the record, ARGV[1] the generation, then field/value pairs.
RECORD = """
if redis.call('HGET', KEYS[1], 'generation') ~= ARGV[1] then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""


class Ingestor(SerialConsumer):
    spec, group, log = FILE_INGEST, INGEST_GROUP, log

    def __init__(self, cfg: ToolSettings | None = None, redis_url: str | None = None) -> None:
        super().__init__()
        self.cfg = cfg or tool_settings()
        self.redis = aioredis.Redis.from_url(redis_url or settings().redis_url)
        self._record = self.redis.register_script(RECORD)
        self._index = None
        self.retrying: IndexRetry | None = None

    def index(self):
        from tools.search.index import ChunkIndex

        if self._index is None:
            self._index = ChunkIndex.connect(timeout_s=self.cfg.index_timeout_s)
        return self._index

    def _forget_index(self) -> None:
        index, self._index = self._index, None
        if index is not None:
            index.close()

    async def record(self, event: FileIngest, **fields) -> bool:
        fields["updated_at"] = f"{time.time():.3f}"
        args = [event.generation]
        for k, v in fields.items():
            args += [k, str(v)]
        return bool(await self._record(keys=[K.store_file(event.vector_store_id, event.file_id)], args=args))

    async def handle(self, event: FileIngest) -> str:
        """Bring one event to its recorded outcome; returns what happened (for the log)."""
        if event.action == "remove":
            removed = await self._with_index(
                lambda index: index.remove(event.tenant, event.vector_store_id, event.file_id)
            )
            return f"removed {removed} chunks"
        state = await self.redis.hgetall(K.store_file(event.vector_store_id, event.file_id))
        state = {k.decode(): v.decode() for k, v in state.items()}
        if state.get("generation") != event.generation:
            return "passed over (the file was removed from the store, or added again)"
        if state.get("status") != IN_PROGRESS:
            return f"already {state.get('status')}"
        data = await sealing.unblocked(sealing.open_stored, await self.redis.get(K.file_data(event.file_id)))
        if data is None:
            await self.record(event, status=FAILED, error_code="file_not_found", error="the file was deleted")
            return "failed: the file was deleted"
        from tools.search.extract import UnsupportedFile
        from tools.search.ingest import ingest

        log.info(
            "indexing %s (%s, %d bytes) into %s",
            event.file_id,
            event.filename,
            len(data),
            event.vector_store_id,
        )
        try:
            done = await self._with_index(
                lambda index: ingest(
                    index, event.tenant, event.vector_store_id, event.file_id, event.filename, data
                )
            )
        except UnsupportedFile as exc:
            await self.record(event, status=FAILED, error_code="unsupported_file", error=str(exc))
            return f"failed: {exc}"
        except ValueError as exc:  # too large for the index
            await self.record(event, status=FAILED, error_code="invalid_file", error=str(exc))
            return f"failed: {exc}"
        except IndexUnavailable:
            raise  # held: the process exits without committing, and the event is read again
        except Exception as exc:  # noqa: BLE001 - the index failed this file through every attempt
            await self.record(
                event,
                status=FAILED,
                error_code="server_error",
                error=f"the file could not be indexed ({type(exc).__name__}); add it again",
            )
            return f"failed: {exc!r}"
        written = await self.record(event, status=COMPLETED, chunks=done.chunks, error_code="", error="")
        return f"indexed {done.chunks} chunks of {done.pages} page(s) in {done.seconds:.2f} s" + (
            "" if written else " (the file was removed meanwhile; its remove event takes them out)"
        )

    async def _with_index(self, work):
        """Run `work(index)` in a thread; a failure drops the client and tries again as
        tools/search/retry.py says: held through a Weaviate outage (IndexUnavailable past the
        budget), `ingest_attempts` tries in all for a failure while Weaviate answers."""
        from tools.search.extract import UnsupportedFile

        async def once():
            try:
                return await asyncio.to_thread(lambda: work(self.index()))
            except (UnsupportedFile, ValueError):
                raise
            except Exception:
                await asyncio.to_thread(self._forget_index)
                raise

        retry = IndexRetry(
            self.cfg.ingest_attempts,
            self.cfg.ingest_outage_s,
            vectordb.aready,
            permanent=(UnsupportedFile, ValueError),
        )
        self.retrying = retry
        try:
            return await retry.run(once)
        finally:
            self.retrying = None

    def holding(self) -> str | None:
        """What ingestion waits for now, if it holds an event through an outage (for the health report)."""
        retry = self.retrying
        if retry is None or retry.outage_since is None:
            return None
        return f"ingestion: an event held {time.monotonic() - retry.outage_since:.0f} s, waiting for Weaviate"

    async def subscribe(self):
        return await start_consumer(FILE_INGEST, group=INGEST_GROUP, **ONE_AT_A_TIME)

    def describe(self, event: FileIngest) -> str:
        return f"{event.action} {event.file_id} in store {event.vector_store_id}"

    async def close(self) -> None:
        await super().close()
        await asyncio.to_thread(self._forget_index)
        await self.redis.aclose()
