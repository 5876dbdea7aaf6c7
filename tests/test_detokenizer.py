"""Incremental detokenisation (gpu_workers/detokenizer.py) with SmolLM2's tokenizer: the Rust path
(DecodeStream) gives token by token the texts of the window path decoded from Python, the text of a
full decode wherever that does not end inside a character, and a Detokenizer resumed after any number
of earlier ids (a takeover) goes on exactly as the uninterrupted one."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders
from transformers import PreTrainedTokenizerFast

from common.models import load_tokenizer
from gpu_workers.detokenizer import Detokenizer, stream_backend

TEXT = "Grüße aus Köln! 東京タワー 🚀🎉 naïve café\n\tcode: `x = [1, 2]`  — done. 北京欢迎你 👩‍💻 ½ → ∑"
CHARS = "🚀🎉👩‍💻東京北欢日本語éü½∑—"


class WindowOnly:
    """The tokenizer without its Rust backend in sight: the Detokenizer decodes windows from Python."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer("smollm2")


def byte_ids(tok) -> dict[int, int]:
    """Byte b -> the id of the token that is b alone (GPT-2's byte-to-character map), for the bytes the
    vocabulary has alone (SmolLM2's lacks some that valid UTF-8 never holds)."""
    printable = {
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    }
    chars, extra = [], 0
    for b in range(256):
        chars.append(chr(b) if b in printable else chr(256 + extra))
        extra += b not in printable
    ids = {b: tok.backend_tokenizer.token_to_id(c) for b, c in enumerate(chars)}
    return {b: t for b, t in ids.items() if t is not None}


def varied(tok, seed: int, pieces: int = 60) -> list[int]:
    """Ids of every kind: runs of real multilingual text, random vocabulary ids, special tokens,
    emoji and CJK characters split into one token per byte, and lone high bytes (broken UTF-8)."""
    rng = random.Random(seed)
    by_byte = byte_ids(tok)
    high = [b for b in by_byte if b >= 0x80]
    text_ids = tok(TEXT)["input_ids"]
    specials = sorted(tok.added_tokens_decoder)
    ids: list[int] = []
    for _ in range(pieces):
        kind = rng.randrange(6)
        if kind == 0:
            start = rng.randrange(len(text_ids))
            ids += text_ids[start : start + rng.randint(1, 12)]
        elif kind == 1:
            ids.append(rng.randrange(len(tok)))
        elif kind == 2:
            ids.append(rng.choice(specials))
        elif kind in (3, 4):
            ids += [by_byte[b] for b in rng.choice(CHARS).encode()]
        else:
            ids += [by_byte[rng.choice(high)] for _ in range(rng.randint(1, 3))]
    return ids


def steps(d: Detokenizer, ids: list[int]) -> list[tuple[str, int, int]]:
    """What each add returned, with the offsets after it (gpu_workers/streaming.py reads them)."""
    return [(d.add(t), d.prefix_offset, d.read_offset) for t in ids]


def test_byte_ids_are_single_bytes(tok):
    by_byte = byte_ids(tok)
    assert len(set(by_byte.values())) == len(by_byte) > 200
    assert tok.decode([by_byte[b] for b in TEXT.encode()]) == TEXT


def test_incremental_detokenizer_equals_full_decode_at_every_token(tok):
    ids = tok(TEXT)["input_ids"] + [tok.eos_token_id] + tok(" and more 日本")["input_ids"]
    d = Detokenizer(tok)
    assert d.stream is not None  # SmolLM2's tokenizer is fast: DecodeStream does the work
    streamed = ""
    for i, t in enumerate(ids):
        streamed += d.add(t)
        full = tok.decode(ids[: i + 1], skip_special_tokens=True)
        assert full.startswith(streamed), (i, streamed, full)
        # only a split character waits
        assert streamed == full or full.endswith("\ufffd"), (i, streamed, full)
    assert streamed == d.text == tok.decode(ids, skip_special_tokens=True)
    # resuming from emitted tokens (takeover) continues with the same text
    r = Detokenizer(tok, ids[:9])
    rest = "".join(r.add(t) for t in ids[9:])
    assert r.text == streamed and rest and streamed.endswith(rest)


@pytest.mark.parametrize("seed", range(40))
def test_stream_path_equals_window_path_and_full_decodes_on_varied_ids(tok, seed):
    ids = varied(tok, seed)
    stream, window = Detokenizer(tok), Detokenizer(WindowOnly(tok))
    assert window.stream is None
    got, expected = steps(stream, ids), steps(window, ids)
    assert got == expected
    assert stream.stream is not None  # never fell back: the Rust path produced every text above
    streamed = ""
    for i, (new, _, _) in enumerate(got):
        streamed += new
        full = tok.decode(ids[: i + 1], skip_special_tokens=True)
        assert full.startswith(streamed), (i, streamed, full)
        assert streamed == full or full.endswith("\ufffd"), (i, streamed, full)
    assert stream.text == window.text == streamed
    with_end = ids + tok.encode(".")  # a complete character after them: nothing waits any more
    assert Detokenizer(tok, with_end).text == tok.decode(with_end, skip_special_tokens=True)


@pytest.mark.parametrize("fast", [True, False], ids=["stream", "window"])
def test_resumed_at_every_split_point_equals_uninterrupted(tok, fast):
    tokenizer = tok if fast else WindowOnly(tok)
    ids = varied(tok, 1000, pieces=25) + tok(TEXT)["input_ids"]
    whole = Detokenizer(tokenizer)
    texts = [""]
    after = steps(whole, ids)
    for new, _, _ in after:
        texts.append(texts[-1] + new)
    for k in range(len(ids) + 1):
        resumed = Detokenizer(tokenizer, ids[:k])
        assert (resumed.stream is not None) == fast
        assert resumed.ids == ids[:k] and resumed.text == texts[k], k
        if k:
            assert (resumed.prefix_offset, resumed.read_offset) == after[k - 1][1:], k
        assert steps(resumed, ids[k:]) == after[k:], k
        assert resumed.text == whole.text, k


def test_a_text_that_stops_extending_its_window_falls_back_to_the_window_path(tok):
    """DecodeStream refuses a decoder whose text of more tokens does not start with that of fewer; the
    Detokenizer then decodes windows from Python, with the texts the window path gives throughout."""

    class Reversed:
        def decode_chain(self, tokens):
            return ["".join(tokens)[::-1]]

    odd = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tok.backend_tokenizer.to_str()))
    odd.backend_tokenizer.decoder = decoders.Decoder.custom(Reversed())
    ids = tok(TEXT)["input_ids"]
    d = Detokenizer(odd)
    assert d.stream is not None
    assert steps(d, ids) == steps(Detokenizer(WindowOnly(odd)), ids)
    assert d.stream is None


def test_a_decode_that_cleans_up_spaces_is_decoded_in_windows(tok):
    cleaning = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(tok.backend_tokenizer.to_str()), clean_up_tokenization_spaces=True
    )
    assert stream_backend(tok) is tok.backend_tokenizer
    assert stream_backend(cleaning) is None and stream_backend(WindowOnly(tok)) is None
    assert Detokenizer(cleaning).stream is None
