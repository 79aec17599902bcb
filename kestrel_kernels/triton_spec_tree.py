"""Triton kernels for `kestrel_kernels.spec_tree.expand_level`, `organize_draft` and `build_tree`.

The torch references are the functions of the same name in kestrel_kernels/spec_tree.py; these
produce identical integer outputs (names and shapes as there: B requests, M candidates,
N tree nodes). One program per request; nothing is read on the host, so both calls can
be captured in a CUDA graph.

expand_level: the K*K candidate scores of one request sit in one program; the K best are
    taken one at a time (maximum, lowest flat index among equals: the reference's stable
    sort), so one launch replaces the reference's nine small ones per draft step.
organize_draft: the reference's stable descending sort keeps candidate j iff its rank
    #{i: s_i > s_j} + #{i < j: s_i == s_j} is below N-1, and a kept candidate's node id is
    1 + the number of kept candidates before it (ascending flat order). The kernel counts
    ranks pairwise in tiles (M is a few hundred at most), then numbers the kept ones with a
    running prefix sum (writing each one's rank as its node_rank), then maps parents
    through the flat -> node table it wrote.
build_tree: the ancestor mask comes from walking every node up one parent per step, as
    in the reference; first child and next sibling are row minima over [N, N] relations.
"""
from __future__ import annotations

import torch

from kestrel_kernels.spec_tree import TreeInfo

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "expand_level_triton", "organize_draft_triton", "build_tree_triton"]

_TILE = 64  # candidates per side of one rank-counting tile


if HAS_TRITON:

    @triton.jit
    def _expand_level_kernel(
        ParentScores, ChildProbs, ChildTokens, LaneFlat, stride_ps, stride_lf,
        NewScores, NewTokens, NewLaneFlat, ParentLane, CandScores, CandTokens, CandParent,
        level_offset,
        K: tl.constexpr, BLOCK_KK: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_KK)  # candidate j = lane * K + child
        ok = j < K * K
        lane = j // K
        score = (tl.load(ParentScores + b * stride_ps + lane, mask=ok, other=0.0)
                 * tl.load(ChildProbs + b * K * K + j, mask=ok, other=0.0))
        token = tl.load(ChildTokens + b * K * K + j, mask=ok, other=0)
        parent = tl.load(LaneFlat + b * stride_lf + lane, mask=ok, other=0)
        tl.store(CandScores + b * K * K + j, score, mask=ok)
        tl.store(CandTokens + b * K * K + j, token, mask=ok)
        tl.store(CandParent + b * K * K + j, parent, mask=ok)
        left = tl.where(ok, score, float("-inf"))
        for t in tl.static_range(K):
            best = tl.max(left, 0)
            at = tl.min(tl.where(left == best, j, BLOCK_KK), 0)
            tl.store(NewScores + b * K + t, best)
            tl.store(NewTokens + b * K + t, tl.sum(tl.where(j == at, token, 0), 0))
            tl.store(NewLaneFlat + b * K + t, (at + level_offset).to(tl.int64))
            tl.store(ParentLane + b * K + t, (at // K).to(tl.int64))
            left = tl.where(j == at, float("-inf"), left)

    @triton.jit
    def _organize_draft_kernel(
        Scores, Tokens, ParentFlat, FlatToNode, DraftTokens, ParentNode, NodeRank,
        M, N_KEEP,
        TILE: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        scores = Scores + b * M
        flat_to_node = FlatToNode + b * M
        n_tiles = tl.cdiv(M, TILE)

        # 1. The stable descending rank of every candidate, staged in FlatToNode.
        for jt in range(n_tiles):
            j = jt * TILE + tl.arange(0, TILE)
            j_ok = j < M
            s_j = tl.load(scores + j, mask=j_ok, other=0.0)
            rank = tl.zeros((TILE,), dtype=tl.int32)
            for it in range(n_tiles):
                i = it * TILE + tl.arange(0, TILE)
                s_i = tl.load(scores + i, mask=i < M, other=0.0)
                before = (s_i[None, :] > s_j[:, None]) | (
                    (s_i[None, :] == s_j[:, None]) & (i[None, :] < j[:, None]))
                before = before & (i[None, :] < M)
                rank += tl.sum(before.to(tl.int32), axis=1)
            tl.store(flat_to_node + j, rank.to(tl.int64), mask=j_ok)
        tl.debug_barrier()  # every thread's ranks are written before they are summed

        # 2. Node id of each kept candidate (1 + kept before it, in flat order); gather its
        #    token into place. Non-kept candidates map to -1.
        carry = tl.zeros((), dtype=tl.int64)
        for jt in range(n_tiles):
            j = jt * TILE + tl.arange(0, TILE)
            j_ok = j < M
            rank = tl.load(flat_to_node + j, mask=j_ok, other=N_KEEP)
            is_kept = rank < N_KEEP
            kept = is_kept.to(tl.int64)
            node = carry + tl.cumsum(kept, axis=0)  # inclusive count = node id when kept
            carry += tl.sum(kept, axis=0)
            tl.store(flat_to_node + j, tl.where(is_kept, node, -1), mask=j_ok)
            tok = tl.load(Tokens + b * M + j, mask=j_ok & is_kept, other=0)
            tl.store(DraftTokens + b * N_KEEP + node - 1, tok.to(tl.int64), mask=j_ok & is_kept)
            tl.store(NodeRank + b * N_KEEP + node - 1, rank, mask=j_ok & is_kept)
        tl.debug_barrier()  # the whole flat -> node table is written before parents read it

        # 3. Parent of each kept candidate as a node id (0 = root, -1 = parent not kept).
        for jt in range(n_tiles):
            j = jt * TILE + tl.arange(0, TILE)
            j_ok = j < M
            node = tl.load(flat_to_node + j, mask=j_ok, other=-1)
            is_kept = node > 0
            pflat = tl.load(ParentFlat + b * M + j, mask=j_ok & is_kept, other=-1).to(tl.int64)
            pnode = tl.load(flat_to_node + pflat, mask=is_kept & (pflat >= 0), other=0)
            tl.store(ParentNode + b * N_KEEP + node - 1, pnode, mask=j_ok & is_kept)

    @triton.jit
    def _build_tree_kernel(
        VerifiedId, DraftTokens, ParentNode, SeqLens,
        Tokens, Parent, Depth, Positions, TreeMask, FirstChild, NextSibling, RetrieveIndex,
        N: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0).to(tl.int64)
        rows = tl.arange(0, BLOCK_N)  # node ids; also used as columns below
        ok = rows < N
        is_draft = ok & (rows > 0)
        drafts = b * (N - 1) + rows - 1  # offset of node `rows` in the [B, N-1] inputs

        root_tok = tl.load(VerifiedId + b).to(tl.int64)
        tok = tl.load(DraftTokens + drafts, mask=is_draft, other=0).to(tl.int64)
        tok = tl.where(rows == 0, root_tok, tok)
        par = tl.load(ParentNode + drafts, mask=is_draft, other=-1).to(tl.int64)  # root: -1

        # Ancestor relation: walk every node up one level per step (<= N-1 steps).
        anc = (rows[:, None] == rows[None, :]) & ok[:, None] & ok[None, :]  # [i, j]: i sees j
        cur = par
        for _ in range(N - 1):  # loop over tree depth
            anc |= (cur[:, None] == rows[None, :]) & (cur >= 0)[:, None]
            up = tl.load(ParentNode + b * (N - 1) + cur - 1, mask=cur >= 1, other=-1)
            cur = tl.where(cur >= 1, up.to(tl.int64), -1)
        depth = tl.sum(anc.to(tl.int64), axis=1) - 1
        seq = tl.load(SeqLens + b).to(tl.int64)

        # first_child[p]: lowest c with parent[c] == p (row p, column c).
        child_of = (par[None, :] == rows[:, None]) & ok[None, :]
        first_child = tl.min(tl.where(child_of, rows[None, :], BLOCK_N), axis=1)
        first_child = tl.where(first_child < BLOCK_N, first_child, -1)
        # next_sibling[j]: lowest k > j with the same (non-root) parent (row j, column k).
        later_sib = (par[:, None] == par[None, :]) & (rows[None, :] > rows[:, None]) & \
            (par[:, None] >= 0) & ok[None, :]
        next_sibling = tl.min(tl.where(later_sib, rows[None, :], BLOCK_N), axis=1)
        next_sibling = tl.where(next_sibling < BLOCK_N, next_sibling, -1)

        node = b * N + rows
        tl.store(Tokens + node, tok, mask=ok)
        tl.store(Parent + node, par, mask=ok)
        tl.store(Depth + node, depth, mask=ok)
        tl.store(Positions + node, seq + depth, mask=ok)
        tl.store(FirstChild + node, first_child.to(tl.int64), mask=ok)
        tl.store(NextSibling + node, next_sibling.to(tl.int64), mask=ok)
        tl.store(RetrieveIndex + node, node, mask=ok)
        cell = b * N * N + rows[:, None] * N + rows[None, :]
        tl.store(TreeMask + cell, anc.to(tl.uint8), mask=ok[:, None] & ok[None, :])


def expand_level_triton(parent_scores, child_probs, child_tokens, lane_flat, level_offset: int):
    """Triton `expand_level`: same arguments and outputs (fp32 scores, int64 ids)."""
    B, K = parent_scores.shape
    dev = parent_scores.device
    parent_scores = parent_scores.float()
    if parent_scores.stride(1) != 1:
        parent_scores = parent_scores.contiguous()
    lane_flat = lane_flat.to(torch.int64)
    if lane_flat.stride(1) != 1:  # an expanded arange has row stride 0, which is fine
        lane_flat = lane_flat.contiguous()
    child_probs = child_probs.float().contiguous()
    child_tokens = child_tokens.to(torch.int64).contiguous()
    new = [torch.empty(B, K, dtype=dt, device=dev)  # [B, K] each
           for dt in (torch.float32, torch.int64, torch.int64, torch.int64)]
    cand = [torch.empty(B, K * K, dtype=dt, device=dev)  # [B, K*K] each
            for dt in (torch.float32, torch.int64, torch.int64)]
    if B:
        _expand_level_kernel[(B,)](parent_scores, child_probs, child_tokens, lane_flat,
                                   parent_scores.stride(0), lane_flat.stride(0), *new, *cand,
                                   level_offset, K=K, BLOCK_KK=triton.next_power_of_2(K * K))
    return (*new, *cand)


def organize_draft_triton(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parent_flat: torch.Tensor,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton `organize_draft`; same arguments and results ([B, N-1] int64 each)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.spec_tree.organize_draft")
    B, M = scores.shape
    n_keep = num_draft_tokens - 1
    if n_keep > M:
        raise ValueError(f"num_draft_tokens - 1 = {n_keep} > {M} candidates")
    device = scores.device
    draft_tokens = torch.empty((B, n_keep), dtype=torch.int64, device=device)  # [B, N-1] int64
    parent_node = torch.empty((B, n_keep), dtype=torch.int64, device=device)  # [B, N-1] int64
    node_rank = torch.empty((B, n_keep), dtype=torch.int64, device=device)  # [B, N-1] int64
    if B == 0 or n_keep == 0:
        return draft_tokens, parent_node, node_rank
    flat_to_node = torch.empty((B, M), dtype=torch.int64, device=device)  # [B, M] int64 scratch
    _organize_draft_kernel[(B,)](
        scores.contiguous(), tokens.contiguous(), parent_flat.contiguous(), flat_to_node,
        draft_tokens, parent_node, node_rank, M, n_keep, TILE=_TILE, num_warps=4,
    )
    return draft_tokens, parent_node, node_rank


def build_tree_triton(
    verified_id: torch.Tensor,
    draft_tokens: torch.Tensor,
    parent_node: torch.Tensor,
    seq_lens: torch.Tensor,
) -> TreeInfo:
    """Triton `build_tree`; same arguments and TreeInfo (tree_mask [B, N, N] bool)."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.spec_tree.build_tree")
    B, n1 = draft_tokens.shape
    N = n1 + 1
    device = draft_tokens.device

    def field() -> torch.Tensor:
        return torch.empty((B, N), dtype=torch.int64, device=device)  # [B, N] int64

    info = TreeInfo(
        tokens=field(), parent=field(), depth=field(), positions=field(),
        tree_mask=torch.empty((B, N, N), dtype=torch.bool, device=device),  # [B, N, N] bool
        first_child=field(), next_sibling=field(), retrieve_index=field(),
    )
    if B == 0:
        return info
    block_n = triton.next_power_of_2(N)
    _build_tree_kernel[(B,)](
        verified_id.contiguous(), draft_tokens.contiguous(), parent_node.contiguous(),
        seq_lens.contiguous(), info.tokens, info.parent, info.depth, info.positions,
        info.tree_mask.view(torch.uint8), info.first_child, info.next_sibling,
        info.retrieve_index, N=N, BLOCK_N=block_n,
        num_warps=8 if block_n >= 64 else 4,  # [N, N] relations: 4 warps hit 255 regs at N=64
    )
    return info
