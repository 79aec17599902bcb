"""Logprobs as OpenAI's responses carry them: chat's `content` list, completions' parallel
lists (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token is shown as the text it decodes to alone (as vLLM does), with its UTF-8 bytes in
chat; pieces are cached, as each appears in every response that lists it.
"""
from __future__ import annotations

from typing import Any

from serve_app.api.openai_protocol import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                                      TopLogprob)


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

    def echoed_prompt(self, ids: list[int], entries: list) -> CompletionLogprobs:
        """The prompt's part of completions' logprobs under `echo`: its first token has no
        logprob (None, as OpenAI lists it), the others their prompt-logprob entries
        (logprob, top ids, top logprobs, rank); offsets from 0."""
        lp = CompletionLogprobs()
        offset = 0
        for t, e in zip(ids, entries):
            p = self.piece(t)
            lp.tokens.append(p)
            lp.token_logprobs.append(None if e is None else e[0])
            lp.top_logprobs.append(None if e is None else {self.piece(i): x for i, x in zip(e[1], e[2])})
            lp.text_offset.append(offset)
            offset += len(p)
        return lp

    def prompt_logprobs(self, ids: list[int], entries: list, top: int) -> list:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob,
        rank, decoded_token}} for the token and its `top` most likely alternatives."""
        out: list = []
        for t, e in zip(ids, entries):
            if e is None:
                out.append(None)
                continue
            lp, top_ids, top_lps, rank = e
            d = {str(i): PromptLogprob(logprob=v, rank=r + 1, decoded_token=self.piece(i))
                 for r, (i, v) in enumerate(zip(top_ids[:top], top_lps[:top]))}
            d.setdefault(str(t), PromptLogprob(logprob=lp, rank=rank, decoded_token=self.piece(t)))
            out.append(d)
        return out
