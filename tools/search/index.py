"""The Weaviate index of file chunks: one multi-tenant collection, one Weaviate tenant per tokenstream tenant.

Multi-tenancy keeps each tenant's chunks in its own shard: every read and write must name the
tenant, so no filter a caller passes can reach another tenant's files. Vector stores are a
property inside a tenant (`vector_store_id`), filtered on each search.

    index = ChunkIndex.connect()
    index.add(tenant, store_id, file_id, filename, chunks)        # replaces that file's chunks
    index.remove(tenant, store_id, file_id)                      # takes them out
    index.search(tenant, [store_id], "question", k=5)            # hybrid: BM25 + MiniLM vectors
"""

from __future__ import annotations

import contextlib
import hashlib
from dataclasses import dataclass

import weaviate
from weaviate.classes.config import Configure, DataType, Property
from weaviate.classes.data import DataObject
from weaviate.classes.query import Filter, MetadataQuery
from weaviate.classes.tenants import Tenant
from weaviate.util import generate_uuid5

from common.config import settings
from common.vectordb import client_config
from tools.search.embed import embedder

COLLECTION = "TsFileChunk"


@dataclass
class Hit:
    file_id: str
    filename: str
    vector_store_id: str
    chunk_index: int
    text: str
    score: float


def weaviate_tenant(tenant: str) -> str:
    """Weaviate tenant names allow [A-Za-z0-9_-]{1,64}: a hash, so every tokenstream tenant maps to its
    own."""
    return "t_" + hashlib.sha256(tenant.encode()).hexdigest()[:40]


class ChunkIndex:
    def __init__(self, client: weaviate.WeaviateClient) -> None:
        self.client = client
        self.collection = self._collection()
        self._tenants: set[str] = set()

    @classmethod
    def connect(cls, timeout_s: float = 5.0, insert_s: float = 90.0) -> ChunkIndex:
        """Connecting and each query time out after `timeout_s`, each insert after `insert_s`."""
        cfg = settings()
        # skip_init_checks: no version look-up on PyPI at connect (tools run offline)
        client = weaviate.connect_to_local(
            host=cfg.weaviate_host,
            port=cfg.weaviate_http_port,
            grpc_port=cfg.weaviate_grpc_port,
            skip_init_checks=True,
            additional_config=client_config(timeout_s, insert_s),
        )
        try:
            return cls(client)
        except BaseException:
            client.close()
            raise

    def close(self) -> None:
        """Close the client; an error closing one whose server is gone is of no interest."""
        with contextlib.suppress(Exception):  # closing a client whose server is gone
            self.client.close()

    def _collection(self):
        if not self.client.collections.exists(COLLECTION):
            try:
                self.client.collections.create(
                    COLLECTION,
                    multi_tenancy_config=Configure.multi_tenancy(enabled=True),
                    vector_config=Configure.Vectors.self_provided(),
                    properties=[
                        Property(name="text", data_type=DataType.TEXT),
                        Property(name="file_id", data_type=DataType.TEXT, skip_vectorization=True),
                        Property(name="filename", data_type=DataType.TEXT),
                        Property(name="vector_store_id", data_type=DataType.TEXT, skip_vectorization=True),
                        Property(name="chunk_index", data_type=DataType.INT),
                    ],
                )
            except weaviate.exceptions.UnexpectedStatusCodeError:
                if not self.client.collections.exists(COLLECTION):  # not a concurrent create
                    raise
        return self.client.collections.get(COLLECTION)

    def _tenant(self, tenant: str, create: bool):
        name = weaviate_tenant(tenant)
        if name not in self._tenants:
            if not self.collection.tenants.exists(name):
                if not create:
                    return None
                self.collection.tenants.create([Tenant(name=name)])
            self._tenants.add(name)
        return self.collection.with_tenant(name)

    def add(self, tenant: str, store_id: str, file_id: str, filename: str, chunks: list[str]) -> int:
        shard = self._tenant(tenant, create=True)
        shard.data.delete_many(
            where=Filter.by_property("file_id").equal(file_id)
            & Filter.by_property("vector_store_id").equal(store_id)
        )
        vectors = embedder()(chunks)
        objects = [
            DataObject(
                properties={
                    "text": text,
                    "file_id": file_id,
                    "filename": filename,
                    "vector_store_id": store_id,
                    "chunk_index": i,
                },
                vector=vector,
                uuid=generate_uuid5(f"{store_id}/{file_id}/{i}"),
            )
            for i, (text, vector) in enumerate(zip(chunks, vectors))
        ]
        result = shard.data.insert_many(objects)
        if result.has_errors:
            first = next(iter(result.errors.values()))
            raise RuntimeError(
                f"Weaviate refused {len(result.errors)} of {len(objects)} chunks: {first.message}"
            )
        return len(objects)

    def remove(self, tenant: str, store_id: str, file_id: str) -> int:
        """Take a file's chunks out of a store; returns how many went (0 when it had none)."""
        shard = self._tenant(tenant, create=False)
        if shard is None:
            return 0
        result = shard.data.delete_many(
            where=Filter.by_property("file_id").equal(file_id)
            & Filter.by_property("vector_store_id").equal(store_id)
        )
        return int(result.successful)

    def search(
        self, tenant: str, store_ids: list[str], query: str, k: int = 5, alpha: float = 0.5
    ) -> list[Hit]:
        shard = self._tenant(tenant, create=False)
        if shard is None or not store_ids:
            return []
        found = shard.query.hybrid(
            query=query,
            vector=embedder()([query])[0],
            alpha=alpha,
            limit=k,
            filters=Filter.by_property("vector_store_id").contains_any(store_ids),
            return_metadata=MetadataQuery(score=True),
        )
        return [
            Hit(
                o.properties["file_id"],
                o.properties["filename"],
                o.properties["vector_store_id"],
                int(o.properties["chunk_index"]),
                o.properties["text"],
                float(o.metadata.score or 0.0),
            )
            for o in found.objects
        ]
