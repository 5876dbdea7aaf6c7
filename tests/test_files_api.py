"""/v1/files and /v1/vector_stores through the official SDK, against a real gateway, a real tool processor
(ingestion and search), Kafka, Redis and Weaviate: upload, build a store, search 20 questions."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import time

import httpx
import openai
import pytest
import redis

from producers import publish, start_producer
from schemas import FileIngest
from schemas import keys as K
from schemas.files import ingest_key
from tests.gateway_support import Chromium, api_client, default_key, new_key, start_gateway
from tests.test_file_search import FACTS, document, tiny_pdf
from tests.tool_support import sandbox_root, serving, tools_env
from tools.search.extract import chunks
from topics.admin import apply
from topics.registry import FILE_INGEST, all_topics

FILE_MAX = 64 * 1024
# a file long enough (17 chunks) that its indexing is still running when the test kills it
TIDES = (
    "# Tide table\n\n"
    + " ".join(
        f"On day {i} high water is at {i % 12 + 1}:{i * 7 % 60:02d} and the "
        f"harbour gauge reads {i % 9 + 1} metres."
        for i in range(80)
    )
    + "\n"
)
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


async def wait_store(client, vs_id: str, timeout_s: float = 180):
    """The store once no file of it is in progress."""
    deadline = time.monotonic() + timeout_s
    while True:
        store = await client.vector_stores.retrieve(vs_id)
        if store.status == "completed":
            return store
        assert time.monotonic() < deadline, f"still indexing after {timeout_s} s: {store}"
        await asyncio.sleep(0.3)


async def refused_uploads(url: str, client) -> None:
    """Uploads outside the limits, and requests with fields not supported: OpenAI-shaped 4xx, nothing kept."""
    cases = [
        (("big.txt", b"x" * (FILE_MAX + 1), "text/plain"), "assistants", 413, "file_too_large"),
        (("huge.txt", b"x" * (4 * FILE_MAX), "text/plain"), "assistants", 413, "request_too_large"),
        (("archive.zip", b"PK\x03\x04", "application/zip"), "assistants", 400, "unsupported_file"),
        (("fake.pdf", b"<html>no</html>", "application/pdf"), "assistants", 400, "invalid_file"),
        (("latin1.txt", "caf\u00e9".encode("latin-1"), "text/plain"), "assistants", 400, "invalid_file"),
        (("empty.md", b"", "text/markdown"), "assistants", 400, "empty_file"),
        (("notes.md", b"# notes", "text/markdown"), "fine-tune", 400, None),
    ]
    for file, purpose, status, code in cases:
        with pytest.raises(openai.APIStatusError) as caught:
            await client.files.create(file=file, purpose=purpose)
        error = caught.value.response.json()["error"]
        assert caught.value.status_code == status and error["code"] == code, (file[0], error)
        assert error["message"] and error["type"] == "invalid_request_error"
    async with api_client(url, kind="http") as http:
        r = await http.post("/v1/files", json={"purpose": "assistants"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_content_type"
        r = await http.post(
            "/v1/files", files={"file": ("a.txt", b"hi")}, data={"purpose": "assistants", "x": "1"}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "x"
        r = await http.post(
            "/v1/vector_stores", json={"name": "s", "expires_after": {"anchor": "last_active_at", "days": 1}}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "expires_after"
        r = await http.post("/v1/vector_stores", json={"file_ids": ["file-" + "A" * 24]})
        assert r.status_code == 404
        r = await http.get("/v1/files", headers={"Authorization": "Bearer sk-ts-nope"})
        assert r.status_code == 401
    assert [
        f.filename for f in (await client.files.list()).data if f.filename in {c[0][0] for c in cases}
    ] == []  # nothing refused was kept


async def the_same_event_again_is_passed_over(roles, proc, bootstrap, vs_id: str, file_id: str) -> None:
    """A redelivered add (same file, store and generation) is not indexed twice."""
    record = redis.Redis.from_url(os.environ["TOKENSTREAM_REDIS_URL"])
    try:
        generation = record.hget(K.store_file(vs_id, file_id), "generation").decode()
        before = record.hgetall(K.store_file(vs_id, file_id))
    finally:
        record.close()
    producer = await start_producer(bootstrap)
    try:
        await publish(
            producer,
            FILE_INGEST,
            FileIngest(
                request_id=ingest_key(vs_id, file_id),
                tenant="test",
                vector_store_id=vs_id,
                file_id=file_id,
                action="add",
                filename="nordvik.md",
                generation=generation,
            ),
            key=ingest_key(vs_id, file_id),
        )
    finally:
        await producer.stop()
    deadline = time.monotonic() + 60
    while f"add {file_id} in store {vs_id}: already completed" not in roles.log(proc):
        assert time.monotonic() < deadline, roles.log(proc)[-3000:]
        await asyncio.sleep(0.2)
    assert roles.log(proc).count(f"add {file_id} in store {vs_id}: indexed") == 1
    record = redis.Redis.from_url(os.environ["TOKENSTREAM_REDIS_URL"])
    try:
        assert record.hgetall(K.store_file(vs_id, file_id)) == before
    finally:
        record.close()


def upload_through_the_chat_page(url: str, vs_id: str, tmp_path) -> None:
    """The chat page in headless Chromium: choose the store, upload a file into it, see it indexed,
    search it."""
    notes = tmp_path / "harbour.md"
    notes.write_text("# Harbour notes\n\nThe harbour master's cat is named Pepper and sleeps on the crane.\n")
    browser = Chromium(tmp_path / "profile", CHROMIUM)
    try:
        browser.connect()
        browser.call("Page.enable")
        browser.call("Page.navigate", url=f"{url}/#key={default_key()}")
        browser.wait_for("document.body.dataset.state === 'idle' && document.getElementById('model').value")
        browser.js("document.getElementById('files').open = true")
        browser.wait_for(
            f"Array.from(document.getElementById('store').options).some(o => o.value === '{vs_id}')"
        )
        browser.js(
            f"const s = document.getElementById('store'); s.value = '{vs_id}';"
            "s.dispatchEvent(new Event('change'))"
        )
        root = browser.call("DOM.getDocument")["root"]["nodeId"]
        node = browser.call("DOM.querySelector", nodeId=root, selector="#upload")["nodeId"]
        browser.call("DOM.setFileInputFiles", nodeId=node, files=[str(notes)])
        browser.js("document.getElementById('addFile').click()")
        status = browser.wait_for(
            "(t => /completed|failed/.test(t) && t)(document.getElementById('fileStatus').textContent)",
            timeout=120,
        )
        assert status == "harbour.md: completed", status
        browser.js(
            "document.getElementById('query').value = 'What is the name of the cat?';"
            "document.getElementById('search').click()"
        )
        hits = browser.wait_for("document.getElementById('hits').textContent", timeout=60)
        assert "Pepper" in hits and "harbour.md" in hits
    finally:
        browser.close()


@pytest.mark.heavy  # about 22 s; search and tenants apart: tests/test_file_search.py in make test
@pytest.mark.timeout(600)
async def test_upload_index_and_search_with_the_sdk_per_tenant(roles, bootstrap, stack, tmp_path):
    await apply(all_topics(["smollm2"]), bootstrap)
    url, _ = start_gateway(roles, ["smollm2"], env={"TOKENSTREAM_GATEWAY_FILE_MAX_BYTES": str(FILE_MAX)})
    client = api_client(url)
    await refused_uploads(url, client)

    # upload, and a store made before any tool processor runs: the ingestion events wait on the log
    uploaded = await client.files.create(
        file=("nordvik.md", document().encode(), "text/markdown"), purpose="assistants"
    )
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(document().encode())
    assert (await client.files.retrieve(uploaded.id)).filename == "nordvik.md"
    assert (await client.files.content(uploaded.id)).content == document().encode()
    assert uploaded.id in [f.id for f in (await client.files.list()).data]
    store = await client.vector_stores.create(name="nordvik", file_ids=[uploaded.id])
    assert store.id.startswith("vs_") and store.status == "in_progress"
    assert store.file_counts.in_progress == 1 and store.file_counts.total == 1

    env = tools_env(sandbox_root())
    async with contextlib.AsyncExitStack() as running:
        first, _ = await running.enter_async_context(serving(roles, bootstrap, env, name="tools-a"))
        store = await wait_store(client, store.id)
        assert store.file_counts.completed == 1 and store.file_counts.failed == 0
        entry = await client.vector_stores.files.retrieve(uploaded.id, vector_store_id=store.id)
        assert (
            entry.status == "completed" and entry.last_error is None and entry.usage_bytes == uploaded.bytes
        )
        await the_same_event_again_is_passed_over(roles, first, bootstrap, store.id, uploaded.id)

        # kill -9 of the tool processor while it indexes a file: the next one indexes it whole
        tides = await client.files.create(
            file=("tides.md", TIDES.encode(), "text/markdown"), purpose="assistants"
        )
        await client.vector_stores.files.create(vector_store_id=store.id, file_id=tides.id)
        deadline = time.monotonic() + 60
        while f"indexing {tides.id}" not in roles.log(first):
            assert time.monotonic() < deadline, roles.log(first)[-3000:]
            await asyncio.sleep(0.02)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        assert (
            await client.vector_stores.files.retrieve(tides.id, vector_store_id=store.id)
        ).status == "in_progress", "the file was indexed before the kill: make TIDES longer"
        second, _ = await running.enter_async_context(serving(roles, bootstrap, env, name="tools-b"))
        done = await client.vector_stores.files.poll(
            tides.id, vector_store_id=store.id, poll_interval_ms=300, max_wait_seconds=180
        )
        assert done.status == "completed"
        assert (
            roles.log(second).count(
                f"add {tides.id} in store {store.id}: indexed {len(chunks(TIDES))} chunks"
            )
            == 1
        )
        hits = (
            await client.vector_stores.search(store.id, query="high water on day 47", max_num_results=3)
        ).data
        assert "day 47 " in hits[0].content[0].text
        assert (await client.vector_stores.files.delete(tides.id, vector_store_id=store.id)).deleted

        # 20 questions written for the document: each finds its fact in the top 3
        pages = await asyncio.gather(
            *(client.vector_stores.search(store.id, query=q, max_num_results=3) for _, q, _ in FACTS)
        )
        misses = []
        for (_, question, phrase), got in zip(FACTS, pages):
            texts = [c.text for hit in got.data for c in hit.content]
            assert all(hit.file_id == uploaded.id and hit.filename == "nordvik.md" for hit in got.data)
            if not any(phrase in t for t in texts[:3]):
                misses.append(f"{question} -> {[t[:60] for t in texts]}")
        assert not misses, f"{len(misses)} of 20 missed:\n" + "\n".join(misses)

        # a PDF and an unreadable one: completed and failed, counted on the store
        pdf = await client.files.create(
            file=("ferry.pdf", tiny_pdf(["The Lindholm ferry horn is tuned to B flat."]), "application/pdf"),
            purpose="assistants",
        )
        broken = await client.files.create(
            file=("broken.pdf", b"%PDF-1.4 nothing else", "application/pdf"), purpose="assistants"
        )
        done = await client.vector_stores.files.create_and_poll(
            pdf.id, vector_store_id=store.id, poll_interval_ms=300, max_wait_seconds=120
        )
        failed = await client.vector_stores.files.create_and_poll(
            broken.id, vector_store_id=store.id, poll_interval_ms=300, max_wait_seconds=120
        )
        assert done.status == "completed" and failed.status == "failed"
        assert failed.last_error.code == "unsupported_file" and "PDF" in failed.last_error.message
        counts = (await client.vector_stores.retrieve(store.id)).file_counts
        assert (counts.completed, counts.failed, counts.total) == (2, 1, 3)
        hits = (await client.vector_stores.search(store.id, query="What note is the ferry horn?")).data
        assert pdf.id in [h.file_id for h in hits[:3]]

        # deleting the file takes its chunks out of the store's search
        assert (await client.files.delete(pdf.id)).deleted
        deadline = time.monotonic() + 60
        while any(
            h.file_id == pdf.id
            for h in (await client.vector_stores.search(store.id, query="What note is the ferry horn?")).data
        ):
            assert time.monotonic() < deadline, "the deleted file's chunks are still found"
            await asyncio.sleep(0.3)
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(pdf.id)
        assert [f.id for f in (await client.vector_stores.files.list(store.id)).data] == [
            broken.id,
            uploaded.id,
        ]

        # another tenant sees none of it: 404, like ids that never existed
        other = httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {new_key('intruder')}"})
        async with other:
            for method, path, body in [
                ("GET", f"/v1/files/{uploaded.id}", None),
                ("GET", f"/v1/files/{uploaded.id}/content", None),
                ("DELETE", f"/v1/files/{uploaded.id}", None),
                ("GET", f"/v1/vector_stores/{store.id}", None),
                ("GET", f"/v1/vector_stores/{store.id}/files", None),
                ("POST", f"/v1/vector_stores/{store.id}/search", {"query": FACTS[0][1]}),
                ("POST", f"/v1/vector_stores/{store.id}/files", {"file_id": uploaded.id}),
                ("DELETE", f"/v1/vector_stores/{store.id}", None),
            ]:
                r = await other.request(method, path, json=body)
                assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", (
                    path,
                    r.text,
                )
            assert (await other.get("/v1/files")).json()["data"] == []
            own = (await other.post("/v1/vector_stores", json={"name": "mine"})).json()["id"]
            r = await other.post(f"/v1/vector_stores/{own}/files", json={"file_id": uploaded.id})
            assert r.status_code == 404  # nor can it put the file in a store of its own
        assert (await client.vector_stores.retrieve(store.id)).file_counts.total == 2

        if os.path.exists(CHROMIUM):
            await asyncio.to_thread(upload_through_the_chat_page, url, store.id, tmp_path)
            assert (await client.vector_stores.retrieve(store.id)).file_counts.completed == 2

        # deleting the store takes every chunk of it out
        assert (await client.vector_stores.delete(store.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await client.vector_stores.retrieve(store.id)
