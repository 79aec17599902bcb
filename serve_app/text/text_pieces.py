"""A batch of texts to token ids, each long text cut into pieces that encode in parallel.

A fast tokenizer's batch call spreads its texts over the cores, but one text runs on one
core: a 32k-token prompt takes tens of ms. Cut into pieces of about `PIECE_CHARS`
characters, it is a batch of its own, spread like any other. The pieces' ids, put end to
end, are the whole text's ids only where no step of the tokenizer looks across a cut, so
cuts are made only for tokenizers where that is shown to hold, and only at one kind of
place: a line break followed by a letter.

- Added tokens (the chat template's markers) are split off before anything else: none
  may hold a line break or strip the whitespace beside it (lstrip / rstrip), so none
  straddles a cut or reaches over one.
- The normalizer is none or NFC, which composes nothing with a line break.
- The pre-tokenizer is one of `_REGEXES`, byte-level, without a prefix space. No match
  of these regexes holds a line break followed by a letter, and where a match ends in
  a line break the regex matched the same there at the end of a text:
  - Qwen2's and Llama 3's regex take a run of whitespace ending in line breaks, and
    punctuation with the line breaks after it, whole (`\\s*[\\r\\n]+`,
    `[\\r\\n]*`): the cut goes after the run's last line break.
  - GPT-2's (SmolLM2's byte-level pre-tokenizer) splits the last whitespace character
    off a run followed by a letter (`\\s+(?!\\S)` backs off by one), but takes a run at
    the end of a text whole: the cut goes before the run's last line break, so the
    left piece ends in the run less that line break (as the whole text has it), and
    the right piece starts with that line break and the letter.
- The model is BPE without dropout, whose merges stay inside a pre-token; no
  truncation or padding, which would see each piece's length.

The special tokens a post-processor adds (a BOS) are added once, to the pieces' ids
merged. tests/unit/test_text_pieces.py checks the ids against the whole text's for each
of these tokenizers, on long prompts and on texts built to have whitespace, line breaks
and markers at every cut.
"""
from __future__ import annotations

import json
import re
from itertools import chain
from typing import Any

from tokenizers import Encoding, normalizers
from tokenizers.models import BPE

PIECE_CHARS = 8192  # about 2k tokens of English: a few ms of one core per piece

# The pre-tokenizer's regex -> where the cut goes: after the line break (0) or before it (1).
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_LLAMA3 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT2 = "byte-level"  # ByteLevel(use_regex=True): GPT-2's regex, built into the tokenizer
_REGEXES = {_QWEN2: 0, _LLAMA3: 0, _GPT2: 1}

# A line break followed by a letter (Python's `re` has no \p{L}; [^\W\d_] is a word
# character that is neither a decimal digit nor an underscore: a letter, or one of the
# few numerals that are no digit, such as '²', which are neither space nor a combining mark).
_BREAK_BEFORE_LETTER = re.compile(r"\n(?=[^\W\d_])")


class PieceEncoder:
    def __init__(self, backend: Any, piece_chars: int = PIECE_CHARS):
        """`backend`: a `tokenizers.Tokenizer` (a fast tokenizer's backend_tokenizer)."""
        self.backend = backend
        # Ids without the offsets, which nothing here reads: a fifth less time. Older
        # tokenizers lack it.
        self.encode_fast = getattr(backend, "encode_batch_fast", backend.encode_batch)
        self.piece_chars = piece_chars
        self.back = _cut_offset(backend)  # None: this tokenizer's texts are never cut

    def cuts(self, text: str) -> list[int]:
        """Where to cut `text`: pieces of at least piece_chars characters each, none
        when the tokenizer cannot be cut or the text is not two pieces long."""
        if self.back is None or len(text) < 2 * self.piece_chars:
            return []
        out, start = [], 0
        while True:
            m = _BREAK_BEFORE_LETTER.search(text, start + self.piece_chars, len(text) - self.piece_chars)
            if m is None:
                return out
            start = m.end() - self.back
            out.append(start)

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's ids, as `backend.encode(text, add_special_tokens)` gives them."""
        pieces, spans = [], []
        for text in texts:
            bounds = [0, *self.cuts(text), len(text)]
            spans.append((len(pieces), len(pieces) + len(bounds) - 1))
            pieces += [text[a:b] for a, b in zip(bounds, bounds[1:])]
        if len(pieces) == len(texts):  # nothing cut
            return [e.ids for e in self.encode_fast(texts, add_special_tokens=add_special_tokens)]
        encodings = self.encode_fast(pieces, add_special_tokens=False)
        if add_special_tokens:  # as encode does: the post-processor, once, on the merged pieces
            return [self.backend.post_process(Encoding.merge(encodings[a:b]), None, True).ids
                    for a, b in spans]
        return [list(chain.from_iterable(e.ids for e in encodings[a:b])) for a, b in spans]


def _cut_offset(backend: Any) -> int | None:
    """Where a cut goes relative to the line break (see the module's notes), or None
    when this tokenizer is not one whose pieces are known to encode as the whole."""
    if not isinstance(backend.model, BPE) or backend.model.dropout:
        return None
    if backend.truncation is not None or backend.padding is not None:
        return None
    if backend.normalizer is not None and not isinstance(backend.normalizer, normalizers.NFC):
        return None
    if any("\n" in t.content or t.lstrip or t.rstrip for t in backend.get_added_tokens_decoder().values()):
        return None
    return _REGEXES.get(_regex(backend.pre_tokenizer))


def _regex(pre_tokenizer: Any) -> str | None:
    """The pre-tokenizer's regex when it is byte-level without a prefix space, else None."""
    if pre_tokenizer is None:
        return None
    try:
        state = json.loads(pre_tokenizer.__getstate__())
    except Exception:  # noqa: BLE001 - a custom (Python) pre-tokenizer has no state to read
        return None
    if state["type"] == "ByteLevel":
        return _GPT2 if state["use_regex"] and not state["add_prefix_space"] else None
    if state["type"] != "Sequence" or len(state["pretokenizers"]) != 2:
        return None
    split, byte_level = state["pretokenizers"]
    if (split["type"] != "Split" or split["behavior"] != "Isolated" or split["invert"]
            or "Regex" not in split["pattern"] or byte_level["type"] != "ByteLevel"
            or byte_level["use_regex"] or byte_level["add_prefix_space"]):
        return None
    return split["pattern"]["Regex"]
