"""PieceEncoder: a long text cut into pieces encodes to the whole text's ids, for every
tokenizer it cuts (SmolLM2's GPT-2 pre-tokenizer, Qwen2's, Llama 3's regex), on long
chat prompts and on texts built to put whitespace, line breaks, digits, combining marks
and chat markers beside every cut; tokenizers it cannot show that for are never cut."""
import copy
import random
from pathlib import Path

import pytest
from tokenizers import Regex, pre_tokenizers
from tokenizers.processors import TemplateProcessing

from benchmarks.http_bench import long_prompt
from kestrel_testing import mt_bench_first_turns
from serve_app.text.text_pieces import _LLAMA3, PieceEncoder
from serve_app.text.tokenizer import load_tokenizer, render_chat_template

QWEN2 = Path(__file__).resolve().parents[2] / "models" / "qwen2.5-7b"
# Every kind of character a cut's neighbourhood can hold, chat markers of both vocabularies
# included; a random string of them has a line break before a letter every few characters.
ALPHABET = ["\n", "\n", "\n\n", " ", "  ", "\r\n", "\t", ".", ",", "!", "'s", "'", "a", "b", "Z",
            "é", "e\u0301", "ß", "日本", "1", "23", "4567", "²", "😀", "<|im_start|>", "<|im_end|>",
            "<｜User｜>", "word", " word", "Word"]


@pytest.fixture(scope="module")
def qwen2():
    return load_tokenizer(str(QWEN2))


def llama3_regex(tok):
    """Qwen2's tokenizer with Llama 3's pre-tokenizer regex (digits in threes)."""
    tok = copy.deepcopy(tok)
    tok.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(_LLAMA3), "isolated"),
         pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def with_bos(tok):
    """The tokenizer with a post-processor that puts a BOS first (add_special_tokens=True)."""
    tok = copy.deepcopy(tok)
    bos = tok.convert_ids_to_tokens(1)
    tok.backend_tokenizer.post_processor = TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, 1)])
    return tok


@pytest.fixture(scope="module")
def llama3(qwen2):
    return llama3_regex(qwen2)  # a deep copy of Qwen2's tokenizer (~1.5 s): once; only read


@pytest.fixture(params=["smollm2", "qwen2", "llama3-regex"])
def tok(request, tokenizer, qwen2):
    if request.param == "llama3-regex":  # the copy only where it is asked for, once a module
        return request.getfixturevalue("llama3")
    return {"smollm2": tokenizer, "qwen2": qwen2}[request.param]


def whole(tok, text, special=False):
    return tok.backend_tokenizer.encode(text, add_special_tokens=special).ids


def test_long_chat_prompts_are_cut_and_encode_as_the_whole(tok):
    qs = mt_bench_first_turns(80)
    texts = [render_chat_template(tok, [{"role": "user", "content": long_prompt(qs, i, 6000)}])
             for i in range(3)]
    enc = PieceEncoder(tok.backend_tokenizer)
    assert all(len(enc.cuts(t)) >= 3 for t in texts)  # ~37k characters: several pieces
    assert enc.encode_batch(texts, False) == [whole(tok, t) for t in texts]


@pytest.mark.parametrize("special", [False, True])
def test_cuts_beside_every_kind_of_character_change_no_id(tok, special):
    if special:
        tok = with_bos(tok)
    rng = random.Random(0)
    texts = ["".join(rng.choice(ALPHABET) for _ in range(rng.randrange(5, 120))) for _ in range(1500)]
    enc = PieceEncoder(tok.backend_tokenizer, piece_chars=8)
    assert sum(len(enc.cuts(t)) for t in texts) > 3000
    got = enc.encode_batch(texts, special)
    assert [t for t, ids in zip(texts, got) if ids != whole(tok, t, special)] == []


def test_a_short_text_is_not_cut(tokenizer):
    enc = PieceEncoder(tokenizer.backend_tokenizer, piece_chars=100)
    text = "one line\nanother line\n" * 8  # 184 characters: under two pieces
    assert enc.cuts(text) == []
    assert len(enc.cuts(text * 2)) == 2  # pieces of at least 100 characters


def test_the_cut_goes_where_the_pre_tokenizer_puts_the_line_break(tokenizer, qwen2):
    text = "a" * 20 + ".\n\nNext" + "b" * 20
    after, before = text.index("Next"), text.index("Next") - 1
    assert PieceEncoder(qwen2.backend_tokenizer, piece_chars=10).cuts(text) == [after]
    # GPT-2's regex splits the last line break off a run before a letter: the cut goes before it.
    assert PieceEncoder(tokenizer.backend_tokenizer, piece_chars=10).cuts(text) == [before]


def changed(tok, change):
    tok = copy.deepcopy(tok)
    change(tok.backend_tokenizer)
    return tok.backend_tokenizer


@pytest.mark.parametrize("change", [
    lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.ByteLevel(add_prefix_space=True)),
    lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Metaspace()),
    lambda b: setattr(b, "pre_tokenizer", pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"\s+|\S+"), "isolated"), pre_tokenizers.ByteLevel(use_regex=False)])),
    lambda b: b.enable_truncation(100),
    lambda b: b.add_tokens(["line\nbreak"]),
], ids=["prefix-space", "metaspace", "unknown-regex", "truncation", "added-token-with-newline"])
def test_other_tokenizers_are_never_cut(tokenizer, change):
    enc = PieceEncoder(changed(tokenizer, change), piece_chars=8)
    text = "first line\nsecond line\nthird line\n" * 4
    assert enc.back is None and enc.cuts(text) == []
    assert enc.encode_batch([text], False) == [enc.backend.encode(text, add_special_tokens=False).ids]
