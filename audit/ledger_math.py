"""The ledger's arithmetic, in one file that imports nothing of tokenstream.

`tokenstream audit notarize` and `audit verify` use it, and `audit export` copies it into every
bundle as `verify.py`: `python verify.py BUNDLE_DIR` checks a bundle with the Python standard library
and the `cryptography` package alone, without the project's code (exit 0: whole and in order; 1:
the first problem, named; 2: not a bundle).

- record digest: sha256 over a version tag, the record's timestamp, key, value and headers, each
  length-prefixed (None and empty differ). Offsets and the topic name are left out, so a faithful
  copy of a partition verifies against the original's checkpoints, record by record.
- chain head: sha256(previous head || record digest), from 32 zero bytes.
- a checkpoint is signed (Ed25519) over its canonical JSON without the signature.
"""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import sys
from pathlib import Path

TAG = b"tokenstream-ledger-1"
ZERO_HEAD = "00" * 32


def _field(value: bytes | None) -> bytes:
    return struct.pack(">q", -1) if value is None else struct.pack(">q", len(value)) + value


def record_digest(
    timestamp: int, key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | tuple = ()
) -> str:
    h = hashlib.sha256(
        TAG + struct.pack(">q", timestamp) + _field(key) + _field(value) + struct.pack(">q", len(headers))
    )
    for name, data in headers:
        h.update(_field(name.encode()) + _field(bytes(data)))
    return h.hexdigest()


def next_head(head: str, digest: str) -> str:
    return hashlib.sha256(bytes.fromhex(head) + bytes.fromhex(digest)).hexdigest()


def fold(head: str, digests: list[str]) -> str:
    for digest in digests:
        head = next_head(head, digest)
    return head


def signed_bytes(checkpoint: dict) -> bytes:
    """What a checkpoint's signature covers: every field but the signature, as canonical JSON."""
    body = {k: v for k, v in checkpoint.items() if k != "signature"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def key_id(public_key: bytes) -> str:
    return hashlib.sha256(public_key).hexdigest()[:16]


def signature_ok(checkpoint: dict, public_key: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(
            bytes.fromhex(checkpoint["signature"]), signed_bytes(checkpoint)
        )
        return True
    except (InvalidSignature, ValueError):
        return False


def check_checkpoints(checkpoints: list[dict], public_key: bytes) -> str | None:
    """One partition's checkpoints, in order: each signed, each head the fold of its digests, each
    starting at the head the one before ended on. None, or the first problem in words."""
    head = None
    for cp in checkpoints:
        where = f"checkpoint {cp['topic']}/{cp['partition']} offsets {cp['first_offset']}-{cp['last_offset']}"
        if not signature_ok(cp, public_key):
            return f"{where}: the signature does not verify"
        if fold(cp["prev_head"], cp["record_digests"]) != cp["head"]:
            return f"{where}: its head is not the chain of its digests"
        if head is not None and cp["prev_head"] != head:
            return f"{where}: does not continue the checkpoint before it (one is missing or replaced)"
        head = cp["head"]
    return None


def first_difference(attested: list[tuple[int, str]], actual: list[tuple[int, str]]) -> str | None:
    """Compare the attested records (offset, digest), in order, with the records read (offset, digest),
    in order. None when every attested record is there, unchanged and in its place (records after the
    last attested one are not judged: nothing has attested them yet); else the first problem, naming
    the record by the offset it was read at and the offset it was attested at."""
    want = [d for _, d in attested]
    have = [d for _, d in actual]
    for i, digest in enumerate(want):
        if i >= len(have):
            return (
                f"removed: the record attested at offset {attested[i][0]} and the {len(want) - i - 1} "
                f"after it are missing (the log ends at {len(have)} of {len(want)} attested records)"
            )
        if have[i] == digest:
            continue
        read_at, attested_at = actual[i][0], attested[i][0]
        later_want, later_have = set(want[i + 1 :]), set(have[i + 1 :])
        if have[i] in later_want and digest in later_have:
            return (
                f"reordered: offset {read_at} holds the record attested at another place "
                f"(offset {attested_at} expected)"
            )
        if have[i] in later_want:
            return (
                f"removed: the record attested at offset {attested_at} is missing "
                f"(offset {read_at} holds the next)"
            )
        if digest in later_have:
            return f"inserted: offset {read_at} holds a record nothing attested"
        return (
            f"changed: the record at offset {read_at} differs from the one attested at offset {attested_at}"
        )
    return None


def _bytes(text: str | None) -> bytes | None:
    return None if text is None else base64.b64decode(text)


def verify_bundle(folder: Path) -> list[str]:
    """Every problem of an exported bundle (empty: it verifies)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    public_key = bytes.fromhex(manifest["public_key"])
    checkpoints: dict[str, list[dict]] = {}
    for line in (folder / "checkpoints.jsonl").read_text().splitlines():
        cp = json.loads(line)
        checkpoints.setdefault(f"{cp['topic']}/{cp['partition']}", []).append(cp)
    records: dict[str, list[tuple[int, str]]] = {}
    for line in (folder / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "digest" in r:  # another tenant's record, exported as its digest alone: it keeps its place
            digest = r["digest"]
        else:
            digest = record_digest(
                r["timestamp"],
                _bytes(r["key"]),
                _bytes(r["value"]),
                [(h[0], base64.b64decode(h[1])) for h in r["headers"]],
            )
        records.setdefault(f"{r['topic']}/{r['partition']}", []).append((r["offset"], digest))
    problems = []
    for name, cps in sorted(checkpoints.items()):
        problem = check_checkpoints(cps, public_key)
        attested = [(o, d) for cp in cps for o, d in zip(cp["offsets"], cp["record_digests"], strict=True)]
        problem = problem or first_difference(attested, records.get(name, []))
        if problem:
            problems.append(f"{name}: {problem}")
    if manifest.get("key_id") != key_id(public_key):
        problems.append("the manifest's key id is not its public key's")
    return problems


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (Path(argv[0]) / "manifest.json").exists():
        print("usage: python verify.py BUNDLE_DIR (a folder written by `tokenstream audit export`)")
        return 2
    problems = verify_bundle(Path(argv[0]))
    for problem in problems:
        print(problem)
    if not problems:
        manifest = json.loads((Path(argv[0]) / "manifest.json").read_text())
        print(
            f"verified: {manifest['records']} records on {manifest['partitions']} partitions, "
            f"signed by key {manifest['key_id']}"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
