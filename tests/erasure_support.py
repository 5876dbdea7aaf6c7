"""Looking for a tenant's content where it could lie on disk: the broker's log segments (their record
batches decompressed), a Redis instance's keys and values, and any folder's files byte for byte."""

from __future__ import annotations

import struct
from pathlib import Path

import cramjam
import redis

BATCH_HEADER = 61  # bytes before a v2 record batch's records
CODECS = {
    0: bytes,
    1: lambda b: bytes(cramjam.gzip.decompress(b)),
    2: lambda b: bytes(cramjam.snappy.decompress(b)),
    3: lambda b: bytes(cramjam.lz4.decompress(b)),
    4: lambda b: bytes(cramjam.zstd.decompress(b)),
}


def segment_records(path: Path):
    """The records region of each batch of a Kafka log segment, decompressed."""
    data = path.read_bytes()
    at = 0
    while at + 12 <= len(data):
        _, length = struct.unpack_from(">qi", data, at)
        if length <= 0 or at + 12 + length > len(data):
            break
        attributes = struct.unpack_from(">h", data, at + 21)[0]
        yield CODECS[attributes & 7](data[at + BATCH_HEADER : at + 12 + length])
        at += 12 + length


def found_in_segments(log_dir: Path, needles: set[bytes]) -> set[bytes]:
    """Which of `needles` some record of some partition's log segment holds."""
    found: set[bytes] = set()
    for segment in log_dir.rglob("*.log"):
        for records in segment_records(segment):
            found |= {n for n in needles - found if n in records}
    return found


def found_in_files(folder: Path, needles: set[bytes]) -> set[bytes]:
    found: set[bytes] = set()
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            found |= {n for n in needles - found if n in data}
    return found


def found_in_redis(url: str, needles: set[bytes]) -> set[bytes]:
    """Which of `needles` a key or value of the Redis at `url` holds."""
    client = redis.Redis.from_url(url)
    found: set[bytes] = set()
    try:
        for key in client.scan_iter(count=1000):
            kind = client.type(key)
            parts = [key]
            if kind == b"string":
                parts.append(client.get(key) or b"")
            elif kind == b"hash":
                for k, v in client.hgetall(key).items():
                    parts += [k, v]
            elif kind == b"zset":
                parts += client.zrange(key, 0, -1)
            elif kind == b"set":
                parts += list(client.smembers(key))
            elif kind == b"list":
                parts += client.lrange(key, 0, -1)
            blob = b"\0".join(p for p in parts if p)
            found |= {n for n in needles - found if n in blob}
    finally:
        client.close()
    return found
