"""Redis and Weaviate of the test stack, used through the clients the roles use."""

from __future__ import annotations

import redis
import weaviate
from weaviate.classes.config import Configure, DataType, Property
from weaviate.classes.query import MetadataQuery


def test_redis_stores_and_expires(stack, unique):
    r = redis.Redis.from_url(stack.redis.address)
    key = f"ratelimit:{unique}"
    assert [r.incr(key) for _ in range(3)] == [1, 2, 3]
    r.expire(key, 60)
    assert 0 < r.ttl(key) <= 60
    r.set(f"cache:{unique}", b"value", px=50_000)
    assert r.get(f"cache:{unique}") == b"value"


def test_weaviate_stores_and_queries_a_vector(stack, unique):
    client = weaviate.connect_to_local(port=stack.weaviate.port, grpc_port=stack.weaviate.grpc_port)
    name = f"Doc{unique}"
    try:
        docs = client.collections.create(
            name, vector_config=Configure.Vectors.self_provided(),
            properties=[Property(name="text", data_type=DataType.TEXT)],
        )
        docs.data.insert({"text": "kafka is a log"}, vector=[1.0, 0.0, 0.0, 0.0])
        docs.data.insert({"text": "redis is a cache"}, vector=[0.0, 1.0, 0.0, 0.0])
        hits = docs.query.near_vector([0.9, 0.1, 0.0, 0.0], limit=1, return_metadata=MetadataQuery(distance=True))
        assert [h.properties["text"] for h in hits.objects] == ["kafka is a log"]
        assert hits.objects[0].metadata.distance < 0.05
    finally:
        client.collections.delete(name)
        client.close()
