"""Log-probabilities of emitted tokens and the most likely alternatives (OpenAI `logprobs`).

Taken from the target's logits after the request's logit processing (bias, min_tokens,
penalties) and before temperature, min-p, top-k and top-p: the model's distribution as
the request shaped it, the same whether a token came from plain decoding or was accepted
from a speculative tree (at the node that predicted it). Computed on the device inside
the step and copied to the host with its tokens (one HostCopy), then turned into lists
when the step finishes: nothing in the step waits for the device.
"""
from __future__ import annotations

import torch

# Per emitted token: (its logprob, the top ids, their logprobs), as plain lists.
TokenLogprob = tuple[float, list[int], list[float]]
# The most alternatives a request may ask for (OpenAI's top_logprobs bound): what the step
# graph computes (actors/spec/step_graph.py); a plan asking more runs eagerly.
MAX_TOP = 20


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int):
    """logits [M, V] float, tokens [M] int64 -> (chosen [M] float32, top logprobs [M, top]
    float32, top ids [M, top] int64), on the device."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [M, V] float32
    chosen = lp.gather(1, tokens.to(torch.int64)[:, None])[:, 0]  # [M] float32
    top_lp, top_id = lp.topk(top, dim=-1)  # [M, top] float32, int64
    return chosen, top_lp, top_id


def node_logprobs(logits: torch.Tensor, accept_index: torch.Tensor, predict: torch.Tensor, top: int):
    """A speculative iteration: logits [B, N, V] of the tree nodes, accept_index and predict
    [B, A]; emitted token j of request b was predicted at node accept_index[b, j] (-1 past
    the accepted ones, whose values are never read) -> ([B, A], [B, A, top], [B, A, top])."""
    B, N, V = logits.shape
    A = accept_index.shape[1]
    at = logits.gather(1, accept_index.clamp(min=0)[:, :, None].expand(B, A, V))  # [B, A, V]
    chosen, top_lp, top_id = top_logprobs(at.reshape(B * A, V), predict.clamp(min=0).reshape(-1), top)
    return chosen.view(B, A), top_lp.view(B, A, top), top_id.view(B, A, top)


def asked_top(asked: list[int]) -> int:
    """The alternatives a plan's logprobs need: the most any request asks."""
    return max(k for k in asked if k >= 0)


def logprob_lists(asked: list[int], chosen: torch.Tensor, top_lp: torch.Tensor, top_id: torch.Tensor,
                  emitted: list[int]) -> list[list[TokenLogprob] | None]:
    """On the host, after the step: chosen [B, A], top_lp / top_id [B, A, k] -> per request in
    plan order, None (not asked) or one entry per emitted token (the first emitted[b])."""
    out: list[list[TokenLogprob] | None] = [None] * len(asked)
    want = [b for b, k in enumerate(asked) if k >= 0]
    k = asked_top(asked)  # the step graph computes MAX_TOP: convert only what is asked
    c, lps, ids = chosen[want].tolist(), top_lp[want, :, :k].tolist(), top_id[want, :, :k].tolist()
    for i, b in enumerate(want):
        k = asked[b]
        out[b] = [(c[i][j], ids[i][j][:k], lps[i][j][:k]) for j in range(emitted[b])]
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
