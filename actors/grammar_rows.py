"""Structured outputs on a rank: one grammar matcher per request row that has a grammar.

The front end compiles each grammar (serve_app/grammar.py, off the step loop) and the
scheduler ships it serialized when it admits the request, with the tokens the request
has emitted so far (a preempted one comes back with them). The matchers live here, beside
the logits, because under speculation the masks depend on the draft tree, which exists
only inside the step: each tree node's target logits are masked by the grammar state
after that node's path (xgrammar walks the tree, accepting and rolling back), so the
token verify accepts at a node is the one plain decoding would pick there. Draft tokens
the grammar forbids are never accepted, as the masked target never picks them.

Rows without a matcher are unconstrained. A matcher that has terminated (its stop token
accepted) masks nothing: the scheduler ends that request on the token, and a plan sent
before it learnt so may still hold the row.
"""
from __future__ import annotations

import logging

import torch

log = logging.getLogger("kestrel.grammar")


def _xgrammar():
    import xgrammar  # only a rank that serves a grammar needs it
    return xgrammar


class GrammarRows:
    def __init__(self):
        self.info = None  # xgrammar.TokenizerInfo, from the first plan that carries it
        self.matchers: dict[int, object] = {}  # row -> xgrammar.GrammarMatcher

    def set_vocab(self, vocab_json: str) -> None:
        self.info = _xgrammar().TokenizerInfo.deserialize_json(vocab_json)

    def reset(self, row: int, compiled: str | None, tokens) -> None:
        """Row `row` starts a request: its serialized compiled grammar (None: none) and the
        tokens it has emitted before (replayed into the fresh matcher)."""
        self.matchers.pop(row, None)
        if compiled is None:
            return
        if self.info is None:
            raise RuntimeError("a grammar arrived before the grammar vocabulary")
        xgr = _xgrammar()
        m = xgr.GrammarMatcher(xgr.CompiledGrammar.deserialize_json(compiled, self.info))
        for t in tokens:
            if not m.accept_token(int(t)):
                raise RuntimeError(f"row {row}: the grammar rejects its own earlier token {int(t)}")
        self.matchers[row] = m

    def any(self, rows: list[int]) -> bool:
        return bool(self.matchers) and any(r in self.matchers for r in rows)

    def _live(self, row: int):
        m = self.matchers.get(row)
        return None if m is None or m.is_terminated() else m

    def next_masks(self, rows: list[int], device: torch.device) -> torch.Tensor | None:
        """The next token's bitmask per row -> [B, W] int32 on `device` (all ones for rows
        without a live grammar), or None when no row has one."""
        if not self.any(rows):
            return None
        xgr = _xgrammar()
        masks = xgr.allocate_token_bitmask(len(rows), self.info.vocab_size)  # [B, W] int32, all ones
        for i, row in enumerate(rows):
            m = self._live(row)
            if m is not None:
                m.fill_next_token_bitmask(masks, i)
        return masks.to(device)

    def copy_tree(self, rows: list[int], tokens: torch.Tensor, first_child: torch.Tensor,
                  next_sibling: torch.Tensor):
        """Start moving the tree of the rows with a live grammar to the host (tokens /
        first_child / next_sibling [B, N] int64; node 0 is the root: the request's last
        emitted token, which its matcher has accepted), or None when no row has one. The
        copy is queued behind the draft, so the walk (tree_masks) can run on the host
        while the target's verify forward runs on the device."""
        if not self.any(rows):
            return None
        idx = [i for i, row in enumerate(rows) if self._live(row) is not None]
        sel = torch.tensor(idx, dtype=torch.int64, device=tokens.device)
        stacked = torch.stack([tokens[sel], first_child[sel], next_sibling[sel]])  # [3, b, N] int64
        if stacked.is_cuda:
            host = torch.empty(stacked.shape, dtype=stacked.dtype, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host, done = stacked, None
        return rows, idx, tokens.shape, host, done, tokens.device

    def tree_masks(self, copied) -> torch.Tensor | None:
        """Per tree node, the bitmask of the token after the node's path -> [B, N, W]
        int32 on the device (copy_tree's handle; None -> None). Nodes the walk does not
        reach (a forbidden token on their path) stay all ones: verify never accepts them."""
        if copied is None:
            return None
        rows, idx, (B, N), host, done, device = copied
        if done is not None:
            done.synchronize()
        masks = _xgrammar().allocate_token_bitmask(B * N, self.info.vocab_size).view(B, N, -1)  # int32
        for j, i in enumerate(idx):
            self._live(rows[i]).traverse_draft_tree(host[1, j], host[2, j], host[0, j], masks[i])
        return masks.to(device, non_blocking=True)

    def advance(self, rows: list[int], emitted: list[list[int]]) -> None:
        """The tokens each row emitted this step, in order."""
        if not self.matchers:
            return
        for row, toks in zip(rows, emitted):
            m = self.matchers.get(row)
            for t in toks:
                if m is None or m.is_terminated():
                    break
                if not m.accept_token(t):
                    log.error("row %d: the grammar rejected emitted token %d; unconstrained from here", row, t)
                    del self.matchers[row]
                    break
