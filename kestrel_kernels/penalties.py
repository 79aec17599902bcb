"""Logit processing before sampling: logit bias, min_tokens, and the repetition, frequency
and presence penalties, for plain rows and for the nodes of a speculative tree.

The order is vLLM's: the bias is added, stop ids are banned while a request has fewer than
min_tokens outputs, bad words' last tokens are banned where the tokens before them were
just emitted (on a tree node: emitted, then the node's path), then the penalties act on the counts of the ids emitted so far:
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

from kestrel_kernels.triton_available import use_triton
from kestrel_kernels.triton_penalties import penalize_triton


@dataclass
class Processing:
    """Per request (B rows), on the device, in fixed-width tables whose unused entries hold
    id -1 (so a CUDA graph sees the same shapes whatever the requests ask for)."""

    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32, 1 = off
    min_tokens: torch.Tensor  # [B] int64
    bias_token: torch.Tensor  # [B, M] int64, -1 = none
    bias_value: torch.Tensor  # [B, M] float32
    stop_token: torch.Tensor  # [B, S] int64, ids banned while under min_tokens, -1 = none
    # vLLM's bad_words as token sequences: word w of request b bans bad_last[b, w] wherever
    # the tokens before match bad_prefix[b, w] (right-aligned, -1 pads; -1 last: no word).
    bad_last: torch.Tensor  # [B, W] int64
    bad_prefix: torch.Tensor  # [B, W, P] int64


def _penalize(x: torch.Tensor, count: torch.Tensor, in_prompt: torch.Tensor | None,
              rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor) -> torch.Tensor:
    """Penalties on logits x given each entry's count (same shape; rep/freq/pres broadcast)."""
    seen = count > 0
    if in_prompt is not None:
        seen = seen | in_prompt
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    return x - freq * count - pres * (count > 0).to(x.dtype)


def _penalties(x: torch.Tensor, count: torch.Tensor, in_prompt: torch.Tensor | None,
               p: Processing) -> torch.Tensor:
    """`_penalize` on x [B, N, V] float32 with count [B, 1 or N, V] (any number type) and
    in_prompt the same shape in bool, or None; on CUDA the Triton kernel (one pass), which
    then computes every penalized logit of the GPU, tree nodes and plain rows alike."""
    if use_triton(x):
        return penalize_triton(x, count, in_prompt, p.repetition, p.frequency, p.presence)
    B = x.shape[0]
    return _penalize(x, count.to(x.dtype), in_prompt, p.repetition.view(B, 1, 1),
                     p.frequency.view(B, 1, 1), p.presence.view(B, 1, 1))


def node_context(tail: torch.Tensor, path_tokens: torch.Tensor | None,
                 path_mask: torch.Tensor | None, P: int) -> torch.Tensor:
    """The last P tokens before each node's prediction -> [B, N, P] int64 (-1 = none):
    the request's emitted tail [B, T] (-1 padded on the left), then, under speculation,
    the tokens on the node's path from the root's child down to the node itself."""
    B, T = tail.shape
    if path_mask is None:
        return tail[:, None, T - P:] if P <= T else torch.cat([tail.new_full((B, 1, P - T), -1), tail[:, None]], -1)
    N = path_mask.shape[1]
    depth = path_mask.sum(-1)  # [B, N] int64: path length of each node
    # ordered[b, i, q]: the token of i's path node at depth q + 1 (-1 past i's depth).
    level = (depth[:, None, :, None] == torch.arange(1, N + 1, device=tail.device)) & path_mask[..., None]
    ordered = torch.where(level.any(2), (level * path_tokens[:, None, :, None]).sum(2), -1)  # [B, N, N]
    m = torch.arange(P, 0, -1, device=tail.device)  # [P]: m-th token from the end
    from_path = m[None, None, :] <= depth[:, :, None]  # [B, N, P] bool
    pi = (depth[:, :, None] - m).clamp(min=0)
    ti = (T - (m - depth[:, :, None])).clamp(0, T - 1)
    on_tail = (m - depth[:, :, None]) <= T
    got_path = ordered.gather(2, pi.clamp(max=N - 1))
    got_tail = tail[:, None, :].expand(B, N, T).gather(2, ti)
    return torch.where(from_path, got_path, torch.where(on_tail, got_tail, -1))


def _add_at(x: torch.Tensor, ids: torch.Tensor, add: torch.Tensor) -> None:
    """In place on x [B, N, V] (contiguous): x[b, n, ids[b, e]] += add[b, e, n] for ids [B, E]
    (-1: none, adds nothing). A scatter-add (no sort, no host read: it runs inside CUDA
    graphs), so duplicate ids (padding, two words ending in one id) each add; unused entries
    add 0 to id 0, which changes no value, and no entry meets another nonzero one at the
    same place but -inf, so the order of the adds cannot change a result."""
    B, N, V = x.shape
    E = ids.shape[1]
    lane = (torch.arange(B, device=x.device)[:, None] * N + torch.arange(N, device=x.device)) * V  # [B, N]
    at = lane[:, None, :] + ids.clamp(min=0)[:, :, None]  # [B, E, N] int64 flat index into x
    used = (ids >= 0)[:, :, None]  # [B, E, 1] bool
    x.view(-1).scatter_add_(0, at.reshape(-1), torch.where(used, add, torch.zeros_like(add)).reshape(-1))


def _ban(x: torch.Tensor, ids: torch.Tensor, banned: torch.Tensor) -> None:
    """In place: -inf at ids [B, E] on the nodes where banned [B, E, N] (bool)."""
    inf = torch.full_like(banned, float("-inf"), dtype=x.dtype)
    _add_at(x, ids, torch.where(banned, inf, torch.zeros_like(inf)))


def apply_processing(logits: torch.Tensor, p: Processing, counts: torch.Tensor,
                     num_out: torch.Tensor, prompt_mask: torch.Tensor | None = None,
                     path_tokens: torch.Tensor | None = None,
                     path_mask: torch.Tensor | None = None,
                     tail: torch.Tensor | None = None) -> torch.Tensor:
    """Processed logits, a new tensor.

    Args:
        logits: [B, N, V] float32.
        counts: [B, V] integer, ids emitted so far per request.
        num_out: [B] int64, outputs so far (the index of the token node 0 predicts).
        prompt_mask: [B, V] bool, ids in each prompt (repetition penalty), or None.
        path_tokens: [B, N] int64 node tokens, path_mask [B, N, N] bool: node j is on the
            path of node i below the root (an ancestor or i itself, not the root), or None
            for plain rows (N = 1, no path).
        tail: [B, T] int64, each request's last T emitted ids (-1 before the first); read
            when p has bad-word columns (W > 0).
    """
    B, N, V = logits.shape
    x = logits.clone()
    if p.bias_token.shape[1]:
        _add_at(x, p.bias_token, p.bias_value[:, :, None].expand(*p.bias_token.shape, N).to(x.dtype))
    if p.stop_token.shape[1]:
        depth = path_mask.sum(-1) if path_mask is not None else torch.zeros_like(num_out)[:, None]
        early = (num_out[:, None] + depth) < p.min_tokens[:, None]  # [B, N] bool
        _ban(x, p.stop_token, early[:, None, :].expand(B, p.stop_token.shape[1], N))
    if p.bad_last.shape[1]:
        ctx = node_context(tail, path_tokens, path_mask, p.bad_prefix.shape[2])  # [B, N, P]
        pre = p.bad_prefix[:, :, None, :]  # [B, W, 1, P]
        _ban(x, p.bad_last, ((pre < 0) | (ctx[:, None] == pre)).all(-1))  # [B, W, N] bool
    raw = x  # biased and banned, not yet penalized
    pm = prompt_mask[:, None, :] if prompt_mask is not None else None
    out = _penalties(raw, counts[:, None, :], pm, p)  # [B, N, V]
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
    fixed = _penalties(raw[b, i, tok], base + on_path, in_prompt, p)  # [B, N, N], a new tensor
    out[b, i, tok] = fixed
    return out

