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


# Prompt positions whose logits are made at once: a 4096-token chunk's full logits would
# be ~800 MB of fp32 for a 49k vocabulary.
PROMPT_SLICE = 256


def prompt_logprobs(asked: list[int] | None, hidden: torch.Tensor, compute_logits,
                    input_ids: torch.Tensor, extend_lens: list[int], next_ids: list[int],
                    last_chunk: list[bool]) -> list | None:
    """A prefill chunk's prompt logprobs: position i of a chunk predicts the prompt token
    at i + 1 (the chunk's last position predicts the next chunk's first token, next_ids;
    on the last chunk it predicts the first output, which is not a prompt token).
    hidden [T, H] of the plan's tokens, input_ids [T] int64; per request in plan order,
    None or a list of (logprob, top ids, top logprobs, rank), raw logits (no processing)."""
    if asked is None:
        return None
    out: list = [None] * len(asked)
    start = 0
    for b, n in enumerate(extend_lens):
        k = asked[b]
        if k >= 0:
            targets = input_ids[start + 1:start + n]  # [n - 1] int64
            if not last_chunk[b]:
                targets = torch.cat([targets, targets.new_tensor([next_ids[b]])])
            entries = []
            for s in range(0, targets.numel(), PROMPT_SLICE):
                t = targets[s:s + PROMPT_SLICE]
                lp = torch.log_softmax(compute_logits(hidden[start + s:start + s + t.numel()]).float(), dim=-1)
                chosen = lp.gather(1, t[:, None])  # [m, 1] fp32
                rank = (lp > chosen).sum(-1) + 1  # [m] int64, 1 = the most likely
                top_lp, top_id = lp.topk(k, dim=-1) if k else (lp[:, :0], t[:, None][:, :0])
                entries += list(zip(chosen[:, 0].tolist(), top_id.tolist(), top_lp.tolist(), rank.tolist()))
            out[b] = entries
        start += n
    return out
