"""Triton speculative ops against their torch references, and the spec_ops dispatch.

Without CUDA the kernels run in Triton's interpreter on CPU tensors (small sizes); with
CUDA the same tests run compiled on the GPU (tests/gpu/test_triton_spec_ops.py adds large
sizes). Integer outputs must be equal exactly; tree sampling must make the same accept
decisions and draw the same bonus as the reference from the same coins. Skipped when
triton is missing.
"""
from __future__ import annotations

import pytest
import torch

import triton_interpreter  # before actors/kernels import triton: picks its interpreter without CUDA
from kestrel_testing import alternately_long
from actors.worker.kv_cache import SlotAllocator
from kestrel_kernels import cache_loc, spec_ops, spec_tree, verify
from kestrel_kernels import triton_cache_loc as tcl
from kestrel_kernels import triton_kv_indices as tkv
from kestrel_kernels import triton_spec_tree as tst
from kestrel_kernels import triton_topk as ttk
from kestrel_kernels import triton_verify as tv

INTERPRETED, DEV, needs_triton = triton_interpreter.triton_setup(tst, "_build_tree_kernel")


# ---------------------------------------------------------------------------- cases
def paged_req_to_token(B: int, max_len: int, page: int, gen: torch.Generator):
    """req_to_token [B+2, max_len] int64 filled from a paged SlotAllocator with pages handed
    out round-robin over requests (a row's slots are page-contiguous, not row-contiguous),
    and a shuffled [B] int64 choice of rows (row 0 stays the reserved padding row)."""
    L = -(-max_len // page) * page
    alloc = SlotAllocator((B + 2) * L + 2 * page, page)
    r2t = torch.zeros(B + 2, L, dtype=torch.int64)  # [R, L] int64
    for start in range(0, L, page):
        for r in range(1, B + 2):
            r2t[r, start:start + page] = alloc.alloc(page)
    rows = torch.randperm(B + 1, generator=gen)[:B] + 1  # [B] int64
    return r2t[:, :max_len].contiguous(), rows


def grow_draft(B: int, K: int, S: int, V: int, gen: torch.Generator):
    """Candidate lists scores/tokens/parent_flat [B, M], M = K + (S-1)*K*K, as the draft
    loop builds them; probabilities are coarsely quantised so scores tie often."""

    def rand_topk(rows):
        p = (torch.round(torch.rand(rows, K, generator=gen) * 4) + 1) / 5  # [rows, K] float32
        p = torch.sort(p, dim=-1, descending=True).values
        return p, torch.randint(0, V, (rows, K), generator=gen)  # [rows, K] int64

    scores, tokens = rand_topk(B)
    out_s, out_t, out_p = [scores], [tokens], [torch.full((B, K), -1, dtype=torch.int64)]
    lane_flat = torch.arange(K).expand(B, K).clone()  # [B, K] int64
    for level in range(2, S + 1):
        cp, ct = rand_topk(B * K)
        scores, _, lane_flat, _, cs, ctk, cpf = spec_tree.expand_level(
            scores, cp.view(B, K, K), ct.view(B, K, K), lane_flat,
            spec_tree.level_offset(level, K))
        out_s.append(cs)
        out_t.append(ctk)
        out_p.append(cpf)
    return torch.cat(out_s, 1), torch.cat(out_t, 1), torch.cat(out_p, 1)


def random_tree(B: int, N: int, V: int, gen: torch.Generator) -> spec_tree.TreeInfo:
    """Reference layout of random trees (node i's parent uniform in [0, i), tokens < V)."""
    parent = torch.zeros(B, N - 1, dtype=torch.int64)  # [B, N-1] int64
    for i in range(N - 1):
        parent[:, i] = torch.randint(0, i + 1, (B,), generator=gen)
    return spec_tree.build_tree(torch.randint(0, V, (B,), generator=gen),
                                torch.randint(0, V, (B, N - 1), generator=gen), parent,
                                torch.randint(0, 100, (B,), generator=gen))


def child_tokens(tree: spec_tree.TreeInfo, gen: torch.Generator) -> torch.Tensor:
    """[B, N] int64: for each node, the token of one of its children (random pick along
    the sibling chain), or -1 for a leaf; targets built from it make deep walks likely."""
    B, N = tree.tokens.shape
    out = torch.full((B, N), -1, dtype=torch.int64)
    for b in range(B):
        for n in range(N):
            kids, c = [], int(tree.first_child[b, n])
            while c >= 0:
                kids.append(c)
                c = int(tree.next_sibling[b, c])
            if kids:
                pick = kids[int(torch.randint(0, len(kids), (1,), generator=gen))]
                out[b, n] = tree.tokens[b, pick]
    return out


def sampling_probs(tree: spec_tree.TreeInfo, V: int, kind: str, gen: torch.Generator):
    """[B, N, V] float32 target distributions: 'flat' (uniform noise), or 'peaked' (top-6
    truncated softmax boosted on a child's token, some rows one-hot) so that walks go
    deep, rejections leave a residual, and zero-probability drafts occur."""
    B, N = tree.tokens.shape
    if kind == "flat":
        p = torch.rand(B, N, V, generator=gen) + 0.01
        return p / p.sum(-1, keepdim=True)
    logits = torch.randn(B, N, V, generator=gen) * 2  # [B, N, V] float32
    want = child_tokens(tree, gen)
    logits.scatter_add_(2, want.clamp(min=0)[..., None], (want >= 0).float()[..., None] * 3)
    top = torch.topk(logits, min(6, V), dim=-1).indices
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(2, top, True)
    p = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1)
    one_hot = torch.rand(B, N, 1, generator=gen) < 0.2
    return torch.where(one_hot, torch.nn.functional.one_hot(logits.argmax(-1), V).float(), p)


def to_dev(*ts):
    return [t.to(DEV) for t in ts]


def assert_same(got, want):
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.cpu(), w.cpu()), f"\n{g}\n!=\n{w}"


# ---------------------------------------------------------------------------- tree building
# N = 1: the smallest draft shape the adaptive choice switches to (a root only:
# a plain step that keeps the draft's state).
GRID = [(B, K, S, N) for B in (1, 3, 8) for K in (1, 4) for S in (1, 3, 5) for N in (1, 4, 8)
        if N - 1 <= K + (S - 1) * K * K]


@needs_triton
@pytest.mark.parametrize("B,K,S,N", GRID)
def test_organize_draft_and_build_tree(B, K, S, N):
    gen = torch.Generator().manual_seed(1000 * B + 100 * K + 10 * S + N)
    scores, tokens, parent_flat = grow_draft(B, K, S, 40, gen)
    want = spec_tree.organize_draft(scores, tokens, parent_flat, N)
    got = tst.organize_draft_triton(*to_dev(scores, tokens, parent_flat), N)
    assert_same(got, want)

    verified = torch.randint(0, 40, (B,), generator=gen)
    seq_lens = torch.randint(0, 300, (B,), generator=gen)
    ref = spec_tree.build_tree(verified, *want[:2], seq_lens)
    tri = tst.build_tree_triton(*to_dev(verified, *want[:2], seq_lens))
    for name in spec_tree.TreeInfo.__dataclass_fields__:
        assert_same([getattr(tri, name)], [getattr(ref, name)])


@needs_triton
@pytest.mark.parametrize("seed", range(3))
def test_organize_draft_parents_not_kept_and_many_tiles(seed):
    # Random scores/parents violate organize_draft's precondition (-1 for a parent that was
    # not kept); M = 150 spans three rank tiles.
    gen = torch.Generator().manual_seed(seed)
    B, M, N = 3, 150, 40
    scores = torch.round(torch.rand(B, M, generator=gen) * 8) / 8  # [B, M] float32, ties
    tokens = torch.randint(0, 1000, (B, M), generator=gen)
    parent_flat = torch.randint(-1, M, (B, M), generator=gen)
    want = spec_tree.organize_draft(scores, tokens, parent_flat, N)
    assert (want[1] == -1).any()
    assert_same(tst.organize_draft_triton(*to_dev(scores, tokens, parent_flat), N), want)


@needs_triton
@pytest.mark.parametrize("shape", ["random", "chain", "star"])
def test_build_tree_shapes(shape):
    gen = torch.Generator().manual_seed(7)
    B, N = 3, 13  # N not a power of two: padded lanes must stay out of every output
    if shape == "chain":
        parent = torch.arange(N - 1).expand(B, N - 1)
    elif shape == "star":
        parent = torch.zeros(B, N - 1, dtype=torch.int64)
    else:
        parent = torch.stack([torch.randint(0, i + 1, (B,), generator=gen) for i in range(N - 1)], 1)
    draft = torch.randint(0, 9, (B, N - 1), generator=gen)
    verified, seq_lens = torch.tensor([1, 2, 3]), torch.tensor([0, 5, 1000])
    ref = spec_tree.build_tree(verified, draft, parent, seq_lens)
    tri = tst.build_tree_triton(*to_dev(verified, draft, parent, seq_lens))
    for name in spec_tree.TreeInfo.__dataclass_fields__:
        assert_same([getattr(tri, name)], [getattr(ref, name)])


# ---------------------------------------------------------------------------- verify
VERIFY_GRID = [(B, N, S) for B in (1, 3, 8) for N in (1, 4, 8) for S in (1, 3, 5)]


@needs_triton
@pytest.mark.parametrize("B,N,S", VERIFY_GRID)
def test_greedy_verify(B, N, S):
    gen = torch.Generator().manual_seed(100 * B + 10 * N + S)
    tree = random_tree(B, N, 4, gen)  # 4 tokens: repeated sibling tokens are common
    follow = child_tokens(tree, gen)
    noise = torch.randint(0, 4, (B, N), generator=gen)
    target = torch.where((follow >= 0) & (torch.rand(B, N, generator=gen) < 0.8), follow, noise)
    args = (tree.tokens, target, tree.first_child, tree.next_sibling)
    want = verify.greedy_verify(*args, S)
    assert_same(tv.greedy_verify_triton(*to_dev(*args), S), want)


# Every (B, N, S) with one kind of probabilities in make test and the other in make
# test-long, alternating, so each kind meets every batch size, tree size and depth (the
# interpreter takes about a second a case).
SAMPLING_GRID = alternately_long(VERIFY_GRID, [("flat",), ("peaked",)])


@needs_triton
@pytest.mark.parametrize("B,N,S,kind", SAMPLING_GRID)
def test_tree_sampling_verify(B, N, S, kind, monkeypatch):
    # 16-entry chunks over V = 37: the CDF and sums carry across chunks and a partial one.
    monkeypatch.setattr(tv, "_MAX_BLOCK_V", 16)
    gen = torch.Generator().manual_seed(100 * B + 10 * N + S + (kind == "flat"))
    V = 37
    tree = random_tree(B, N, 8 if kind == "peaked" else V, gen)
    probs = sampling_probs(tree, V, kind, gen)
    node_coins, final_coins = torch.rand(B, N, generator=gen), torch.rand(B, generator=gen)
    args = (tree.tokens, probs, tree.first_child, tree.next_sibling)
    want = verify.tree_sampling_verify(*args, S, node_coins, final_coins)
    got = tv.tree_sampling_verify_triton(*to_dev(*args), S, *to_dev(node_coins, final_coins))
    assert_same(got, want)


@needs_triton
def test_tree_sampling_verify_many_coins_one_chunk():
    # 12 seeded trials of one peaked batch, V in a single chunk, duplicate sibling tokens:
    # accept decisions and bonus tokens must match the reference trial by trial.
    gen = torch.Generator().manual_seed(3)
    B, N, S, V = 4, 8, 5, 6
    tree = random_tree(B, N, V, gen)
    probs = sampling_probs(tree, V, "peaked", gen)
    args = (tree.tokens, probs, tree.first_child, tree.next_sibling)
    dev_args = to_dev(*args)
    lengths = []
    for _ in range(12):
        node_coins, final_coins = torch.rand(B, N, generator=gen), torch.rand(B, generator=gen)
        want = verify.tree_sampling_verify(*args, S, node_coins, final_coins)
        got = tv.tree_sampling_verify_triton(*dev_args, S, *to_dev(node_coins, final_coins))
        assert_same(got, want)
        lengths.append(want[1])
    assert int(torch.cat(lengths).max()) >= 3  # the walks did go deep


# ---------------------------------------------------------------------------- KV slots
@needs_triton
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_assign_cache_locs(B, page):
    gen = torch.Generator().manual_seed(B * page)
    r2t, rows = paged_req_to_token(B, 100, page, gen)
    for width in (4, 8, 13):
        starts = torch.randint(0, 100 - width + 1, (B,), generator=gen)
        want = cache_loc.assign_cache_locs(r2t, rows, starts, width)
        assert_same([tcl.assign_cache_locs_triton(*to_dev(r2t, rows, starts), width)], [want])


@needs_triton
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 3, 8])
def test_paged_kv_indices(B, page, monkeypatch):
    monkeypatch.setattr(tkv, "_BLOCK", 8)  # several chunks per request
    gen = torch.Generator().manual_seed(B + page)
    r2t, rows = paged_req_to_token(B, 200, page, gen)
    seq_lens = torch.randint(0, 201, (B,), generator=gen)
    seq_lens[0] = 0 if B > 1 else 32  # an empty request / an exact page multiple
    want = tkv.paged_kv_indices_ref(r2t, rows, seq_lens, page)
    assert_same(tkv.paged_kv_indices_triton(*to_dev(r2t, rows, seq_lens), page), want)
    out = torch.full((int(want[0][-1]) + 5,), -7, dtype=torch.int64, device=DEV)
    _, got, _ = tkv.paged_kv_indices_triton(*to_dev(r2t, rows, seq_lens), page, out=out)
    assert got is out and torch.equal(out[:want[1].numel()].cpu(), want[1])
    assert (out[want[1].numel():] == -7).all()
    out32 = torch.empty(int(want[0][-1]), dtype=torch.int32, device=DEV)  # FlashInfer's dtype
    _, got, _ = tkv.paged_kv_indices_triton(*to_dev(r2t, rows, seq_lens), page, out=out32)
    assert got.dtype == torch.int32 and torch.equal(got.cpu().long(), want[1])


@pytest.mark.parametrize("page", [1, 16])
def test_paged_kv_indices_ref_against_loop(page):
    gen = torch.Generator().manual_seed(page)
    r2t, rows = paged_req_to_token(3, 70, page, gen)
    seq_lens = torch.tensor([0, 17, 64])
    kv_indptr, kv_indices, last = tkv.paged_kv_indices_ref(r2t, rows, seq_lens, page)
    pages, lasts, ptr = [], [], [0]
    for r, n in zip(rows.tolist(), seq_lens.tolist()):
        ids = sorted({int(r2t[r, p]) // page for p in range(n)})  # slots are page-contiguous
        pages += [int(r2t[r, p * page]) // page for p in range(len(ids))]
        assert sorted(pages[len(pages) - len(ids):]) == ids
        ptr.append(ptr[-1] + len(ids))
        lasts.append(n - (len(ids) - 1) * page if n else 0)
    assert kv_indptr.tolist() == ptr and kv_indices.tolist() == pages and last.tolist() == lasts
    if page == 1:
        assert_same([kv_indptr, kv_indices], cache_loc.kv_indices(r2t, rows, seq_lens))


# ---------------------------------------------------------------------------- expand_level
def expand_inputs(B: int, K: int, gen: torch.Generator, level: int = 3):
    """One draft level's inputs, with coarse probabilities so candidates tie often and
    lane_flat as the draft's first level has it (an expanded arange: row stride 0)."""
    parent_scores = torch.round(torch.rand(B, K, generator=gen) * 3) / 3  # [B, K] float32
    child_probs = torch.round(torch.rand(B, K, K, generator=gen) * 3) / 3  # [B, K, K] float32
    child_tokens = torch.randint(0, 1000, (B, K, K), generator=gen)  # [B, K, K] int64
    lane_flat = torch.randint(0, 40, (B, K), generator=gen) if level > 2 else torch.arange(K).expand(B, K)
    return parent_scores, child_probs, child_tokens, lane_flat, spec_tree.level_offset(level, K)


@needs_triton
@pytest.mark.parametrize("B,K", [(1, 1), (3, 4), (8, 8), (5, 6)])
@pytest.mark.parametrize("level", [2, 4])
def test_expand_level(B, K, level):
    args = expand_inputs(B, K, torch.Generator().manual_seed(B * K + level), level)
    got = tst.expand_level_triton(*to_dev(*args[:4]), args[4])
    assert_same(got, spec_tree.expand_level(*args))


# ---------------------------------------------------------------------------- draft top-k
def topk_logits(T: int, V: int, gen: torch.Generator, ties: bool = False) -> torch.Tensor:
    """[T, V] float32 logits; with ties, each row's maximum repeated at scattered ids (and
    a second value repeated) so the order among equals decides the result."""
    x = torch.randn(T, V, generator=gen) * 3
    if ties:
        for t in range(T):
            ids = torch.randperm(V, generator=gen)[:6]
            x[t, ids[:3]] = x[t].max() + 1
            x[t, ids[3:]] = x[t].max() - 0.5
    return x


def assert_topk_matches(got, want):
    (gp, gi), (wp, wi) = got, want
    assert gp.dtype == torch.float32 and gi.dtype == torch.int64 and gi.shape == wi.shape
    assert torch.equal(gi.cpu(), wi), f"\n{gi}\n!=\n{wi}"
    torch.testing.assert_close(gp.cpu(), wp, rtol=2e-6, atol=1e-9)


# V below one chunk, not a multiple of it, and several chunks; k from argmax to 8.
@needs_triton
@pytest.mark.parametrize("T,V,k", [(1, 100, 1), (3, 2048, 4), (4, 5000, 4), (2, 4099, 8),
                                   (5, 9000, 2)])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_probs(T, V, k, ties):
    gen = torch.Generator().manual_seed(T * V + k)
    x = topk_logits(T, V, gen, ties)
    assert_topk_matches(ttk.topk_probs_triton(*to_dev(x), k), spec_tree.topk_probs(x, k))


@needs_triton
def test_topk_probs_bf16_rows_and_strided_input():
    # The draft hands bf16 GEMM output; a column slice is a strided row.
    gen = torch.Generator().manual_seed(7)
    x = topk_logits(3, 6000, gen).to(torch.bfloat16)  # [3, 6000] bf16
    want = spec_tree.topk_probs(x[:, :5000].float(), 4)
    assert_topk_matches(ttk.topk_probs_triton(to_dev(x)[0][:, :5000], 4), want)
    with pytest.raises(ValueError, match="k=7, V=5"):
        ttk.topk_probs_triton(to_dev(x)[0][:, :5], 7)


# ---------------------------------------------------------------------------- dispatch
def test_spec_ops_dispatch():
    gen = torch.Generator().manual_seed(0)
    cpu = torch.zeros(1)
    assert not spec_ops.use_triton(cpu)
    if DEV == "cuda":
        assert spec_ops.use_triton(cpu.cuda()) and not spec_ops.use_triton(cpu.cuda(), True)
    # CPU inputs (and force_torch) run the references.
    tree = random_tree(2, 5, 6, gen)
    target = torch.randint(0, 6, (2, 5), generator=gen)
    args = (tree.tokens, target, tree.first_child, tree.next_sibling, 3)
    assert_same(spec_ops.greedy_verify(*args), verify.greedy_verify(*args))
    r2t, rows = paged_req_to_token(2, 40, 16, gen)
    seq_lens = torch.tensor([33, 0])
    out = torch.full((8,), -1, dtype=torch.int64)
    _, got, _ = spec_ops.paged_kv_indices(r2t, rows, seq_lens, 16, out, force_torch=True)
    want = tkv.paged_kv_indices_ref(r2t, rows, seq_lens, 16)[1]
    assert got is out and torch.equal(out[:3], want) and (out[3:] == -1).all()
    x = topk_logits(2, 300, gen)
    p, idx = spec_ops.topk_probs(x, 3)  # torch's softmax + topk on CPU
    assert_topk_matches((p, idx), spec_tree.topk_probs(x, 3))
