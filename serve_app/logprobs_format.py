"""Logprobs as OpenAI's responses carry them: chat's `content` list, completions' parallel
lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token is shown as the text it decodes to alone (as vLLM does), with its UTF-8 bytes in
chat; pieces are cached, as each appears in every response that lists it.
"""
from __future__ import annotations

from typing import Any

from serve_app.openai_protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class LogprobFormatter:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._pieces: dict[int, str] = {}

    def piece(self, token_id: int) -> str:
        p = self._pieces.get(token_id)
        if p is None:
            p = self._pieces[token_id] = self.tokenizer.decode([token_id])
        return p

    def of(self, kind: str, ids: list[int], entries: list, offset: int):
        """Chat's or completions' shape ("chat" | "completion"); `offset` as in completion."""
        return self.chat(ids, entries) if kind == "chat" else self.completion(ids, entries, offset)

    def chat(self, ids: list[int], entries: list) -> ChatLogprobs:
        """ids [n] and their engine entries (logprob, top ids, top logprobs)."""
        out = []
        for t, (lp, top_ids, top_lps) in zip(ids, entries):
            p = self.piece(t)
            out.append(ChatTokenLogprob(
                token=p, logprob=lp, bytes=list(p.encode("utf-8")),
                top_logprobs=[TopLogprob(token=self.piece(i), logprob=v,
                                         bytes=list(self.piece(i).encode("utf-8")))
                              for i, v in zip(top_ids, top_lps)]))
        return ChatLogprobs(content=out)

    def completion(self, ids: list[int], entries: list, offset: int) -> CompletionLogprobs:
        """`offset`: characters of the choice's text before these tokens."""
        lp = CompletionLogprobs()
        for t, (v, top_ids, top_lps) in zip(ids, entries):
            p = self.piece(t)
            lp.tokens.append(p)
            lp.token_logprobs.append(v)
            lp.top_logprobs.append({self.piece(i): x for i, x in zip(top_ids, top_lps)})
            lp.text_offset.append(offset)
            offset += len(p)
        return lp
