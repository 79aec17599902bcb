"""EAGLE-2 draft tree ops: top-k, level expansion, draft selection, tree layout.

Pure-torch references (the CPU path and the test oracle for later Triton kernels).
Names: B requests, K topk, S draft steps, N draft tokens per request (tree nodes
including the root), V vocabulary, M candidates per request. Index/token tensors are
int64.

Flat candidate indices. Draft decode grows the tree level by level. Level 1 is the K
children of the root, flat indices 0..K-1 (parent -1 = root). Every later level i
(i = 2..S) produces K*K candidates (each of the K lanes proposes K children), with flat
indices level_offset + lane*K + child, where level_offset = K + (i-2)*K*K. A caller
concatenates per request
    scores      = [topk_p,        cand_scores(level 2),      ...]   # [B, M]
    tokens      = [topk_index,    cand_tokens(level 2),      ...]   # [B, M]
    parent_flat = [-1 (K times),  cand_parent_flat(level 2), ...]   # [B, M]
with M = K + (S-1)*K*K, then calls `organize_draft` and `build_tree`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "topk_probs",
    "level_offset",
    "expand_level",
    "organize_draft",
    "TreeInfo",
    "build_tree",
    "flatten_tree_mask",
]


def topk_probs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of the softmax of each row.

    Args:
        logits: [T, V] float.
        k: number kept (k <= V).

    Returns:
        topk_p: [T, k] float32, softmax probabilities in descending order.
        topk_index: [T, k] int64 token ids; equal probabilities are ordered toward the
            lower token id (stable), so the result is deterministic.
    """
    probs = torch.softmax(logits.float(), dim=-1)  # [T, V] float32
    sorted_p, sorted_idx = torch.sort(probs, dim=-1, descending=True, stable=True)  # [T, V] f32, i64
    return sorted_p[:, :k].contiguous(), sorted_idx[:, :k].to(torch.int64).contiguous()


def level_offset(level: int, k: int) -> int:
    """Flat index of the first candidate of draft level `level` (1-based; level 1 = root's children)."""
    if level < 1:
        raise ValueError(f"level must be >= 1, got {level}")
    return 0 if level == 1 else k + (level - 2) * k * k


def expand_level(
    parent_scores: torch.Tensor,
    child_probs: torch.Tensor,
    child_tokens: torch.Tensor,
    lane_flat: torch.Tensor,
    level_offset: int,
) -> tuple[torch.Tensor, ...]:
    """One draft-decode level of EAGLE-2 tree growth.

    Each of the K lanes (the current frontier nodes) proposes K children; a child's
    score is its lane's cumulative score times its draft probability. All K*K children
    are candidates of this level; the best K (stable: ties toward the lower flat index)
    become the next lanes.

    Args:
        parent_scores: [B, K] float, cumulative score of each lane's current node.
        child_probs: [B, K, K] float, draft top-k probabilities per lane ([b, lane, c]).
        child_tokens: [B, K, K] int64, the matching token ids.
        lane_flat: [B, K] int64, flat candidate index of each lane's current node.
        level_offset: flat index of this level's first candidate (see `level_offset()`).

    Returns:
        new_scores: [B, K] float, scores of the selected children (descending).
        new_tokens: [B, K] int64, their tokens (the next draft-decode input ids).
        new_lane_flat: [B, K] int64, their flat indices (level_offset + j).
        parent_lane: [B, K] int64, the lane each selected child came from (j // K); the
            caller gathers hidden states with it.
        cand_scores: [B, K*K] float, all candidates of this level, j = lane*K + child.
        cand_tokens: [B, K*K] int64.
        cand_parent_flat: [B, K*K] int64, cand_parent_flat[:, j] = lane_flat[:, j // K].
    """
    B, K = parent_scores.shape
    cand_scores = (parent_scores[:, :, None] * child_probs).reshape(B, K * K)  # [B, K*K] float
    cand_tokens = child_tokens.reshape(B, K * K).to(torch.int64)  # [B, K*K] int64
    cand_parent_flat = lane_flat.to(torch.int64).repeat_interleave(K, dim=1)  # [B, K*K] int64

    order = torch.sort(cand_scores, dim=-1, descending=True, stable=True).indices  # [B, K*K] int64
    sel = order[:, :K]  # [B, K] int64, j of each new lane
    new_scores = torch.gather(cand_scores, 1, sel)  # [B, K] float
    new_tokens = torch.gather(cand_tokens, 1, sel)  # [B, K] int64
    new_lane_flat = sel + level_offset  # [B, K] int64
    parent_lane = torch.div(sel, K, rounding_mode="floor")  # [B, K] int64
    return (
        new_scores,
        new_tokens,
        new_lane_flat,
        parent_lane,
        cand_scores,
        cand_tokens,
        cand_parent_flat,
    )


def organize_draft(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parent_flat: torch.Tensor,
    num_draft_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keep the N-1 best candidates and express the tree with node indices.

    Selection is by score, stable (ties toward the lower flat index). Because a parent's
    score is >= its child's (scores are products of probabilities <= 1) and its flat
    index is lower, a selected child's parent is always selected too. The kept
    candidates are ordered by ascending flat index, so parents precede children.
    For the same reason the n-1 best of them (node_rank < n-1) are the tree a draft of
    n nodes from the same candidates would keep, and hold every one of their ancestors.

    Args:
        scores: [B, M] float, cumulative scores of all candidates.
        tokens: [B, M] int64.
        parent_flat: [B, M] int64, flat index of each candidate's parent, -1 = root.
        num_draft_tokens: N (tree nodes including the root); requires N - 1 <= M.

    Returns:
        draft_tokens: [B, N-1] int64, tokens of nodes 1..N-1.
        parent_node: [B, N-1] int64, parent of node i+1 as a node index (0 = root,
            i+1 = the i-th kept candidate); always < i+1. If the precondition above is
            violated (a kept candidate's parent was not kept) the entry is -1.
        node_rank: [B, N-1] int64, node i+1's place in the selection (0 = best score).
    """
    B, M = scores.shape
    n_keep = num_draft_tokens - 1
    if n_keep > M:
        raise ValueError(f"num_draft_tokens - 1 = {n_keep} > {M} candidates")
    device = scores.device
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices  # [B, M] int64
    # [B, N-1] int64 each: flat indices ascending, and where each stood in the selection
    picked, node_rank = torch.sort(order[:, :n_keep], dim=-1)
    draft_tokens = torch.gather(tokens.to(torch.int64), 1, picked)  # [B, N-1] int64
    pflat = torch.gather(parent_flat.to(torch.int64), 1, picked)  # [B, N-1] int64

    # flat index -> node index (0 = not kept / root marker handled below)
    flat_to_node = torch.full((B, M), -1, dtype=torch.int64, device=device)  # [B, M] int64
    node_ids = torch.arange(1, n_keep + 1, dtype=torch.int64, device=device).expand(B, n_keep)  # [B, N-1]
    flat_to_node.scatter_(1, picked, node_ids)
    mapped = torch.gather(flat_to_node, 1, pflat.clamp(min=0))  # [B, N-1] int64
    parent_node = torch.where(pflat < 0, torch.zeros_like(mapped), mapped)  # [B, N-1] int64
    return draft_tokens, parent_node, node_rank


@dataclass
class TreeInfo:
    """Layout of the verify tree of each request (node 0 = root = last verified token).

    tokens: [B, N] int64 node tokens.
    parent: [B, N] int64 parent node, -1 for the root.
    depth: [B, N] int64, root 0.
    positions: [B, N] int64 = seq_lens[:, None] + depth.
    tree_mask: [B, N, N] bool, [b, i, j] true iff j == i or j is an ancestor of i.
    first_child: [B, N] int64, lowest-index child, -1 if none.
    next_sibling: [B, N] int64, next higher-index node with the same parent, -1 if none.
    retrieve_index: [B, N] int64 = b*N + node, row of each node in the flat [B*N] verify
        batch.
    """

    tokens: torch.Tensor
    parent: torch.Tensor
    depth: torch.Tensor
    positions: torch.Tensor
    tree_mask: torch.Tensor
    first_child: torch.Tensor
    next_sibling: torch.Tensor
    retrieve_index: torch.Tensor


def build_tree(
    verified_id: torch.Tensor,
    draft_tokens: torch.Tensor,
    parent_node: torch.Tensor,
    seq_lens: torch.Tensor,
) -> TreeInfo:
    """Build the verify-tree layout from `organize_draft`'s output.

    Args:
        verified_id: [B] int64, last verified token of each request (the root).
        draft_tokens: [B, N-1] int64, tokens of nodes 1..N-1.
        parent_node: [B, N-1] int64, parent of node i+1, each in [0, i].
        seq_lens: [B] int64, tokens already in the KV cache before the root. The root
            sits at position seq_len (`positions = seq_lens + depth`).

    Returns:
        TreeInfo with all fields [B, N] int64 except tree_mask [B, N, N] bool.
    """
    B, n1 = draft_tokens.shape
    N = n1 + 1
    device = draft_tokens.device
    tokens = torch.cat([verified_id.to(torch.int64)[:, None], draft_tokens.to(torch.int64)], dim=1)  # [B, N]
    root_parent = torch.full((B, 1), -1, dtype=torch.int64, device=device)  # [B, 1] int64
    parent = torch.cat([root_parent, parent_node.to(torch.int64)], dim=1)  # [B, N] int64

    # Ancestor relation by walking every node up one level per iteration (<= N-1 steps).
    eye = torch.eye(N, dtype=torch.bool, device=device)  # [N, N] bool
    tree_mask = eye.expand(B, N, N).clone()  # [B, N, N] bool
    node_cols = torch.arange(N, dtype=torch.int64, device=device)  # [N] int64
    cur = parent.clone()  # [B, N] int64, current ancestor of each node (-1 = past the root)
    for _ in range(N - 1):
        valid = cur >= 0  # [B, N] bool
        if not bool(valid.any()):
            break
        tree_mask |= (cur[:, :, None] == node_cols[None, None, :]) & valid[:, :, None]
        cur = torch.where(valid, torch.gather(parent, 1, cur.clamp(min=0)), cur)
    depth = tree_mask.sum(dim=-1).to(torch.int64) - 1  # [B, N] int64
    positions = seq_lens.to(torch.int64)[:, None] + depth  # [B, N] int64

    # is_child[b, p, c]: node c's parent is p.
    is_child = parent[:, None, :] == node_cols[None, :, None]  # [B, N, N] bool
    has_child = is_child.any(dim=-1)  # [B, N] bool
    first_child = torch.where(
        has_child, is_child.to(torch.int64).argmax(dim=-1), torch.full_like(parent, -1)
    )  # [B, N] int64

    # later_sib[b, j, k]: k > j and k shares j's (non-root) parent.
    later = node_cols[None, :] > node_cols[:, None]  # [N, N] bool, [j, k] = k > j
    later_sib = (parent[:, :, None] == parent[:, None, :]) & later[None] & (parent[:, :, None] >= 0)  # [B, N, N]
    has_sib = later_sib.any(dim=-1)  # [B, N] bool
    next_sibling = torch.where(
        has_sib, later_sib.to(torch.int64).argmax(dim=-1), torch.full_like(parent, -1)
    )  # [B, N] int64

    retrieve_index = (
        torch.arange(B, dtype=torch.int64, device=device)[:, None] * N + node_cols[None, :]
    )  # [B, N] int64
    return TreeInfo(
        tokens=tokens,
        parent=parent,
        depth=depth,
        positions=positions,
        tree_mask=tree_mask,
        first_child=first_child,
        next_sibling=next_sibling,
        retrieve_index=retrieve_index,
    )


def flatten_tree_mask(tree_mask: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """Full verify attention mask with the prefix, flattened (FlashInfer custom-mask style).

    Request b contributes an [N, seq_len_b + N] block, row-major: node i sees every
    prefix column (the seq_len_b tokens already cached) and the tree columns of
    `tree_mask[b, i]`. Blocks are concatenated in request order.

    Args:
        tree_mask: [B, N, N] bool.
        seq_lens: [B] int64.

    Returns:
        mask: [sum_b N * (seq_len_b + N)] bool.
    """
    B, N, _ = tree_mask.shape
    blocks = []
    for b in range(B):  # loop over requests (reference path)
        L = int(seq_lens[b])
        prefix = torch.ones((N, L), dtype=torch.bool, device=tree_mask.device)  # [N, L] bool
        blocks.append(torch.cat([prefix, tree_mask[b]], dim=1).reshape(-1))  # [N*(L+N)] bool
    if not blocks:
        return torch.zeros((0,), dtype=torch.bool, device=tree_mask.device)
    return torch.cat(blocks)
