"""kestrel_kernels.triton_attention and actors.attention.triton_backend, small sizes.

Without CUDA the kernels run in Triton's interpreter on CPU tensors; with CUDA the same
tests run compiled on the GPU. Skipped (kernel tests only) when triton is missing.

Three checks on the same random paged batches, in every attention mode (decode, extend
over a cached prefix, tree-mask verify, draft-decode ancestor masks, causal with more new
keys than queries, and full visibility):
  * paged_attention_ref agrees with TorchNativeBackend (the oracle) on a ForwardBatch;
  * the Triton kernel agrees with paged_attention_ref (with and without key splits);
  * TritonBackend.forward agrees with TorchNativeBackend.forward end to end.
The same checks run over an FP8 cache (kv_cache.dtype=fp8_e4m3) with scales other than 1.
req_to_token comes from a paged SlotAllocator whose pages are handed out round-robin over
requests, so a request's slots are not contiguous across pages.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import triton_interpreter  # before actors/kernels import triton: picks its interpreter without CUDA
from kestrel_testing import alternately_long, random_draft_mask, random_tree_mask

from actors.attention.torch_native import TorchNativeBackend
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.worker.kv_cache import ReqToTokenPool, SlotAllocator, TokenToKVPool
from kestrel_kernels import triton_attention as ta

INTERPRETED, DEV, needs_triton = triton_interpreter.triton_setup(ta, "_paged_attn_kernel")

MODES = ("decode", "extend", "verify", "draft_decode", "causal_wide", "full")
ORACLE_MODES = MODES[:-1]  # ForwardBatch has no "full" flag (it is an all-True custom mask)

CONFIGS = {"smollm": (9, 3, 64), "gqa2_d24": (4, 2, 24), "mha_d16": (2, 2, 16)}  # H, Hkv, D


def one_page_each(modes) -> list:
    """(mode, page) for every mode at pages 1 and 16: in make test each mode at one page,
    alternating, the other in make test-long (the interpreter takes seconds a case)."""
    return alternately_long([(m,) for m in modes], [(1,), (16,)])


# ---------------------------------------------------------------------------- cases
def make_case(mode: str, page: int, cfg: str = "smollm", seed: int = 0, B: int | None = None,
              dtype: torch.dtype = torch.float32, max_prefix: int = 200, min_prefix: int = 0,
              kv_dtype: torch.dtype | None = None) -> dict:
    """A random batch in ``mode``: lengths, paged req_to_token, K/V pool, q/k/v, masks.
    kv_dtype: the pool's (default ``dtype``); FP8 pools get K scale 0.5 and V scale 2, so a
    reader that skips a scale is off by that factor."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    H, Hkv, D = CONFIGS[cfg]
    B = B or rng.randint(1, 8)
    prefix = [rng.randint(min_prefix, max_prefix) for _ in range(B)]
    masks = None
    if mode == "decode":
        qlens, E = [1] * B, [1] * B
    elif mode == "extend":
        qlens = [rng.randint(1, 16) for _ in range(B)]
        E = list(qlens)
    elif mode == "verify":
        n = rng.randint(1, 16)
        qlens, E = [n] * B, [n] * B
        masks = [random_tree_mask(n, rng) for _ in range(B)]
    elif mode == "draft_decode":
        K, step = rng.randint(1, 4), rng.randint(0, 3)
        qlens, E = [K] * B, [(step + 1) * K] * B
        masks = [random_draft_mask(K, step, rng) for _ in range(B)]
    elif mode in ("causal_wide", "full"):
        n = rng.randint(1, 16)
        qlens, E = [n] * B, [n + rng.randint(0, 8)] * B
    else:
        raise ValueError(mode)
    # Paged table: pages dealt round-robin over the rows (rows 1..B; row 0 is reserved).
    L = max(p + e for p, e in zip(prefix, E))
    L_pad = -(-L // page) * page
    alloc = SlotAllocator((B * L_pad // page + 2) * page, page)
    rt = ReqToTokenPool(B + 2, L_pad, "cpu")
    for start in range(0, L_pad, page):
        for r in range(1, B + 1):
            rt.req_to_token[r, start:start + page] = alloc.alloc(page)
    rt.req_to_token = rt.req_to_token.to(DEV)  # [B+2, L_pad] int64
    rows = list(range(1, B + 1))
    rng.shuffle(rows)
    pool = TokenToKVPool(alloc.num_slots, 1, Hkv, D, kv_dtype or dtype, DEV)
    if pool.quantized:
        pool.k_scale_all.fill_(0.5)
        pool.v_scale_all.fill_(2.0)
    pool.k[0].copy_(torch.randn(pool.k[0].shape, generator=gen))  # [S, Hkv, D] stale/prefix K
    pool.v[0].copy_(torch.randn(pool.v[0].shape, generator=gen))  # [S, Hkv, D]
    T = sum(qlens)
    q = torch.randn(T, H, D, generator=gen).to(DEV, dtype)  # [T, H, D]
    k = torch.randn(T, Hkv, D, generator=gen).to(DEV, dtype)  # [T, Hkv, D] new tokens' K
    v = torch.randn(T, Hkv, D, generator=gen).to(DEV, dtype)  # [T, Hkv, D]
    # This forward writes its q_b tokens at the last q_b new-key positions of each row
    # (extend/verify: all E_b; draft decode: the newest level of the scratch window).
    table = rt.req_to_token
    out_loc = torch.cat([table[r, p + e - n:p + e] for r, p, e, n in zip(rows, prefix, E, qlens)])
    return dict(mode=mode, B=B, H=H, Hkv=Hkv, D=D, prefix=prefix, qlens=qlens, E=E,
                masks=masks, rows=rows, rt=rt, pool=pool, q=q, k=k, v=v, out_loc=out_loc,
                causal=mode != "full", dtype=dtype)


def forward_batch(c: dict) -> ForwardBatch:
    """The case as the workers build it: new_kv_slots only when E_b != q_b (draft decode)."""
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
    rows, table = c["rows"], c["rt"].req_to_token
    new_kv = None
    if c["E"] != c["qlens"]:
        new_kv = torch.stack([table[r, p:p + e] for r, p, e in zip(rows, c["prefix"], c["E"])])
    mask = torch.stack(c["masks"]).to(DEV) if c["masks"] is not None else None  # [B, q, E]
    positions = torch.cat([torch.arange(p + e - n, p + e, device=DEV)
                           for p, e, n in zip(c["prefix"], c["E"], c["qlens"])])
    return ForwardBatch(ForwardMode.DECODE if c["mode"] in ("decode", "draft_decode")
                        else ForwardMode.EXTEND,
                        torch.zeros(sum(c["qlens"]), dtype=torch.int64, device=DEV),
                        positions, c["out_loc"], t(rows), t(c["prefix"]), list(c["qlens"]),
                        new_kv_slots=new_kv, custom_mask=mask)


def kernel_args(c: dict) -> tuple[tuple, dict]:
    """paged_attention(_ref) arguments for a case whose new K/V are already stored."""
    t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
    qo = [0]
    for n in c["qlens"]:
        qo.append(qo[-1] + n)
    kw = dict(causal=c["causal"], scale=c["D"] ** -0.5)
    if c["masks"] is not None:
        kw["custom_mask"] = torch.cat([m.reshape(-1) for m in c["masks"]]).to(DEV)  # [sum q*E]
        kw["mask_indptr"] = t([0] + np.cumsum([m.numel() for m in c["masks"]]).tolist())  # [B+1]
    elif c["mode"] == "full":
        kw["causal"] = False
    if c["pool"].quantized:
        kw.update(k_scale=c["pool"].k_scale[0], v_scale=c["pool"].v_scale[0])
    args = (c["q"], c["pool"].k[0], c["pool"].v[0], c["rt"].req_to_token, t(c["rows"]),
            t(c["prefix"]), t(c["E"]), t(qo), max(c["qlens"]))
    return args, kw


def store_new_kv(c: dict) -> None:
    c["pool"].store(0, c["out_loc"], c["k"], c["v"])


def tol(dtype: torch.dtype) -> dict:
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-3, rtol=3e-3)


def assert_kernel_matches_ref(c: dict, splits, args_kw=None) -> None:
    """The kernel at each split count gives the reference's answer on case `c` (its new
    K/V stored first); `args_kw` overrides kernel_args(c)."""
    store_new_kv(c)
    args, kw = args_kw or kernel_args(c)
    want = ta.paged_attention_ref(*args, **kw)
    for n in splits:
        torch.testing.assert_close(ta.paged_attention(*args, **kw, num_kv_splits=n), want,
                                   **tol(c["dtype"]))


def backends_agree(c: dict, fb: ForwardBatch) -> TokenToKVPool:
    """TritonBackend on a copy of the case's pool and TorchNativeBackend on the pool itself
    store and attend alike for `fb` (outputs compared); returns the Triton side's pool."""
    from actors.attention.triton_backend import TritonBackend

    src = c["pool"]
    pool_t = TokenToKVPool(src.k[0].shape[0], 1, c["Hkv"], c["D"], src.k[0].dtype, DEV)
    if src.quantized:
        pool_t.k_scale_all.copy_(src.k_scale_all)
        pool_t.v_scale_all.copy_(src.v_scale_all)
    pool_t.k[0].copy_(src.k[0])
    pool_t.v[0].copy_(src.v[0])
    native = TorchNativeBackend(src, c["rt"], c["D"] ** -0.5)
    native.init_forward_metadata(fb)
    want = native.forward(c["q"], c["k"], c["v"], 0, fb)
    backend = TritonBackend(pool_t, c["rt"], c["D"] ** -0.5)
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(c["q"], c["k"], c["v"], 0, fb), want, **tol(c["dtype"]))
    return pool_t


# ------------------------------------------------------- reference vs the torch oracle
@pytest.mark.parametrize("page", [1, 4, 16])
@pytest.mark.parametrize("mode", ORACLE_MODES)
def test_ref_matches_torch_native(mode, page):
    for seed in range(3):
        c = make_case(mode, page, cfg=list(CONFIGS)[seed], seed=seed)
        fb = forward_batch(c)
        native = TorchNativeBackend(c["pool"], c["rt"], c["D"] ** -0.5)
        native.init_forward_metadata(fb)
        want = native.forward(c["q"], c["k"], c["v"], 0, fb)  # [T, H, D]; stores new K/V
        args, kw = kernel_args(c)
        got = ta.paged_attention_ref(*args, **kw)
        torch.testing.assert_close(got, want, **tol(c["dtype"]))


def test_ref_full_is_all_true_mask():
    """causal=False equals an explicit all-True custom mask (no ForwardBatch spells it)."""
    c = make_case("full", 4, seed=0)
    assert c["E"][0] > c["qlens"][0] > 1  # the causal and full answers differ here
    store_new_kv(c)
    args, kw = kernel_args(c)
    ones = [torch.ones(n, e, dtype=torch.bool) for n, e in zip(c["qlens"], c["E"])]
    mask = torch.cat([m.reshape(-1) for m in ones]).to(DEV)  # [sum q*E] bool
    indptr = torch.tensor([0] + np.cumsum([m.numel() for m in ones]).tolist(), device=DEV)
    want = ta.paged_attention_ref(*args, custom_mask=mask, mask_indptr=indptr, scale=kw["scale"])
    torch.testing.assert_close(ta.paged_attention_ref(*args, **kw), want)
    causal = ta.paged_attention_ref(*args, scale=kw["scale"], causal=True)
    assert not torch.allclose(causal, want)  # the flag matters for E > 1


# ------------------------------------------------------------- kernel vs reference
@needs_triton
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode", MODES)
def test_kernel_matches_ref(mode, page):
    # SmolLM2's GQA shape always, plus one other head layout per page size.
    for seed, cfg in enumerate(("smollm", "mha_d16" if page == 1 else "gqa2_d24")):
        c = make_case(mode, page, cfg=cfg, seed=10 + seed)
        store_new_kv(c)
        args, kw = kernel_args(c)
        got = ta.paged_attention(*args, **kw, num_kv_splits=1)
        torch.testing.assert_close(got, ta.paged_attention_ref(*args, **kw), **tol(c["dtype"]))


@needs_triton
@pytest.mark.parametrize("mode", ["decode", "verify", "extend", "draft_decode"])
def test_kernel_split_kv_matches_ref(mode):
    """Flash-decoding: keys cut into splits, partial results merged (some splits empty)."""
    assert_kernel_matches_ref(make_case(mode, 4, seed=20, B=2, max_prefix=150), (2, 5))


@needs_triton
# The short context at MAX_KV_SPLITS (most splits empty) is long: it is the very case
# test_splits_read_no_partial_output_they_did_not_write holds to the reference, NaN buffers too.
@pytest.mark.parametrize("prefix", [pytest.param((0, 150), marks=pytest.mark.long), (9000, 9500)])
def test_kernel_more_splits_than_base_matches_ref(prefix):
    """Past BASE_KV_SPLITS a launch splits a long context further (each split keeping
    SPLIT_MIN_KEYS keys) and a short one as at BASE_KV_SPLITS, the rest empty; both merge
    (in the wider merge kernel) to the reference."""
    c = make_case("decode", 16, cfg="mha_d16", seed=21, B=1, min_prefix=prefix[0], max_prefix=prefix[1])
    assert (c["prefix"][0] > ta.BASE_KV_SPLITS * ta.SPLIT_MIN_KEYS) == (prefix[0] > 0)
    store_new_kv(c)
    args, kw = kernel_args(c)
    torch.testing.assert_close(ta.paged_attention(*args, **kw, num_kv_splits=ta.MAX_KV_SPLITS),
                               ta.paged_attention_ref(*args, **kw), **tol(c["dtype"]))


@needs_triton
def test_splits_read_no_partial_output_they_did_not_write(monkeypatch):
    """The partial buffers start as NaN: an empty split writes only its -inf lse and the
    merge reads no output where lse is -inf, so the NaN never reaches the result."""
    real = torch.empty

    def poisoned(*shape, dtype=None, device=None, **kw):
        t = real(*shape, dtype=dtype, device=device, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(ta.torch, "empty", poisoned)
    c = make_case("decode", 16, cfg="mha_d16", seed=21, B=1, min_prefix=0, max_prefix=150)
    store_new_kv(c)
    args, kw = kernel_args(c)
    want = ta.paged_attention_ref(*args, **kw)
    for n in (5, ta.MAX_KV_SPLITS):  # 150 keys: a few splits empty at 5, most at 64
        got = ta.paged_attention(*args, **kw, num_kv_splits=n, out=torch.zeros_like(want))
        torch.testing.assert_close(got, want, **tol(c["dtype"]))


@needs_triton
def test_kernel_fp16_and_page4():
    c = make_case("verify", 4, seed=30, dtype=torch.float16)
    store_new_kv(c)
    args, kw = kernel_args(c)
    got = ta.paged_attention(*args, **kw, num_kv_splits=1)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, ta.paged_attention_ref(*args, **kw), **tol(torch.float16))


@needs_triton
def test_kernel_row_without_visible_keys_is_zero():
    """No prefix and an all-False mask row: zeros, not NaN (kernel and reference)."""
    c = make_case("verify", 1, seed=40, B=2, max_prefix=0)
    for m in c["masks"]:
        m[-1] = False  # the last node of each request sees no key at all
    store_new_kv(c)
    args, kw = kernel_args(c)
    ref = ta.paged_attention_ref(*args, **kw)
    n = c["qlens"][0]
    for splits in (1, 2):
        got = ta.paged_attention(*args, **kw, num_kv_splits=splits)
        assert torch.isfinite(got).all()
        assert (got[n - 1] == 0).all() and (got[2 * n - 1] == 0).all()
        torch.testing.assert_close(got, ref, **tol(c["dtype"]))


# -------------------------------------------------------------- backend vs the oracle
@needs_triton
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("mode", ORACLE_MODES)
def test_backend_matches_torch_native(mode, page):
    c = make_case(mode, page, seed=50 + page)
    pool_t = backends_agree(c, forward_batch(c))  # each stores the new K/V, then attends
    assert torch.equal(pool_t.k[0], c["pool"].k[0]) and torch.equal(pool_t.v[0], c["pool"].v[0])


@needs_triton
def test_backend_ragged_custom_mask():
    """Ragged extend lens with a custom mask wider than needed: per-request blocks cut."""
    from actors.attention.triton_backend import TritonBackend

    c = make_case("extend", 4, seed=60, B=3)
    rng = random.Random(1)
    Q = max(c["qlens"])
    full = torch.zeros(c["B"], Q, Q + 2, dtype=torch.bool)  # [B, Qm, Em] bool, padded
    for b, n in enumerate(c["qlens"]):
        full[b, :n, :n] = random_tree_mask(n, rng)
    fb = forward_batch(c)
    fb.custom_mask = full.to(DEV)
    native = TorchNativeBackend(c["pool"], c["rt"], c["D"] ** -0.5)
    native.init_forward_metadata(fb)
    want = native.forward(c["q"], c["k"], c["v"], 0, fb)
    backend = TritonBackend(c["pool"], c["rt"], c["D"] ** -0.5)
    backend.init_forward_metadata(fb)
    torch.testing.assert_close(backend.forward(c["q"], c["k"], c["v"], 0, fb), want)


@pytest.mark.parametrize("mode", ["decode", "verify", "draft_decode"])
def test_metadata_reads_no_device_values(mode, monkeypatch):
    """Graph-captured modes build metadata with device ops only (capture-safe)."""
    from actors.attention.triton_backend import TritonBackend

    c = make_case(mode, 4, seed=70)
    fb = forward_batch(c)
    backend = TritonBackend(c["pool"], c["rt"], c["D"] ** -0.5)

    def boom(*a, **k):
        raise AssertionError("host read of device data in init_forward_metadata")

    for name in ("tolist", "item", "cpu", "numpy", "__int__", "__bool__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, boom)
    backend.init_forward_metadata(fb)
    monkeypatch.undo()
    m = fb.attn_meta
    assert m.qo_indptr.tolist() == np.cumsum([0] + c["qlens"]).tolist()
    assert m.new_kv_lens.tolist() == c["E"]
    assert m.max_q_len == max(c["qlens"])
    if c["masks"] is not None:
        want = torch.cat([x.reshape(-1) for x in c["masks"]]).to(DEV)
        assert torch.equal(m.custom_mask, want)


def test_default_num_kv_splits():
    cpu = torch.device("cpu")
    assert ta.default_num_kv_splits(3, 1, 9, 64, cpu) == 1  # interpreter: no splits
    ta._SM_COUNT[99] = 132  # pretend device 99 is an H200
    dev = torch.device("cuda", 99)
    assert ta.default_num_kv_splits(3, 1, 9, 64, dev) == ta.BASE_KV_SPLITS  # B=1 decode
    assert ta.default_num_kv_splits(3, 1, 9, 64, dev, max_splits=64) == 64  # attention.max_kv_splits
    assert ta.default_num_kv_splits(3, 1, 9, 64, dev, max_splits=100) == ta.MAX_KV_SPLITS
    # 8 requests x 4 kv heads: 17 splits would leave a second wave of 16 programs
    assert ta.default_num_kv_splits(8 * 4, 8, 28, 128, dev, max_splits=64) == 16
    assert ta.default_num_kv_splits(2 * 4, 2, 28, 128, dev, max_splits=64) == 64
    assert ta.default_num_kv_splits(64 * 3, 64, 9, 64, dev) == 3  # B=64 decode
    assert ta.default_num_kv_splits(4 * 132, 4096, 9, 64, dev) == 1  # batch fills the GPU
    assert ta.default_num_kv_splits(1, 1 << 20, 32, 128, dev) == 1  # partial buffer cap


def mixed_case(page: int, seed: int) -> tuple[dict, dict, int]:
    """A mixed step's batch: the first Bm requests verify a tree each (masked), the rest
    extend causally; built as one case whose masks cover the first Bm requests."""
    tree = make_case("verify", page, seed=seed, B=3)
    chunks = make_case("extend", page, seed=seed + 1, B=3)
    Bm = tree["B"]
    c = make_case("extend", page, seed=seed + 2, B=Bm + chunks["B"], min_prefix=150)  # one table and pool
    n = tree["qlens"][0]
    c["qlens"] = [n] * Bm + chunks["qlens"]
    c["E"] = list(c["qlens"])
    L_pad = c["rt"].req_to_token.shape[1]  # the prefixes shrink to fit the case's table
    c["prefix"] = [min(p, L_pad - e) for p, e in zip(tree["prefix"] + chunks["prefix"], c["E"])]
    assert min(c["prefix"]) >= 0 and sum(c["prefix"]) > 0
    gen = torch.Generator().manual_seed(seed)
    T = sum(c["qlens"])
    c["q"] = torch.randn(T, c["H"], c["D"], generator=gen).to(DEV)  # [T, H, D]
    c["k"] = torch.randn(T, c["Hkv"], c["D"], generator=gen).to(DEV)  # [T, Hkv, D]
    c["v"] = torch.randn(T, c["Hkv"], c["D"], generator=gen).to(DEV)  # [T, Hkv, D]
    table = c["rt"].req_to_token
    c["out_loc"] = torch.cat([table[r, p:p + e] for r, p, e in zip(c["rows"], c["prefix"], c["E"])])
    c["masks"] = tree["masks"]  # the first Bm requests' only
    return c, tree, Bm


def mixed_kernel_args(c: dict, Bm: int) -> tuple[tuple, dict]:
    args, kw = kernel_args(dict(c, masks=None))
    blocks = [m.reshape(-1) for m in c["masks"]]
    kw["custom_mask"] = torch.cat(blocks).to(DEV)
    sizes = [m.numel() for m in blocks] + [0] * (c["B"] - Bm)  # chunks: empty blocks
    kw["mask_indptr"] = torch.tensor([0] + np.cumsum(sizes).tolist(), device=DEV)
    return args, kw


@pytest.mark.parametrize("page", [1, 16])
def test_empty_mask_blocks_are_causal_in_the_reference(page):
    """A request with an empty mask block attends causally: the mixed batch's answer is
    each part's answer computed alone (trees with their masks, chunks causal)."""
    c, _, Bm = mixed_case(page, seed=80)
    store_new_kv(c)
    args, kw = mixed_kernel_args(c, Bm)
    got = ta.paged_attention_ref(*args, **kw)
    alone, _ = kernel_args(dict(c, masks=None))
    causal = ta.paged_attention_ref(*alone, causal=True, scale=kw["scale"])
    T_tree = sum(c["qlens"][:Bm])
    torch.testing.assert_close(got[T_tree:], causal[T_tree:])
    tree_only, _ = kernel_args(dict(c, masks=None))
    blocks = torch.cat([m.reshape(-1) for m in c["masks"]] +
                       [torch.ones(n * n, dtype=torch.bool) for n in c["qlens"][Bm:]]).to(DEV)
    sizes = [n * n for n in c["qlens"]]
    full = ta.paged_attention_ref(*tree_only, custom_mask=blocks, scale=kw["scale"],
                                  mask_indptr=torch.tensor([0] + np.cumsum(sizes).tolist(), device=DEV))
    torch.testing.assert_close(got[:T_tree], full[:T_tree])
    assert not torch.allclose(got[:T_tree], causal[:T_tree])  # the trees' masks mattered


@needs_triton
@pytest.mark.parametrize("page", [1, pytest.param(16, marks=pytest.mark.long)])
def test_kernel_mixed_masked_and_causal_matches_ref(page):
    c, _, Bm = mixed_case(page, seed=90 + page)
    assert_kernel_matches_ref(c, (1, 3), mixed_kernel_args(c, Bm))


@needs_triton
def test_backends_take_a_mask_over_the_first_requests():
    """ForwardBatch.custom_mask for the first Bm requests only (a mixed step): the Triton
    backend and the torch oracle agree, and both equal the reference."""
    c, _, Bm = mixed_case(4, seed=95)
    fb = forward_batch(dict(c, masks=None))
    fb.custom_mask = torch.stack(c["masks"]).to(DEV)  # [Bm, n, n] bool
    backends_agree(c, fb)  # stores the new K/V in the case's pool
    args, kw = mixed_kernel_args(c, Bm)
    native = TorchNativeBackend(c["pool"], c["rt"], c["D"] ** -0.5)
    native.init_forward_metadata(fb)
    want = native.forward(c["q"], c["k"], c["v"], 0, fb)
    torch.testing.assert_close(ta.paged_attention_ref(*args, **kw), want, **tol(c["dtype"]))


# ------------------------------------------------------------------ FP8 KV cache
FP8 = torch.float8_e4m3fn


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes, to compare FP8 tensors exactly (torch.equal has no FP8 kernel everywhere)."""
    return t.view(torch.uint8) if t.dtype == FP8 else t


def dequantized_copy(c: dict) -> dict:
    """The case over a float32 pool holding what the FP8 pool's values mean (stored * scale)."""
    p = c["pool"]
    pool = TokenToKVPool(p.k[0].shape[0], 1, c["Hkv"], c["D"], torch.float32, DEV)
    pool.k[0].copy_(p.k[0].float() * p.k_scale[0])
    pool.v[0].copy_(p.v[0].float() * p.v_scale[0])
    return dict(c, pool=pool)


@pytest.mark.parametrize("mode", MODES)
def test_ref_reads_fp8_as_its_dequantized_values(mode):
    """The reference over an FP8 cache with scales equals it over the float values they stand for."""
    c = make_case(mode, 4, seed=100, kv_dtype=FP8)
    store_new_kv(c)
    args, kw = kernel_args(c)
    assert "k_scale" in kw
    f = dequantized_copy(c)
    args_f, kw_f = kernel_args(f)
    assert "k_scale" not in kw_f
    torch.testing.assert_close(ta.paged_attention_ref(*args, **kw),
                               ta.paged_attention_ref(*args_f, **kw_f))


@pytest.mark.parametrize("mode", ORACLE_MODES)
def test_ref_fp8_matches_torch_native(mode):
    c = make_case(mode, 4, cfg="gqa2_d24", seed=110, kv_dtype=FP8)
    fb = forward_batch(c)
    native = TorchNativeBackend(c["pool"], c["rt"], c["D"] ** -0.5)
    native.init_forward_metadata(fb)
    want = native.forward(c["q"], c["k"], c["v"], 0, fb)  # stores the new K/V quantized
    args, kw = kernel_args(c)
    torch.testing.assert_close(ta.paged_attention_ref(*args, **kw), want, **tol(c["dtype"]))


@needs_triton
@pytest.mark.parametrize("mode,page", one_page_each(MODES))
def test_kernel_matches_ref_fp8_kv(mode, page):
    """FP8 K/V tiles converted in the kernel and its scales applied: the reference's answer,
    in one split and in several."""
    assert_kernel_matches_ref(make_case(mode, page, cfg="smollm" if page == 1 else "gqa2_d24",
                                        seed=120 + page, kv_dtype=FP8), (1, 3))


@needs_triton
@pytest.mark.parametrize("dtype", [
    torch.float16,
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRETED, reason="Triton 3.6's interpreter gets bfloat16 dots wrong, FP8 or not")),
])
def test_kernel_fp8_kv_half_queries(dtype):
    c = make_case("verify", 16, seed=130, dtype=dtype, kv_dtype=FP8)
    store_new_kv(c)
    args, kw = kernel_args(c)
    got = ta.paged_attention(*args, **kw, num_kv_splits=1)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ta.paged_attention_ref(*args, **kw), atol=2e-2, rtol=2e-2)


@needs_triton
@pytest.mark.parametrize("mode", ["decode", "verify", "draft_decode"])
def test_backend_fp8_matches_torch_native(mode):
    """Both backends store K/V quantized and read them dequantized: the same answer, the same bytes."""
    c = make_case(mode, 16, seed=140, kv_dtype=FP8)
    pool_t = backends_agree(c, forward_batch(c))
    assert torch.equal(bits(pool_t.k[0]), bits(c["pool"].k[0]))
    assert torch.equal(bits(pool_t.v[0]), bits(c["pool"].v[0]))
