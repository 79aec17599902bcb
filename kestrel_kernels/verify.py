"""Tree verification: greedy walk and lossless tree rejection sampling.

Pure-torch references (the CPU path and the test oracle for later Triton kernels).
Names: B requests, N tree nodes per request (node 0 = root = last verified token),
S max draft depth, V vocabulary. Index/token tensors are int64.

Outputs of both verifiers:
    accept_index [B, S+1] int64: accepted node ids along the path, root first, -1 padded.
    accept_length [B] int64: accepted nodes including the root = accepted drafts + 1.
    predict [B, S+1] int64: emitted tokens, -1 padded; predict[b, :accept_length[b]] are
        the accepted draft tokens followed by the bonus token.
"""
from __future__ import annotations

import torch

from kestrel_kernels.sampling import sample_from_probs

__all__ = ["greedy_verify", "tree_sampling_verify", "select_last_index", "nested_accept_lengths"]


def _init_outputs(B: int, S: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    accept_index = torch.full((B, S + 1), -1, dtype=torch.int64, device=device)  # [B, S+1] int64
    accept_index[:, 0] = 0
    accept_length = torch.ones((B,), dtype=torch.int64, device=device)  # [B] int64
    predict = torch.full((B, S + 1), -1, dtype=torch.int64, device=device)  # [B, S+1] int64
    return accept_index, accept_length, predict


def greedy_verify(
    tree_tokens: torch.Tensor,
    target_predict: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    max_depth: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Greedy (temperature 0) verification walk (contracts C18, C19).

    From the root, look through the current node's children in sibling order
    (first_child, then next_sibling) for the first whose token equals the target's
    argmax at the current node; accept it and continue from it, else stop. At most
    `max_depth` drafts are accepted. The bonus is the target argmax at the last
    accepted node.

    Args:
        tree_tokens: [B, N] int64.
        target_predict: [B, N] int64, target argmax at each node.
        first_child: [B, N] int64, -1 = none.
        next_sibling: [B, N] int64, -1 = none.
        max_depth: S.

    Returns:
        accept_index [B, S+1] int64, accept_length [B] int64, predict [B, S+1] int64
        (see module docstring); predict[b, d] = target_predict at the d-th accepted node.
    """
    B, N = tree_tokens.shape
    device = tree_tokens.device
    S = max_depth
    accept_index, accept_length, predict = _init_outputs(B, S, device)
    rows = torch.arange(B, device=device)  # [B] int64
    cur = torch.zeros((B,), dtype=torch.int64, device=device)  # [B] int64, last accepted node
    active = torch.ones((B,), dtype=torch.bool, device=device)  # [B] bool, still walking
    none = torch.full((B,), -1, dtype=torch.int64, device=device)  # [B] int64

    for d in range(1, S + 1):  # loop over tree depth
        want = target_predict[rows, cur]  # [B] int64
        child = torch.where(active, first_child[rows, cur], none)  # [B] int64
        found = none.clone()  # [B] int64
        for _ in range(N):  # sibling scan, at most N - 1 children
            searching = child >= 0  # [B] bool
            if not bool(searching.any()):
                break
            c = child.clamp(min=0)
            match = searching & (tree_tokens[rows, c] == want)  # [B] bool
            found = torch.where(match, child, found)
            child = torch.where(searching & ~match, next_sibling[rows, c], none)
        ok = found >= 0  # [B] bool
        accept_index[:, d] = torch.where(ok, found, accept_index[:, d])
        predict[:, d - 1] = torch.where(ok, want, predict[:, d - 1])
        accept_length += ok.to(torch.int64)
        cur = torch.where(ok, found, cur)
        active = ok
        if not bool(active.any()):
            break

    bonus = target_predict[rows, cur]  # [B] int64
    predict.scatter_(1, (accept_length - 1)[:, None], bonus[:, None])
    return accept_index, accept_length, predict


def tree_sampling_verify(
    tree_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    first_child: torch.Tensor,
    next_sibling: torch.Tensor,
    max_depth: int,
    node_coins: torch.Tensor,
    final_coins: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless tree rejection sampling with deterministic drafts (contract C23).

    At the current node with target distribution q = target_probs[b, cur], try its
    children in sibling order: child x (token t) is accepted iff
    node_coins[b, x] * sum(q) < q(t), i.e. with probability q(t) / sum(q). On rejection
    q(t) is set to 0 (residual) and the next sibling is tried against the renormalised
    residual. An accepted child becomes the current node (fresh q from its row). If no
    child is accepted, the bonus is sampled from the residual q with final_coins[b]
    (inverse CDF); if the last accepted node has no children or the depth limit S is
    reached, the bonus is sampled from that node's unmodified q. The emitted tokens are
    then distributed exactly as the target's, whatever the draft tokens were.

    Args:
        tree_tokens: [B, N] int64.
        target_probs: [B, N, V] float, processed target distribution at each node
            (output of `process_logits`).
        first_child: [B, N] int64, -1 = none.
        next_sibling: [B, N] int64, -1 = none.
        max_depth: S.
        node_coins: [B, N] float in [0, 1), the acceptance coin of each node.
        final_coins: [B] float in [0, 1), the bonus coin.

    Returns:
        accept_index [B, S+1] int64, accept_length [B] int64, predict [B, S+1] int64
        (see module docstring); predict at accepted draft positions is the accepted
        child's token, the last entry is the bonus.
    """
    B, N = tree_tokens.shape
    device = tree_tokens.device
    S = max_depth
    accept_index, accept_length, predict = _init_outputs(B, S, device)
    rows = torch.arange(B, device=device)  # [B] int64
    cur = torch.zeros((B,), dtype=torch.int64, device=device)  # [B] int64
    active = torch.ones((B,), dtype=torch.bool, device=device)  # [B] bool
    none = torch.full((B,), -1, dtype=torch.int64, device=device)  # [B] int64
    q = target_probs[:, 0, :].to(torch.float64).clone()  # [B, V] float64, working distribution

    for d in range(1, S + 1):  # loop over tree depth
        child = torch.where(active, first_child[rows, cur], none)  # [B] int64
        found = none.clone()  # [B] int64
        for _ in range(N):  # sibling scan
            searching = child >= 0  # [B] bool
            if not bool(searching.any()):
                break
            c = child.clamp(min=0)
            tok = tree_tokens[rows, c]  # [B] int64
            q_tok = q[rows, tok]  # [B] float64
            total = q.sum(dim=-1)  # [B] float64
            coin = node_coins[rows, c].to(torch.float64)  # [B] float64
            # q_tok >= total: the token holds all remaining mass -> accept surely.
            accept = searching & (q_tok > 0) & ((coin * total < q_tok) | (q_tok >= total))  # [B] bool
            found = torch.where(accept, child, found)
            reject = searching & ~accept  # [B] bool
            q[rows, tok] = torch.where(reject, torch.zeros_like(q_tok), q_tok)  # residual
            child = torch.where(reject, next_sibling[rows, c], none)
        ok = found >= 0  # [B] bool
        f = found.clamp(min=0)
        accept_index[:, d] = torch.where(ok, found, accept_index[:, d])
        predict[:, d - 1] = torch.where(ok, tree_tokens[rows, f], predict[:, d - 1])
        accept_length += ok.to(torch.int64)
        q = torch.where(ok[:, None], target_probs[rows, f].to(torch.float64), q)
        cur = torch.where(ok, found, cur)
        active = ok
        if not bool(active.any()):
            break

    bonus = sample_from_probs(q, final_coins)  # [B] int64
    predict.scatter_(1, (accept_length - 1)[:, None], bonus[:, None])
    return accept_index, accept_length, predict


def select_last_index(accept_length: torch.Tensor, num_draft_tokens: int) -> torch.Tensor:
    """Row of each request's last accepted token in a fixed-width-N draft-extend output (C21).

    Args:
        accept_length: [B] int64, accepted drafts + 1.
        num_draft_tokens: N, rows per request in the draft-extend output.

    Returns:
        [B] int64 = b * N + accept_length[b] - 1.
    """
    B = accept_length.shape[0]
    rows = torch.arange(B, dtype=torch.int64, device=accept_length.device)  # [B] int64
    return rows * num_draft_tokens + accept_length.to(torch.int64) - 1


def nested_accept_lengths(accept_index: torch.Tensor, node_rank: torch.Tensor,
                          nodes: list[int]) -> torch.Tensor:
    """The accept length each smaller tree of the same draft would have given.

    The tree of n nodes keeps the n-1 best-ranked draft nodes (node_rank < n-1), which hold
    all of their ancestors (organize_draft), so under greedy verification its accepted path
    is this tree's up to the first node outside them: the target's logits at a node depend
    on its ancestors only. For rows that sample it is an estimate (the sampled path cut
    the same way).

    Args:
        accept_index: [B, S+1] int64, the accepted path's nodes, root first, -1 past its end.
        node_rank: [B, N-1] int64, each draft node's rank (organize_draft).
        nodes: the smaller trees' node counts, each at least 1.

    Returns:
        [B, len(nodes)] int64 accept lengths (the bonus token included).
    """
    B = accept_index.shape[0]
    if not nodes:
        return accept_index.new_zeros((B, 0))  # [B, 0] int64
    root = torch.full((B, 1), -1, dtype=torch.int64, device=accept_index.device)  # [B, 1] int64
    rank = torch.cat([root, node_rank], 1).gather(1, accept_index.clamp(min=0))  # [B, S+1] int64
    rank = torch.where(accept_index >= 0, rank, torch.iinfo(torch.int64).max)  # past the end: outside
    cols = [(rank < n - 1).to(torch.int64).cumprod(1).sum(1) for n in nodes]  # [B] int64 each
    return torch.stack(cols, 1)  # [B, J] int64
