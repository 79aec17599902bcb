"""Attention for training a draft head: plain causal attention for the target's and the
head's step 0, and the training-time-test (TTT) attention across the head's unrolled steps.

Step n (n >= 1) of the unrolled head at chain p attends to the step-0 keys at positions
<= p (what draft extend left in the draft KV cache) and to the keys of steps 1..n at the
same chain p (its ancestors in the draft tree, and itself). As one mask over every step's
keys that is [T, (n+1)T] = [tril | I | ... | I]: `ttt_attention_dense` computes it that way
and is the reference. `TTTAttention` computes only what the mask lets through: the causal
[T, T] block and n scores on the diagonal per query, one softmax over both, so a step's
cost no longer grows with n (the dense mask's work at step 7 is 8x step 0's).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, L, D] -> [B, Hkv*groups, L, D]: query head h reads kv head h // groups (HF)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _heads(x: torch.Tensor, B: int, T: int, groups: int = 1) -> torch.Tensor:
    """[B*T, H, D] -> [B, H*groups, T, D]."""
    return _expand_kv(x.view(B, T, x.shape[1], x.shape[2]).transpose(1, 2), groups)


class CausalAttention:
    """Dense causal attention over B right-padded rows of T tokens, flattened to [B*T].
    Padding sits after each row's tokens, so causality alone keeps it out of their view."""

    def __init__(self, B: int, T: int):
        self.B, self.T = B, T

    def __call__(self, q, k, v, layer_id):
        B, T, Hq, D = self.B, self.T, q.shape[1], q.shape[2]
        g = Hq // k.shape[1]
        o = F.scaled_dot_product_attention(_heads(q, B, T), _heads(k, B, T, g), _heads(v, B, T, g),
                                           is_causal=True)  # [B, Hq, T, D]
        return o.transpose(1, 2).reshape(B * T, Hq, D)


def ttt_attention_dense(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """Reference: q [B, H, T, D] of step n = len(keys) - 1 over every step's keys and values
    (each [B, H, T, D]) under the mask [tril | I | ... | I] -> [B, H, T, D]."""
    T, n = q.shape[2], len(keys) - 1
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=q.device)
    mask = torch.cat([causal] + [eye] * n, dim=1)  # [T, (n+1)T] bool
    return F.scaled_dot_product_attention(q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask)


def ttt_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]) -> torch.Tensor:
    """The same as `ttt_attention_dense`, computing only the causal block and the diagonals."""
    if len(keys) == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
    T = q.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ keys[0].transpose(-1, -2)).mul_(scale).masked_fill_(~causal, float("-inf"))  # [B, H, T, T]
    later_k = torch.stack(keys[1:], 3)  # [B, H, T, n, D]
    later_v = torch.stack(values[1:], 3)  # [B, H, T, n, D]
    sd = (q.unsqueeze(3) * later_k).sum(-1).mul_(scale)  # [B, H, T, n]: each query's own chain
    w = torch.softmax(torch.cat([s0, sd], -1), -1, dtype=torch.float32).to(q.dtype)  # [B, H, T, T+n]
    return w[..., :T] @ values[0] + (w[..., T:].unsqueeze(-1) * later_v).sum(3)


class TTTAttention:
    """The head's attention across unrolled steps (one instance per training batch): call n
    is TTT step n; every step's keys and values are kept for the steps after it."""

    def __init__(self, B: int, T: int, attend=ttt_attention):
        self.B, self.T, self.attend = B, T, attend
        self.keys: list[torch.Tensor] = []  # per step [B, Hq, T, D]
        self.values: list[torch.Tensor] = []

    def __call__(self, q, k, v, layer_id):
        B, T, Hq, D = self.B, self.T, q.shape[1], q.shape[2]
        g = Hq // k.shape[1]
        self.keys.append(_heads(k, B, T, g))
        self.values.append(_heads(v, B, T, g))
        o = self.attend(_heads(q, B, T), self.keys, self.values)  # [B, Hq, T, D]
        return o.transpose(1, 2).reshape(B * T, Hq, D)
