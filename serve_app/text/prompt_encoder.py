"""Prompt text to token ids for the HTTP front end, off its event loop where that pays.

A fast tokenizer's `encode` holds the GIL for the whole text, so running it on a thread
does not free the event loop; its `encode_batch` releases the GIL (and spreads the batch
over cores). So the texts asked for in one loop round are encoded together, as one batch
on a thread of their own, while the loop writes other requests' chunks: a burst of
arrivals costs the loop their chat templates, not their encoding. A lone short text is
encoded inline, where a thread hop would cost more than the encoding. A long text goes
into the batch cut into pieces, so it too is spread over the cores
(serve_app/text/text_pieces.py): a 32k-token prompt is encoded in a fraction of the time
one core takes.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from serve_app.text.text_pieces import PieceEncoder

INLINE_CHARS = 8192  # a lone text up to this long is encoded on the loop (tens of µs)


class PromptEncoder:
    def __init__(self, tokenizer: Any, inline_chars: int = INLINE_CHARS):
        self.tokenizer = tokenizer
        self.backend = getattr(tokenizer, "backend_tokenizer", None)  # None: a slow tokenizer
        self.pieces = PieceEncoder(self.backend) if self.backend is not None else None
        self.inline_chars = inline_chars
        self.pending: list[tuple[str, bool, asyncio.Future]] = []  # texts of this round
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="kestrel-encode")
        self.batches = 0  # batches encoded on the thread, and the texts in them
        self.batched_texts = 0

    async def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        if self.backend is None:
            # A slow tokenizer is Python: a thread would hold the GIL all the same.
            return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        if not self.pending:
            # Runs in the next round, after every handler of this one has added its text.
            loop.call_soon(self._flush)
        self.pending.append((text, add_special_tokens, fut))
        return await fut

    def _flush(self) -> None:
        batch, self.pending = self.pending, []
        if len(batch) == 1 and len(batch[0][0]) <= self.inline_chars:
            text, special, fut = batch[0]
            if not fut.done():  # its handler may have been cancelled
                fut.set_result(self.backend.encode(text, add_special_tokens=special).ids)
            return
        loop = asyncio.get_running_loop()
        for special in (False, True):
            part = [(text, fut) for text, s, fut in batch if s == special]
            if part:
                done = loop.run_in_executor(self.pool, self._encode_batch, [t for t, _ in part], special)
                done.add_done_callback(lambda d, part=part: self._deliver(part, d))

    def _encode_batch(self, texts: list[str], special: bool) -> list[list[int]]:
        self.batches += 1
        self.batched_texts += len(texts)
        return self.pieces.encode_batch(texts, special)

    @staticmethod
    def _deliver(part: list[tuple[str, asyncio.Future]], done: asyncio.Future) -> None:
        error = done.exception()
        for i, (_, fut) in enumerate(part):
            if fut.done():
                continue
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(done.result()[i])

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
