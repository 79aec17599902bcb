"""Triton speculative ops compiled on a GPU against their torch references, large sizes.

(Not named test_triton_spec_ops.py: that basename is taken by the unit tests, and pytest
refuses two test modules of one basename without packages.) Batches up to 64, trees up to
64 nodes from K = 8 / S = 8 drafts (M = 456 candidates), vocabularies of 32000 and 128256
with full-softmax and truncated target rows, contexts up to 8192 with page sizes 1 and 16.
References run on CPU copies of the same inputs. Then the graph-safe ops are captured in
one CUDA graph and replayed on fresh inputs.

Sampling decisions are compared exactly: with truncated rows every float64 sum is exact, so
they must agree; with full-softmax rows the summation orders differ and a mismatch would
need a coin within ~1e-16 of a threshold (kestrel_kernels/triton_verify.py).
"""
from __future__ import annotations

import pytest
import torch

# Imported first: on a CPU-only machine the unit module switches on Triton's interpreter
# before anything imports triton, so the unit tests still run whichever file is collected
# first (here they are skipped anyway).
from unit.test_triton_spec_ops import (  # isort: skip
    child_tokens,
    expand_inputs,
    grow_draft,
    paged_req_to_token,
    random_tree,
    sampling_probs,
    topk_logits,
)

from kestrel_kernels import cache_loc, spec_ops, spec_tree, verify  # noqa: E402
from kestrel_testing import require_compiled_triton  # noqa: E402
from kestrel_kernels import triton_spec_tree as tst  # noqa: E402
from kestrel_kernels.triton_kv_indices import paged_kv_indices_ref  # noqa: E402


@pytest.fixture(autouse=True)
def _compiled():
    require_compiled_triton(tst, "_build_tree_kernel")


def cuda(*ts):
    return [t.cuda() for t in ts]


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.is_cuda and g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu(), w.cpu())


def assert_tree_same(got: spec_tree.TreeInfo, want: spec_tree.TreeInfo):
    for name in spec_tree.TreeInfo.__dataclass_fields__:
        assert_same([getattr(got, name)], [getattr(want, name)])


@pytest.mark.parametrize("B,K,S,N", [(1, 4, 5, 8), (64, 4, 5, 8), (64, 8, 8, 64), (17, 8, 6, 48),
                                     (64, 1, 8, 9), (32, 6, 4, 32)])
def test_organize_draft_and_build_tree(B, K, S, N):
    gen = torch.Generator().manual_seed(B * K * S + N)
    scores, tokens, parent_flat = grow_draft(B, K, S, 32000, gen)
    want = spec_tree.organize_draft(scores, tokens, parent_flat, N)
    assert_same(spec_ops.organize_draft(*cuda(scores, tokens, parent_flat), N), want)
    verified = torch.randint(0, 32000, (B,), generator=gen)
    seq_lens = torch.randint(0, 8000, (B,), generator=gen)
    assert_tree_same(spec_ops.build_tree(*cuda(verified, *want, seq_lens)),
                     spec_tree.build_tree(verified, *want, seq_lens))


@pytest.mark.parametrize("B,N,S", [(1, 8, 5), (64, 8, 7), (64, 64, 8), (33, 24, 3)])
def test_greedy_verify(B, N, S):
    gen = torch.Generator().manual_seed(B + N + S)
    tree = random_tree(B, N, 6, gen)
    follow = child_tokens(tree, gen)
    noise = torch.randint(0, 6, (B, N), generator=gen)
    target = torch.where((follow >= 0) & (torch.rand(B, N, generator=gen) < 0.8), follow, noise)
    args = (tree.tokens, target, tree.first_child, tree.next_sibling)
    assert_same(spec_ops.greedy_verify(*cuda(*args), S), verify.greedy_verify(*args, S))


@pytest.mark.parametrize("kind", ["flat", "peaked", "softmax"])
@pytest.mark.parametrize("B,N,S,V", [(1, 8, 5, 32000), (64, 8, 5, 128256), (16, 64, 8, 32000),
                                     (64, 16, 3, 32000)])
def test_tree_sampling_verify(B, N, S, V, kind):
    gen = torch.Generator().manual_seed(B + N + S + V)
    tree = random_tree(B, N, 8 if kind == "peaked" else V, gen)
    if kind == "softmax":  # full-vocabulary rows: tiny tails, inexact float64 sums
        probs = torch.softmax(torch.randn(B, N, V, generator=gen) * 3, -1)
    else:
        probs = sampling_probs(tree, V, kind, gen)
    args = (tree.tokens, probs, tree.first_child, tree.next_sibling)
    dev_args = cuda(*args)
    for trial in range(4):
        node_coins, final_coins = torch.rand(B, N, generator=gen), torch.rand(B, generator=gen)
        want = verify.tree_sampling_verify(*args, S, node_coins, final_coins)
        got = spec_ops.tree_sampling_verify(*dev_args, S, *cuda(node_coins, final_coins))
        assert_same(got, want)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 8, 64])
def test_cache_locs_and_kv_indices(B, page):
    gen = torch.Generator().manual_seed(B * page)
    r2t, rows = paged_req_to_token(B, 8192, page, gen)
    starts = torch.randint(0, 8192 - 64, (B,), generator=gen)
    for width in (8, 64):
        assert_same([spec_ops.assign_cache_locs(*cuda(r2t, rows, starts), width)],
                    [cache_loc.assign_cache_locs(r2t, rows, starts, width)])
    seq_lens = torch.randint(0, 8193, (B,), generator=gen)
    want = paged_kv_indices_ref(r2t, rows, seq_lens, page)
    assert_same(spec_ops.paged_kv_indices(*cuda(r2t, rows, seq_lens), page), want)


@pytest.mark.parametrize("B,K", [(1, 4), (64, 4), (256, 8), (33, 16)])
def test_expand_level(B, K):
    args = expand_inputs(B, K, torch.Generator().manual_seed(B + K))
    assert_same(spec_ops.expand_level(*cuda(*args[:4]), args[4]), spec_tree.expand_level(*args))


@pytest.mark.parametrize("T,V,k", [(1, 49152, 4), (4, 49152, 4), (256, 49152, 4), (32, 16384, 8),
                                   (8, 128256, 16), (64, 49152, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_probs(T, V, k, ties):
    x = topk_logits(T, V, torch.Generator().manual_seed(T + V + k), ties)
    p, idx = spec_ops.topk_probs(x.cuda(), k)
    want_p, want_idx = spec_tree.topk_probs(x, k)
    assert p.is_cuda and torch.equal(idx.cpu(), want_idx)
    torch.testing.assert_close(p.cpu(), want_p, rtol=2e-5, atol=1e-8)


def test_topk_probs_graph_replay():
    x = torch.zeros(4, 49152, dtype=torch.bfloat16, device="cuda")  # [4, V] bf16 static input
    spec_ops.topk_probs(x, 4)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        p, idx = spec_ops.topk_probs(x, 4)
    for seed in range(3):
        new = topk_logits(4, 49152, torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        x.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        want_p, want_idx = spec_tree.topk_probs(new.float(), 4)
        assert torch.equal(idx.cpu(), want_idx)
        torch.testing.assert_close(p.cpu(), want_p, rtol=2e-5, atol=1e-8)


def test_cuda_graph_replay_equals_reference():
    """build_tree -> greedy_verify -> assign_cache_locs -> paged_kv_indices (into a fixed
    buffer) read no device value on the host, so one graph captures them all."""
    B, K, S, N, V, page = 8, 4, 5, 8, 100, 16
    gen = torch.Generator().manual_seed(0)
    r2t, rows = paged_req_to_token(B, 512, page, gen)

    def fresh_inputs():
        scores, tokens, parent_flat = grow_draft(B, K, S, V, gen)
        draft, parent = spec_tree.organize_draft(scores, tokens, parent_flat, N)
        return {"verified": torch.randint(0, V, (B,), generator=gen), "draft": draft,
                "parent": parent, "seq_lens": torch.randint(0, 512 - N, (B,), generator=gen),
                "target": torch.randint(0, V, (B, N), generator=gen)}

    static = {k: v.cuda() for k, v in fresh_inputs().items()}
    r2t_d, rows_d = cuda(r2t, rows)
    kv_out = torch.empty(B * 512 // page, dtype=torch.int64, device="cuda")  # [max pages] int64

    def step():
        tree = spec_ops.build_tree(static["verified"], static["draft"], static["parent"],
                                   static["seq_lens"])
        acc = spec_ops.greedy_verify(tree.tokens, static["target"], tree.first_child,
                                     tree.next_sibling, S)
        locs = spec_ops.assign_cache_locs(r2t_d, rows_d, static["seq_lens"], N)
        kv = spec_ops.paged_kv_indices(r2t_d, rows_d, static["seq_lens"] + acc[1], page, kv_out)
        return tree, acc, locs, kv

    step()  # compile every kernel before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tree, acc, locs, kv = step()
    for _ in range(3):
        new = fresh_inputs()
        for k, v in new.items():
            static[k].copy_(v)
        graph.replay()
        torch.cuda.synchronize()
        ref_tree = spec_tree.build_tree(new["verified"], new["draft"], new["parent"], new["seq_lens"])
        assert_tree_same(tree, ref_tree)
        ref_acc = verify.greedy_verify(ref_tree.tokens, new["target"], ref_tree.first_child,
                                       ref_tree.next_sibling, S)
        assert_same(acc, ref_acc)
        assert_same([locs], [cache_loc.assign_cache_locs(r2t, rows, new["seq_lens"], N)])
        ptr, idx, last = paged_kv_indices_ref(r2t, rows, new["seq_lens"] + ref_acc[1], page)
        assert_same([kv[0], kv[2]], [ptr, last])
        assert torch.equal(kv[1][:idx.numel()].cpu(), idx)
