"""Incremental detokenization (token ids -> safe text deltas) and stop-string handling.

Not on `tokenizers.decoders.DecodeStream` (Rust, about half the cost per token), because
of what users would see: while the text ends mid-character it holds back everything since
its last chunk, so complete characters before a split one (the space of " 😀") wait a
token; it has no flush, so a request ending mid-character (a length stop) loses those
bytes; it bounds nothing, so invalid UTF-8 from the model stalls the stream while each
step decodes an ever longer window; and a prompt ending mid-character leaks prompt text
into the first delta. Working around all four means mirroring its state in Python.
"""
from __future__ import annotations

from typing import Any, Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas.

    Decoding one token at a time is wrong for two reasons: a byte-level BPE token may
    hold part of a multi-byte UTF-8 character (it decodes to U+FFFD), and some decoders
    render a token differently depending on its neighbours (SentencePiece drops the
    leading space of the first token it decodes). So each step decodes a small window
    ids[prefix:] whose first tokens, ids[prefix:read], were already emitted and serve
    only as context, and emits what the window text has beyond what was sent. A
    trailing U+FFFD (an unfinished character) is held back; the window moves on only
    once its text ends in a complete character, so it always starts on a character
    boundary.
    """

    # Prompt tokens kept as context before the first generated token (see above).
    PROMPT_CONTEXT = 6
    # Pathological guard: if the text keeps ending in U+FFFD for this many tokens (the
    # model is producing invalid UTF-8), move the window on anyway, so that each step
    # does not re-decode an ever growing window. Valid text never gets near this: a
    # character spans at most 4 bytes, though BPE tokens that bridge characters can
    # postpone a clean boundary for the length of a word.
    MAX_HELD_TOKENS = 256

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        # A fast tokenizer's decode is its Rust tokenizer's decode plus Python around it
        # (argument conversion: a third of the cost per step at 256 streams); call the
        # Rust one directly. The clean-up it would add is off anyway (below).
        self._tokenizer = getattr(tokenizer, "backend_tokenizer", None) or tokenizer
        self._decode_kwargs: dict[str, Any] = {
            "skip_special_tokens": skip_special_tokens,
            # Tokenization-space cleanup (" ," -> ",") rewrites the model's text and makes
            # a window's decode disagree with the full decode at its edges; serve raw text.
            "clean_up_tokenization_spaces": False,
        }
        self._ids: list[int] = list(prompt_ids[-self.PROMPT_CONTEXT:]) if prompt_ids else []
        context = self._decode(self._ids)
        if context.endswith(_REPLACEMENT):
            # The prompt ends mid-character (token-id prompts can): its bytes would merge
            # with the first generated ones. The output is defined as the decode of the
            # generated ids alone, so start without context.
            self._ids, context = [], ""
        self._prefix = 0              # window start
        self._read = len(self._ids)   # ids[prefix:read] are context, already emitted
        # Characters of the window text already emitted (context included).
        self._sent = len(context)
        self.num_generated = 0

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        try:
            return self._tokenizer.decode(list(ids), **self._decode_kwargs)
        except TypeError:
            # A raw `tokenizers.Tokenizer` knows no clean_up_tokenization_spaces (and
            # never cleans up); drop the argument for good.
            if "clean_up_tokenization_spaces" not in self._decode_kwargs:
                raise
            self._decode_kwargs.pop("clean_up_tokenization_spaces")
            return self._tokenizer.decode(list(ids), **self._decode_kwargs)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the new text that is safe to show now."""
        if not len(token_ids):
            return ""
        self._ids.extend(int(t) for t in token_ids)
        self.num_generated += len(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        """Return everything still held back (call once the sequence has finished)."""
        if self._read >= len(self._ids):
            return ""
        return self._step(final=True)

    def _step(self, final: bool) -> str:
        text = self._decode(self._ids[self._prefix:])
        held = len(self._ids) - self._read
        if not final and held < self.MAX_HELD_TOKENS:
            if text.endswith(_REPLACEMENT):
                # Unfinished character at the end: send the complete characters before it
                # (they cannot change any more) and keep the window where it is.
                stable = len(text.rstrip(_REPLACEMENT))
                out = text[self._sent:stable] if stable > self._sent else ""
                self._sent = max(self._sent, stable)
                return out
            if len(text) <= self._sent:
                # Nothing visible yet (e.g. a skipped special token); keep the context.
                return ""
        out = text[self._sent:]
        # Text ends in a complete character and has all been sent: the ids up to here
        # become the next window's context.
        self._prefix, self._read = self._read, len(self._ids)
        self._sent = len(self._decode(self._ids[self._prefix:self._read]))
        # Drop ids that no window will look at again, keeping memory flat.
        if self._prefix > 256:
            del self._ids[:self._prefix]
            self._read -= self._prefix
            self._prefix = 0
        return out


class StopChecker:
    """Cuts streamed text at the first stop string, as OpenAI does (stop not included).

    Text that could be the start of a stop string is held back until the next piece
    decides it; `finish()` releases it when generation ends for another reason.
    """

    def __init__(self, stops: Sequence[str] | None) -> None:
        # Empty strings would match everywhere; duplicates change nothing.
        self.stops: list[str] = list(dict.fromkeys(s for s in (stops or []) if s))
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> tuple[str, bool]:
        """Feed newly detokenized text; return (text safe to emit, stopped)."""
        if self.stopped:
            return "", True
        if not self.stops:
            return text, False
        buf = self._held + text
        hit, hit_at = None, len(buf)
        for s in self.stops:
            i = buf.find(s, 0, hit_at + len(s))  # only earlier matches can win
            if 0 <= i < hit_at:
                hit, hit_at = s, i
        if hit is not None:
            self.stopped, self.matched, self._held = True, hit, ""
            return buf[:hit_at], True
        keep = self._partial_stop_len(buf)
        self._held = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep], False

    __call__ = feed

    def finish(self) -> str:
        """Release held-back text at the end of generation (nothing after a stop)."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    @property
    def held(self) -> str:
        return self._held

    def _partial_stop_len(self, buf: str) -> int:
        # Longest tail of buf that is a proper prefix of some stop string. Holding the
        # longest such tail is enough: any stop that began earlier would make a longer
        # tail a prefix too.
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class TextStream:
    """One request's generated text as it grows: incremental detokenization, then the
    stop strings. The in-process engine's scheduler and the Serve engine's request
    streams both turn tokens into text through it."""

    __slots__ = ("detok", "stopper")

    def __init__(self, tokenizer: Any, prompt_ids: Sequence[int], stops: Sequence[str] | None):
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self.stopper = StopChecker(stops)

    @property
    def has_stops(self) -> bool:
        return bool(self.stopper.stops)

    def feed(self, token_ids: Sequence[int], final: bool) -> tuple[str, bool]:
        """Text of new ids (a stop token left out by the caller) -> (text to emit, whether
        a stop string ended it). `final`: generation ended; release what is held back."""
        piece = self.detok.add(token_ids)
        if final:
            piece += self.detok.flush()
        text, stopped = self.stopper.feed(piece)
        if final and not stopped:
            text += self.stopper.finish()
        return text, stopped


def detokenizer_factory(tokenizer: Any):
    """What the Scheduler calls per request: its TextStream."""
    def make(req) -> TextStream:
        return TextStream(tokenizer, req.prompt_ids, req.params.stop)
    return make
