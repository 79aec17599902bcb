"""Log-probabilities of emitted tokens and the most likely alternatives (OpenAI `logprobs`).

Taken from the target's logits after the request's logit processing (bias, min_tokens,
penalties) and before temperature, min-p, top-k and top-p: the model's distribution as
the request shaped it, the same whether a token came from plain decoding or was accepted
from a speculative tree (at the node that predicted it).
"""
from __future__ import annotations

import torch

# Per emitted token: (its logprob, the top ids, their logprobs), as plain lists.
TokenLogprob = tuple[float, list[int], list[float]]


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """logits [M, V] float, tokens [M] int64 -> one entry per row, `top` alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [M, V] float32
    chosen = lp.gather(1, tokens.to(torch.int64)[:, None])[:, 0].tolist()
    if top == 0:
        return [(c, [], []) for c in chosen]
    top_lp, top_id = lp.topk(top, dim=-1)  # [M, top]
    return list(zip(chosen, top_id.tolist(), top_lp.tolist()))


def plan_logprobs(asked: list[int] | None, logits: torch.Tensor, tokens: torch.Tensor,
                  emitted: list[bool]) -> list[list[TokenLogprob] | None] | None:
    """One token per request (prefill, plain decode): per request in plan order, None or
    its token's entry. `asked[b]` is the request's top count (-1: no logprobs)."""
    if asked is None:
        return None
    want = [b for b, k in enumerate(asked) if k >= 0 and emitted[b]]
    out: list[list[TokenLogprob] | None] = [None] * len(asked)
    if not want:
        return out
    idx = torch.tensor(want, dtype=torch.int64, device=logits.device)
    entries = token_logprobs(logits[idx], tokens[idx], max(asked[b] for b in want))
    for b, (c, ids, lps) in zip(want, entries):
        out[b] = [(c, ids[:asked[b]], lps[:asked[b]])]
    return out


def tree_logprobs(asked: list[int] | None, logits: torch.Tensor, accept_index: torch.Tensor,
                  predict: torch.Tensor, accept_lens: list[int]) -> list[list[TokenLogprob] | None] | None:
    """A speculative iteration: logits [B, N, V] of the tree nodes, accept_index and
    predict [B, S+1]; emitted token j of request b was predicted at node accept_index[b, j]."""
    if asked is None:
        return None
    want = [b for b, k in enumerate(asked) if k >= 0]
    out: list[list[TokenLogprob] | None] = [[] if k >= 0 else None for k in asked]
    if not want:
        return out
    pairs = [(b, j) for b in want for j in range(accept_lens[b])]
    bi = torch.tensor([b for b, _ in pairs], dtype=torch.int64, device=logits.device)
    ji = torch.tensor([j for _, j in pairs], dtype=torch.int64, device=logits.device)
    nodes = accept_index[bi, ji]  # [P] int64
    entries = token_logprobs(logits[bi, nodes], predict[bi, ji], max(asked[b] for b in want))
    for (b, _), (c, ids, lps) in zip(pairs, entries):
        out[b].append((c, ids[:asked[b]], lps[:asked[b]]))
    return out
