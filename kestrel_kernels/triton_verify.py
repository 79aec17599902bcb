"""Triton kernels for `kestrel_kernels.verify.greedy_verify` and `kestrel_kernels.verify.tree_sampling_verify`.

The torch references are the functions of the same name in kestrel_kernels/verify.py; these
produce the same accept_index / accept_length / predict (int64). One program per request
walks its tree with scalar loops (a walk is inherently sequential and at most S levels x
N siblings long) and keeps its output rows in registers, writing each once at the end;
nothing is read on the host, so both calls can be captured in a CUDA graph.

Sampling keeps the reference's arithmetic: probabilities are read as float64, a child is
accepted iff coin * total < q(t) (or q(t) holds all the remaining mass), rejected tokens
leave the residual, and the bonus is the first token whose float64 CDF exceeds
coin * total. The working row is never materialised: q is the target row of the current
node minus the tokens rejected there (at most N-1, kept in registers), and total is the
row's sum minus the rejected probabilities. Float64 sums are exact whenever the row's
nonzero probabilities span fewer than ~29 binades (then every decision is bit-identical
to the reference); otherwise the summation order differs from torch's, and a decision
can differ only when a coin lands within float64 rounding (~1e-16 relative) of its
threshold.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "greedy_verify_triton", "tree_sampling_verify_triton"]

_MAX_BLOCK_V = 2048  # vocabulary entries per chunk of a pass over one target row


if HAS_TRITON:

    @triton.jit
    def _store_result(AcceptIndex, AcceptLength, Predict, b, S, offs, acc_index, predict,
                      length, bonus):
        """Request b's outputs: the bonus token after the last accepted node, then row b of
        accept_index / predict ([S+1] lanes) and its accept length."""
        predict = tl.where(offs == length - 1, bonus, predict)
        out = b * (S + 1) + offs
        ok = offs < S + 1
        tl.store(AcceptIndex + out, acc_index, mask=ok)
        tl.store(Predict + out, predict, mask=ok)
        tl.store(AcceptLength + b, length)

    @triton.jit
    def _greedy_verify_kernel(
        TreeTokens, TargetPredict, FirstChild, NextSibling,
        AcceptIndex, AcceptLength, Predict,
        N, S, BLOCK_S: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        row = b * N
        offs = tl.arange(0, BLOCK_S)
        acc_index = tl.where(offs == 0, 0, -1).to(tl.int64)  # [S+1] padded
        predict = tl.full((BLOCK_S,), -1, dtype=tl.int64)
        cur = tl.zeros((), dtype=tl.int64)  # last accepted node
        length = tl.full((), 1, dtype=tl.int64)
        active = tl.full((), 1, dtype=tl.int1)
        d = tl.full((), 1, dtype=tl.int64)
        while active & (d <= S):  # loop over tree depth
            want = tl.load(TargetPredict + row + cur).to(tl.int64)
            child = tl.load(FirstChild + row + cur).to(tl.int64)
            found = tl.full((), -1, dtype=tl.int64)
            steps = tl.zeros((), dtype=tl.int64)
            while (child >= 0) & (steps < N):  # sibling scan, as bounded as the reference's
                match = tl.load(TreeTokens + row + child).to(tl.int64) == want
                found = tl.where(match, child, found)
                nxt = tl.load(NextSibling + row + child).to(tl.int64)
                child = tl.where(match, -1, nxt)
                steps += 1
            active = found >= 0
            acc_index = tl.where(active & (offs == d), found, acc_index)
            predict = tl.where(active & (offs == d - 1), want, predict)
            length += active.to(tl.int64)
            cur = tl.where(active, found, cur)
            d += 1
        bonus = tl.load(TargetPredict + row + cur).to(tl.int64)
        _store_result(AcceptIndex, AcceptLength, Predict, b, S, offs, acc_index, predict,
                      length, bonus)

    @triton.jit
    def _residual_chunk(ProbRow, lo, V, rejected, n_rejected,
                        BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr):
        """q[lo:lo+BLOCK_V] as float64: the row with the rejected tokens zeroed, 0 past V."""
        offs = lo + tl.arange(0, BLOCK_V).to(tl.int64)
        x = tl.load(ProbRow + offs, mask=offs < V, other=0.0).to(tl.float64)
        hit = (rejected >= lo) & (rejected < lo + BLOCK_V)
        if tl.sum(hit.to(tl.int32), axis=0) > 0:  # rare: only chunks holding a rejected token
            slots = tl.arange(0, BLOCK_N)
            for r in range(n_rejected):
                tok = tl.sum(tl.where(slots == r, rejected, 0), axis=0)
                x = tl.where(offs == tok, 0.0, x)
        return offs, x

    @triton.jit
    def _chunk_total(x, BLOCK_V: tl.constexpr):
        """Last element of the chunk's inclusive cumsum: the same rounding as the CDF pass."""
        cs = tl.cumsum(x, axis=0)
        return cs, tl.sum(tl.where(tl.arange(0, BLOCK_V) == BLOCK_V - 1, cs, 0.0), axis=0)

    @triton.jit
    def _residual_total(ProbRow, V, rejected, n_rejected,
                        BLOCK_V: tl.constexpr, BLOCK_N: tl.constexpr):
        """Sum of the residual row (float64) and its last positive token (V-1 if none)."""
        total = tl.zeros((), dtype=tl.float64)
        last_pos = tl.full((), -1, dtype=tl.int64)
        for lo in range(0, V, BLOCK_V):  # loop over vocabulary chunks
            offs, x = _residual_chunk(ProbRow, lo, V, rejected, n_rejected, BLOCK_V, BLOCK_N)
            _, part = _chunk_total(x, BLOCK_V)
            total += part
            last_pos = tl.maximum(last_pos, tl.max(tl.where(x > 0, offs, -1), axis=0))
        return total, tl.where(last_pos >= 0, last_pos, V - 1)

    @triton.jit
    def _tree_sampling_verify_kernel(
        TreeTokens, Probs, FirstChild, NextSibling, NodeCoins, FinalCoins,
        AcceptIndex, AcceptLength, Predict,
        N, V, S, stride_pb, stride_pn,
        BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        row = b * N
        probs = Probs + b * stride_pb
        offs = tl.arange(0, BLOCK_S)
        slots = tl.arange(0, BLOCK_N)
        acc_index = tl.where(offs == 0, 0, -1).to(tl.int64)  # [S+1] padded
        predict = tl.full((BLOCK_S,), -1, dtype=tl.int64)
        rejected = tl.full((BLOCK_N,), -1, dtype=tl.int64)  # tokens rejected at `cur`
        n_rejected = tl.zeros((), dtype=tl.int64)
        cur = tl.zeros((), dtype=tl.int64)
        length = tl.full((), 1, dtype=tl.int64)
        active = tl.full((), 1, dtype=tl.int1)
        d = tl.full((), 1, dtype=tl.int64)
        while active & (d <= S):  # loop over tree depth
            child = tl.load(FirstChild + row + cur).to(tl.int64)
            found = tl.full((), -1, dtype=tl.int64)
            total = tl.zeros((), dtype=tl.float64)
            if child >= 0:  # a leaf needs no total
                total = _residual_total(probs + cur * stride_pn, V, rejected, n_rejected,
                                        BLOCK_V, BLOCK_N)[0]
            steps = tl.zeros((), dtype=tl.int64)
            while (child >= 0) & (steps < N):  # sibling scan, as bounded as the reference's
                tok = tl.load(TreeTokens + row + child).to(tl.int64)
                q_tok = tl.load(probs + cur * stride_pn + tok).to(tl.float64)
                seen = tl.sum((rejected == tok).to(tl.int32), axis=0) > 0
                q_tok = tl.where(seen, 0.0, q_tok)  # a repeated token was zeroed already
                coin = tl.load(NodeCoins + row + child).to(tl.float64)
                accept = (q_tok > 0) & ((coin * total < q_tok) | (q_tok >= total))
                reject = accept == 0
                found = tl.where(accept, child, found)
                rejected = tl.where((slots == n_rejected) & reject, tok, rejected)
                n_rejected += reject.to(tl.int64)
                total -= tl.where(accept, 0.0, q_tok)
                nxt = tl.load(NextSibling + row + child).to(tl.int64)
                child = tl.where(accept, -1, nxt)
                steps += 1
            active = found >= 0
            if active:  # the accepted child's row starts with nothing rejected
                rejected = tl.full((BLOCK_N,), -1, dtype=tl.int64)
                n_rejected = tl.zeros((), dtype=tl.int64)
            ftok = tl.load(TreeTokens + row + found, mask=active, other=-1).to(tl.int64)
            acc_index = tl.where(active & (offs == d), found, acc_index)
            predict = tl.where(active & (offs == d - 1), ftok, predict)
            length += active.to(tl.int64)
            cur = tl.where(active, found, cur)
            d += 1

        # Bonus: inverse CDF of the residual at `cur` (first CDF entry > coin * total).
        prow = probs + cur * stride_pn
        total, last_pos = _residual_total(prow, V, rejected, n_rejected, BLOCK_V, BLOCK_N)
        threshold = tl.load(FinalCoins + b).to(tl.float64) * total
        bonus = tl.full((), -1, dtype=tl.int64)
        cdf_base = tl.zeros((), dtype=tl.float64)
        lo = tl.zeros((), dtype=tl.int64)
        while (bonus < 0) & (lo < V):  # loop over vocabulary chunks until the CDF crosses
            voffs, x = _residual_chunk(prow, lo, V, rejected, n_rejected, BLOCK_V, BLOCK_N)
            cs, part = _chunk_total(x, BLOCK_V)
            crossed = ((cdf_base + cs) > threshold) & (voffs < V)
            first = tl.min(tl.where(crossed, voffs, V), axis=0)
            bonus = tl.where(first < V, first, -1)
            cdf_base += part
            lo += BLOCK_V
        bonus = tl.where(bonus >= 0, bonus, last_pos)  # rounding pushed the threshold past the end
        _store_result(AcceptIndex, AcceptLength, Predict, b, S, offs, acc_index, predict,
                      length, bonus)


def _outputs(B: int, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    accept_index = torch.empty((B, S + 1), dtype=torch.int64, device=device)  # [B, S+1] int64
    accept_length = torch.empty((B,), dtype=torch.int64, device=device)  # [B] int64
    predict = torch.empty((B, S + 1), dtype=torch.int64, device=device)  # [B, S+1] int64
    return accept_index, accept_length, predict


def greedy_verify_triton(
    tree_tokens: torch.Tensor,
    target_predict: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `greedy_verify`; same arguments and results."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.verify.greedy_verify")
    B, N = tree_tokens.shape
    accept_index, accept_length, predict = _outputs(B, max_depth, tree_tokens.device)
    if B == 0:
        return accept_index, accept_length, predict
    _greedy_verify_kernel[(B,)](
        tree_tokens.contiguous(), target_predict.contiguous(), first_child.contiguous(),
        next_sibling.contiguous(), accept_index, accept_length, predict,
        N, max_depth, BLOCK_S=triton.next_power_of_2(max_depth + 1), num_warps=1,
    )
    return accept_index, accept_length, predict


def tree_sampling_verify_triton(
    tree_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    max_depth: int,
    node_coins: torch.Tensor,
    final_coins: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `tree_sampling_verify`; same arguments and results (see the module docstring
    for when an accept decision can differ from the reference's)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.verify.tree_sampling_verify")
    B, N = tree_tokens.shape
    V = target_probs.shape[-1]
    accept_index, accept_length, predict = _outputs(B, max_depth, tree_tokens.device)
    if B == 0:
        return accept_index, accept_length, predict
    if target_probs.stride(-1) != 1:
        target_probs = target_probs.contiguous()
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(V))
    _tree_sampling_verify_kernel[(B,)](
        tree_tokens.contiguous(), target_probs, first_child.contiguous(),
        next_sibling.contiguous(), node_coins.contiguous(), final_coins.contiguous(),
        accept_index, accept_length, predict,
        N, V, max_depth, target_probs.stride(0), target_probs.stride(1),
        BLOCK_S=triton.next_power_of_2(max_depth + 1),
        BLOCK_N=triton.next_power_of_2(N + 1),  # a scan rejects at most N tokens
        BLOCK_V=block_v, num_warps=8 if block_v >= 1024 else 4,
    )
    return accept_index, accept_length, predict
