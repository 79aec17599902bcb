"""Speculative-decoding ops, each dispatched to its Triton kernel or its torch reference.

The Triton kernel runs when the op's inputs are on CUDA and triton imports; otherwise (CPU
tensors, no triton, or `force_torch=True`) the pure-torch reference runs. Both give the
same results (kestrel_kernels/triton_verify.py says when a sampling decision may not), so callers
need not care which one ran.
"""
from __future__ import annotations

import torch

from kestrel_kernels import cache_loc, spec_tree, verify
from kestrel_kernels.triton_available import use_triton
from kestrel_kernels.triton_cache_loc import assign_cache_locs_triton
from kestrel_kernels.triton_kv_indices import paged_kv_indices_ref, paged_kv_indices_triton
from kestrel_kernels.triton_spec_tree import build_tree_triton, expand_level_triton, organize_draft_triton
from kestrel_kernels.triton_topk import topk_probs_triton
from kestrel_kernels.triton_verify import greedy_verify_triton, tree_sampling_verify_triton

__all__ = [
    "use_triton",
    "topk_probs",
    "expand_level",
    "organize_draft",
    "build_tree",
    "greedy_verify",
    "tree_sampling_verify",
    "assign_cache_locs",
    "paged_kv_indices",
]


def topk_probs(logits: torch.Tensor, k: int, *, force_torch: bool = False):
    """`kestrel_kernels.spec_tree.topk_probs`. Without Triton, torch's softmax and topk: the same
    values, but exactly equal probabilities may come in another order (the reference's
    stable sort of a whole row costs 15x on a CPU, and the draft calls this every step)."""
    if use_triton(logits, force_torch):
        return topk_probs_triton(logits, k)
    return torch.softmax(logits.float(), dim=-1).topk(k, dim=-1)


def expand_level(parent_scores: torch.Tensor, child_probs: torch.Tensor,
                 child_tokens: torch.Tensor, lane_flat: torch.Tensor, level_offset: int,
                 *, force_torch: bool = False):
    """`kestrel_kernels.spec_tree.expand_level`."""
    fn = expand_level_triton if use_triton(parent_scores, force_torch) else spec_tree.expand_level
    return fn(parent_scores, child_probs, child_tokens, lane_flat, level_offset)


def organize_draft(scores: torch.Tensor, tokens: torch.Tensor, parent_flat: torch.Tensor,
                   num_draft_tokens: int, *, force_torch: bool = False):
    """`kestrel_kernels.spec_tree.organize_draft`."""
    fn = organize_draft_triton if use_triton(scores, force_torch) else spec_tree.organize_draft
    return fn(scores, tokens, parent_flat, num_draft_tokens)


def build_tree(verified_id: torch.Tensor, draft_tokens: torch.Tensor, parent_node: torch.Tensor,
               seq_lens: torch.Tensor, *, force_torch: bool = False) -> spec_tree.TreeInfo:
    """`kestrel_kernels.spec_tree.build_tree`."""
    fn = build_tree_triton if use_triton(draft_tokens, force_torch) else spec_tree.build_tree
    return fn(verified_id, draft_tokens, parent_node, seq_lens)


def greedy_verify(tree_tokens: torch.Tensor, target_predict: torch.Tensor,
                  first_child: torch.Tensor, next_sibling: torch.Tensor, max_depth: int,
                  *, force_torch: bool = False):
    """`kestrel_kernels.verify.greedy_verify`."""
    fn = greedy_verify_triton if use_triton(tree_tokens, force_torch) else verify.greedy_verify
    return fn(tree_tokens, target_predict, first_child, next_sibling, max_depth)


def tree_sampling_verify(tree_tokens: torch.Tensor, target_probs: torch.Tensor,
                         first_child: torch.Tensor, next_sibling: torch.Tensor, max_depth: int,
                         node_coins: torch.Tensor, final_coins: torch.Tensor,
                         *, force_torch: bool = False):
    """`kestrel_kernels.verify.tree_sampling_verify`."""
    fn = (tree_sampling_verify_triton if use_triton(tree_tokens, force_torch)
          else verify.tree_sampling_verify)
    return fn(tree_tokens, target_probs, first_child, next_sibling, max_depth, node_coins,
              final_coins)


def assign_cache_locs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                      starts: torch.Tensor, width: int, *, force_torch: bool = False):
    """`kestrel_kernels.cache_loc.assign_cache_locs`."""
    fn = (assign_cache_locs_triton if use_triton(req_to_token, force_torch)
          else cache_loc.assign_cache_locs)
    return fn(req_to_token, req_pool_indices, starts, width)


def paged_kv_indices(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                     seq_lens: torch.Tensor, page_size: int = 1, out: torch.Tensor | None = None,
                     *, force_torch: bool = False):
    """`kestrel_kernels.triton_kv_indices.paged_kv_indices_ref` -> (kv_indptr, kv_indices,
    kv_last_page_len). With `out` the page ids are written there and `out` is returned as
    kv_indices (the Triton path then reads nothing back to the host)."""
    if use_triton(req_to_token, force_torch):
        return paged_kv_indices_triton(req_to_token, req_pool_indices, seq_lens, page_size, out)
    kv_indptr, kv_indices, last = paged_kv_indices_ref(req_to_token, req_pool_indices, seq_lens,
                                                       page_size)
    if out is None:
        return kv_indptr, kv_indices, last
    out[:kv_indices.numel()].copy_(kv_indices)
    return kv_indptr, out, last
