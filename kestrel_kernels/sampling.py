"""Sampling ops: logits -> processed probabilities, and inverse-CDF sampling.

Pure-torch references (the CPU path and the test oracle for later Triton kernels).
Shapes: T rows (tokens / tree nodes), V vocabulary. Token tensors are int64.

Nothing here reads a device value on the host: what depends on the data is computed for
every row and selected with torch.where, and what the host knows (whether any row
truncates its distribution) comes in as a Python flag. A host read would wait for the
device inside the step's launch, which defeats launching step N+1 while step N runs
(actors/worker/step_channel.py), and could not be recorded in a CUDA graph. Each row's result
depends on that row alone, not on what else is in the batch.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import use_triton
from kestrel_kernels.triton_top_p import top_k_top_p_triton

__all__ = ["process_logits", "sample_from_probs", "sample_rows", "min_p_filter"]


def process_logits(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    min_p: torch.Tensor | None = None,
    *,
    filtered: bool = True,
) -> torch.Tensor:
    """Turn raw logits into the sampling distribution of each row.

    Args:
        logits: [T, V] float (any float dtype).
        temperature: [T] float. Rows with temperature <= 0 are greedy: they come back as
            a one-hot of the (first) argmax, never NaN.
        top_p: [T] float in (0, 1]. Nucleus: keep the smallest set of most likely tokens
            whose cumulative probability is >= top_p; the most likely token is always
            kept; top_p >= 1 keeps everything.
        top_k: [T] int64. Keep the top_k most likely tokens; top_k <= 0 means no limit.
        min_p: [T] float or None (= 0 everywhere). Keep tokens with at least min_p times
            the row's largest probability (0 = off).
        filtered: False when the caller knows that no row truncates (top_k <= 0, top_p
            >= 1 and min_p 0 everywhere): the truncation, and its [T, V] sort, the bulk
            of the cost, is skipped. Either way a row that does not truncate comes back
            as its plain softmax, bit for bit.

    Order (as in HF warpers, min-p as vLLM places it): softmax(logits / temperature), then
    min-p, renormalise, then top-k, renormalise, then top-p on the renormalised top-k
    distribution, renormalise. Ties in probability are ranked toward the lower token id
    (stable sort).

    Returns:
        probs: [T, V] float32, every row sums to 1.
    """
    T, V = logits.shape
    greedy = temperature <= 0  # [T] bool
    safe_t = torch.where(greedy, torch.ones_like(temperature), temperature).float()  # [T] float32
    probs = torch.softmax(logits.float() / safe_t[:, None], dim=-1)  # [T, V] float32
    out = probs
    # Each step applies to the rows that ask for it only: the others keep their values
    # exactly (a renormalisation would round them differently).
    if filtered and min_p is not None:
        kept = min_p_filter(probs, min_p.float())  # [T, V] float32
        out = torch.where((min_p > 0)[:, None], kept / kept.sum(dim=-1, keepdim=True), out)
    if filtered:
        ranked = (top_k > 0) | (top_p < 1.0)  # [T] bool
        out = torch.where(ranked[:, None], _top_k_top_p(out, top_p, top_k), out)  # [T, V] float32
    one_hot = torch.zeros((T, V), dtype=torch.float32, device=logits.device)  # [T, V] float32
    one_hot.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, out)


def _top_k_top_p(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """probs [T, V] float32 -> the renormalised top-k, then top-p, distribution [T, V] float32.
    On CUDA the sort-free Triton kernel (kestrel_kernels/triton_top_p.py), else this reference."""
    if use_triton(probs):
        return top_k_top_p_triton(probs, top_p, top_k)
    return top_k_top_p_ref(probs, top_p, top_k)


def top_k_top_p_ref(probs: torch.Tensor, top_p: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """The reference of `_top_k_top_p`: rank by a stable sort, ties to the lower id."""
    T, V = probs.shape
    device = probs.device
    # Rank tokens once; both filters act on ranks.
    sorted_p, sorted_idx = torch.sort(probs, dim=-1, descending=True, stable=True)  # [T, V] f32, [T, V] i64
    rank = torch.arange(V, device=device, dtype=torch.int64)[None, :]  # [1, V] int64

    k = top_k.to(torch.int64)[:, None]  # [T, 1] int64
    keep_sorted = (k <= 0) | (rank < k)  # [T, V] bool
    sorted_p = torch.where(keep_sorted, sorted_p, torch.zeros_like(sorted_p))  # [T, V] float32
    sorted_p = sorted_p / sorted_p.sum(dim=-1, keepdim=True)  # renormalised top-k, [T, V] float32

    # Nucleus: keep token r iff the mass strictly before it is still < top_p.
    cum_before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # [T, V] float32 (exclusive cumsum)
    tp = top_p.float()[:, None]  # [T, 1] float32
    keep_p = (cum_before < tp) | (tp >= 1.0) | (rank == 0)  # [T, V] bool
    keep_sorted = keep_sorted & keep_p  # [T, V] bool

    keep = torch.zeros((T, V), dtype=torch.bool, device=device)  # [T, V] bool, token order
    keep.scatter_(1, sorted_idx, keep_sorted)
    out = torch.where(keep, probs, torch.zeros_like(probs))  # [T, V] float32
    return out / out.sum(dim=-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, coins: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling, one token per row.

    Args:
        probs: [T, V] float, non-negative, need not be normalised.
        coins: [T] float in [0, 1).

    Returns:
        tokens: [T] int64, the first index i with cumsum(probs)[i] > coin * total.
        A zero-probability token is never returned (if rounding pushes the threshold
        past the end, the last token with positive probability is returned). An all-zero
        row returns V - 1 (undefined input).
    """
    T, V = probs.shape
    cdf = torch.cumsum(probs.double(), dim=-1)  # [T, V] float64
    total = cdf[:, -1]  # [T] float64
    threshold = (coins.double() * total)[:, None].contiguous()  # [T, 1] float64
    idx = torch.searchsorted(cdf, threshold, right=True).squeeze(1)  # [T] int64
    over = idx >= V  # [T] bool: rounding pushed the threshold past the end (rare)
    positive = probs > 0  # [T, V] bool
    last_pos = (V - 1) - torch.flip(positive, dims=[1]).to(torch.int64).argmax(dim=-1)  # [T] int64
    return torch.where(over, last_pos, idx).to(torch.int64)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor,
                top_k: torch.Tensor, min_p: torch.Tensor | None, coins: torch.Tensor, *,
                filtered: bool = True) -> torch.Tensor:
    """One token per row of logits [T, V]: greedy rows (temperature [T] <= 0) their argmax,
    the others inverse-CDF on their process_logits distribution with their coin [T] ->
    tokens [T] int64. The same tokens as sampling the sampled rows alone."""
    probs = process_logits(logits, temperature, top_p, top_k, min_p, filtered=filtered)  # [T, V] float32
    return torch.where(temperature > 0, sample_from_probs(probs, coins), logits.argmax(dim=-1))


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Keep the ids whose probability is at least min_p x the row's largest: probs [T, V]
    float32, min_p [T] float32 (0 = off) -> unnormalised [T, V] float32."""
    top = probs.max(dim=-1, keepdim=True).values  # [T, 1]
    return torch.where(probs >= min_p[:, None] * top, probs, torch.zeros_like(probs))
