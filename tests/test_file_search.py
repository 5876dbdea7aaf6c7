"""File search: a document of 20 facts ingested into the real Weaviate, 20 questions through a real tool
processor."""

from __future__ import annotations

import json
import uuid

import pytest

from schemas import ToolCall
from tests.tool_support import sandbox_root, serving, tools_env
from tools.search.extract import chunks, extract
from tools.search.index import ChunkIndex
from tools.search.ingest import ingest

# (fact, question, a phrase only the fact's chunk holds)
FACTS = [
    (
        "The Harbour Street bakery opened in 1962 and was founded by Margit Olsen.",
        "Who founded the bakery on Harbour Street?",
        "Margit Olsen",
    ),
    (
        "Its sourdough starter is kept in a cellar at exactly eleven degrees Celsius.",
        "At what temperature is the sourdough starter stored?",
        "eleven degrees",
    ),
    (
        "The bakery sells about four hundred rye loaves every Saturday morning.",
        "How many rye loaves are sold on Saturdays?",
        "four hundred rye loaves",
    ),
    (
        "Its wood-fired oven was built by a mason from Bergen named Tor Haugland.",
        "Who built the wood-fired oven?",
        "Tor Haugland",
    ),
    (
        "The town library holds a collection of 3,200 maps of the northern fjords.",
        "How many maps of the fjords does the library have?",
        "3,200 maps",
    ),
    (
        "The library's reading room is closed every Wednesday for cleaning.",
        "On which day is the reading room shut?",
        "every Wednesday",
    ),
    (
        "A librarian named Ingrid Vik catalogued the maps over nine winters.",
        "Who catalogued the map collection?",
        "Ingrid Vik",
    ),
    (
        "Members may borrow at most six books at a time from the library.",
        "What is the borrowing limit for library members?",
        "six books",
    ),
    (
        "The ferry to Lindholm island leaves the pier at 07:40 on weekdays.",
        "When does the weekday ferry to Lindholm depart?",
        "07:40",
    ),
    (
        "The ferry, called the Sjøsprøyt, carries up to 180 passengers and 24 cars.",
        "What is the passenger capacity of the ferry?",
        "180 passengers",
    ),
    (
        "In storms above force nine the crossing to Lindholm is cancelled.",
        "When is the Lindholm crossing called off?",
        "force nine",
    ),
    (
        "A return ticket for a bicycle on the ferry costs 45 kroner.",
        "How much does it cost to take a bike on the ferry?",
        "45 kroner",
    ),
    (
        "The lighthouse on Lindholm was automated in 1987 and its keeper moved to the mainland.",
        "In which year did the lighthouse become automatic?",
        "1987",
    ),
    (
        "Its lamp flashes white twice every fifteen seconds.",
        "What is the light pattern of the lighthouse lamp?",
        "twice every fifteen seconds",
    ),
    (
        "A colony of about two hundred puffins nests on the cliffs below the lighthouse.",
        "Which seabirds breed beneath the lighthouse?",
        "puffins",
    ),
    (
        "Visitors may climb the tower only between June and August.",
        "During which months can the tower be climbed?",
        "between June and August",
    ),
    (
        "The village football club, Fjordlaget, won the regional cup in 2019.",
        "When did Fjordlaget win the regional cup?",
        "2019",
    ),
    (
        "The club trains on an artificial pitch paid for by a salmon farm.",
        "Who paid for the club's artificial pitch?",
        "salmon farm",
    ),
    (
        "Its top scorer of all time is a goalkeeper-turned-striker named Eirik Dahl with 212 goals.",
        "Who scored the most goals for the club?",
        "Eirik Dahl",
    ),
    (
        "Home matches draw an average crowd of 350 people.",
        "How many spectators attend a typical home game?",
        "350 people",
    ),
]


def document() -> str:
    paragraphs = [" ".join(f for f, _, _ in FACTS[i : i + 4]) for i in range(0, len(FACTS), 4)]
    return "# Life in Nordvik\n\n" + "\n\n".join(paragraphs) + "\n"


def tiny_pdf(lines: list[str]) -> bytes:
    """A one-page PDF with `lines` of Helvetica text (hand-built: no PDF writer is a dependency)."""
    content = "BT /F1 12 Tf 72 720 Td 14 TL " + " ".join(f"({line}) '" for line in lines) + " ET"
    objs = [
        "<< /Type /Catalog /Pages 2 0 R >>",
        "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        (
            "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
            "/Resources << /Font << /F1 5 0 R >> >> >>"
        ),
        f"<< /Length {len(content)} >>\nstream\n{content}\nendstream",
        "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    out, offsets = b"%PDF-1.4\n", []
    for i, obj in enumerate(objs, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{obj}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objs) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    return out + f"trailer\n<< /Size {len(objs) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()


def search_call(query: str, tenant: str, stores: list[str]) -> ToolCall:
    return ToolCall(
        request_id=f"req-{uuid.uuid4().hex[:10]}",
        call_id=f"call-{uuid.uuid4().hex}",
        tenant=tenant,
        conversation_id="conv-search",
        name="file_search",
        arguments=json.dumps({"query": query, "vector_store_ids": stores, "max_num_results": 3}),
    )


def test_extract_and_chunk_each_kind():
    html = (
        b"<html><body><nav>Menu</nav><article><p>"
        + b"The ferry leaves at 07:40 on weekdays. " * 3
        + b"</p></article></body></html>"
    )
    assert "07:40" in extract("page.html", html).text
    assert extract("notes.md", document().encode()).text.startswith("# Life in Nordvik")
    pieces = chunks(document())
    assert len(pieces) == 6 and all(len(p.split()) <= 90 for p in pieces)
    pdf = extract("facts.pdf", tiny_pdf(["The ferry leaves at 07:40.", "It carries 180 passengers."]))
    assert pdf.pages == 1 and "07:40" in pdf.text and "180 passengers" in pdf.text
    with pytest.raises(ValueError, match="only"):
        extract("archive.zip", b"PK")
    with pytest.raises(ValueError, match="not a readable PDF"):
        extract("broken.pdf", b"%PDF-1.4 nothing else")


@pytest.mark.timeout(600)
async def test_file_search_finds_the_right_chunk_and_keeps_tenants_apart(roles, bootstrap, stack):
    tenant, store, file_id = (
        f"acme-{uuid.uuid4().hex[:6]}",
        f"vs_{uuid.uuid4().hex[:12]}",
        f"file-{uuid.uuid4().hex[:12]}",
    )
    index = ChunkIndex.connect()
    try:
        done = ingest(index, tenant, store, file_id, "nordvik.md", document().encode())
    finally:
        index.close()
    assert done.chunks == 6
    questions = [search_call(q, tenant, [store]) for _, q, _ in FACTS]
    other_tenant = search_call(FACTS[0][1], f"intruder-{uuid.uuid4().hex[:6]}", [store])
    other_store = search_call(FACTS[0][1], tenant, ["vs_someone_else"])
    async with serving(roles, bootstrap, tools_env(sandbox_root())) as (_, bus):
        for call in [*questions, other_tenant, other_store]:
            await bus.send(call)
        got = await bus.wait([c.call_id for c in [*questions, other_tenant, other_store]], timeout_s=300)
    misses = []
    for (fact, question, phrase), call in zip(FACTS, questions):
        r = got[call.call_id]
        assert r.ok, r.error
        results = json.loads(r.output)["results"]
        assert all(h["file_id"] == file_id and h["vector_store_id"] == store for h in results)
        if not any(phrase in h["text"] for h in results[:3]):
            misses.append(f"{question} -> {[h['text'][:60] for h in results]}")
    assert not misses, f"{len(misses)} of 20 missed:\n" + "\n".join(misses)
    top = json.loads(got[questions[0].call_id].output)["results"][0]
    assert top["score"] > 0 and isinstance(top["chunk_index"], int)
    assert json.loads(got[other_tenant.call_id].output)["results"] == []
    assert json.loads(got[other_store.call_id].output)["results"] == []
