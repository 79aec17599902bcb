"""Logit processing before sampling: logit bias, min_tokens, and the repetition, frequency
and presence penalties, for plain rows and for the nodes of a speculative tree.

The order is vLLM's: the bias is added, stop ids are banned while a request has fewer than
min_tokens outputs, then the penalties act on the counts of the ids emitted so far:
repetition (HF's: a seen id's logit divided by r when positive, multiplied by it when
not; "seen" includes the prompt), then frequency (minus f x count) and presence (minus p
if count > 0), as OpenAI defines them.

Under speculation the logits at tree node i predict the token after i, so the counts
there are the request's emitted counts plus the ids on the path from the root's child
down to i, and the output index is the request's output count plus i's depth. Processing
each node with its own path's counts makes the verify step choose, at every accepted
node, exactly what plain decoding with the same processing would have chosen (and, when
sampling, from the same distribution). The counts differ from the emitted ones only at the
ids on the path (at most depth many), so the nodes are processed with the emitted counts
first and those few entries then recomputed from their unprocessed values.

Shapes: B requests, N nodes per request (1 for plain rows), V vocabulary.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Processing:
    """Per request (B rows), on the device."""

    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32, 1 = off
    min_tokens: torch.Tensor  # [B] int64
    bias_index: torch.Tensor  # [M] int64, request b of each (b, token) bias entry
    bias_token: torch.Tensor  # [M] int64
    bias_value: torch.Tensor  # [M] float32
    stop_index: torch.Tensor  # [S] int64, request of each (b, stop id) banned under min_tokens
    stop_token: torch.Tensor  # [S] int64


def _penalize(x: torch.Tensor, count: torch.Tensor, in_prompt: torch.Tensor | None,
              rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor) -> torch.Tensor:
    """Penalties on logits x given each entry's count (same shape; rep/freq/pres broadcast)."""
    seen = count > 0
    if in_prompt is not None:
        seen = seen | in_prompt
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * count - pres * (count > 0).to(x.dtype)


def apply_processing(logits: torch.Tensor, p: Processing, counts: torch.Tensor,
                     num_out: torch.Tensor, prompt_mask: torch.Tensor | None = None,
                     path_tokens: torch.Tensor | None = None,
                     path_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits, a new tensor.

    Args:
        logits: [B, N, V] float32.
        counts: [B, V] integer, ids emitted so far per request.
        num_out: [B] int64, outputs so far (the index of the token node 0 predicts).
        prompt_mask: [B, V] bool, ids in each prompt (repetition penalty), or None.
        path_tokens: [B, N] int64 node tokens, path_mask [B, N, N] bool: node j is on the
            path of node i below the root (an ancestor or i itself, not the root), or None
            for plain rows (N = 1, no path).
    """
    B, N, V = logits.shape
    x = logits.clone()
    if p.bias_index.numel():
        x[p.bias_index, :, p.bias_token] += p.bias_value[:, None]
    if p.stop_index.numel():
        depth = path_mask.sum(-1) if path_mask is not None else 0  # [B, N] outputs along the path
        early = (num_out[:, None] + depth) < p.min_tokens[:, None]  # [B, N] bool
        banned = early[p.stop_index]  # [S, N] bool
        cur = x[p.stop_index, :, p.stop_token]  # [S, N]
        x[p.stop_index, :, p.stop_token] = torch.where(banned, torch.full_like(cur, float("-inf")), cur)
    rep = p.repetition.view(B, 1, 1)
    freq = p.frequency.view(B, 1, 1)
    pres = p.presence.view(B, 1, 1)
    raw = x  # biased and banned, not yet penalized
    c = counts.to(x.dtype)[:, None, :]  # [B, 1, V]
    pm = prompt_mask[:, None, :] if prompt_mask is not None else None
    out = _penalize(raw, c, pm, rep, freq, pres)  # [B, N, V]
    if path_mask is None:
        return out
    # Entries of ids on a node's path: recompute with the path's counts added. For the pair
    # (i, j) the id is node j's token and its count at i is the emitted count plus how often
    # it occurs on i's path; any j gives the right value for its id, so every pair writes.
    tok = path_tokens[:, None, :].expand(B, N, N)  # [B, N(i), N(j)] int64
    same = path_tokens[:, :, None] == path_tokens[:, None, :]  # [B, N(j'), N(j)] bool
    on_path = torch.bmm(path_mask.float(), same.float())  # [B, N(i), N(j)] float32, exact counts
    b = torch.arange(B, device=x.device)[:, None, None].expand(B, N, N)
    i = torch.arange(N, device=x.device)[None, :, None].expand(B, N, N)
    base = counts.gather(1, path_tokens).to(x.dtype)[:, None, :]  # [B, 1, N(j)]
    in_prompt = prompt_mask.gather(1, path_tokens)[:, None, :] if prompt_mask is not None else None
    fixed = _penalize(raw[b, i, tok], base + on_path, in_prompt, rep, freq, pres)
    out[b, i, tok] = fixed
    return out

