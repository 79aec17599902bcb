"""FlashInferBackend on a GPU (bf16) against TorchNativeBackend in fp32 on the same values.

(Named apart from tests/unit/test_flashinfer_backend.py: without __init__.py files pytest
cannot collect two test modules of one basename in one session.)

Kernel cases reuse tests/gpu/test_triton_backend.py's Case (scattered pages, page sizes
1 and 16, SmolLM2's 9/3 heads and a Llama-style 32/8): decode, extend over a cached prefix,
target verify with tree masks, draft decode with ancestor masks. Then the real GraphRunner
captures the backend (target decode, target verify, and a two-step draft decode whose
second mask is computed inside the graph) and replays padded and unpadded batches. Then
SmolLM2 greedy generation with flashinfer equals triton up to bf16 near-ties
(speculative-vs-plain and graphs-vs-eager with flashinfer: tests/gpu/test_gpu_engine.py).

First use JIT-compiles FlashInfer's kernels (about 20 s each for decode and FA2 prefill).
"""
from __future__ import annotations

import random

import pytest
import torch
from kestrel_testing import random_tree_mask
from test_gpu_engine import check_near_ties, run
from test_triton_backend import CONFIGS, MAX_CTX, TOL, Case

from actors.attention.flashinfer_metadata import full_mask, set_block_bits
from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner
from actors.worker.forward_batch import ForwardBatch, ForwardMode

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None
DEV = "cuda"


def _backend(case: Case, page: int):
    from actors.attention.flashinfer_backend import FlashInferBackend
    return FlashInferBackend(case.pool, case.rt, case.D ** -0.5, page_size=page)


def _check(case: Case, page: int) -> None:
    fb = case.forward_batch()
    want = case.oracle(fb)  # [T, H, D] fp32
    backend = _backend(case, page)
    backend.init_forward_metadata(fb)
    got = backend.forward(case.q, case.k, case.v, 0, fb)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **TOL)
    assert torch.equal(case.pool.k[0].float(), case.pool32.k[0])  # stored exactly the new K/V
    assert torch.equal(case.pool.v[0].float(), case.pool32.v[0])


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 7, 64])
def test_decode(B, page, cfg):
    _check(Case("decode", B, page, cfg, seed=B + page), page)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
def test_extend_with_cached_prefix(page, cfg):
    rng = random.Random(page)
    qlens = [rng.randint(1, 300) for _ in range(16)]
    prefix = [rng.randint(0, MAX_CTX - q) for q in qlens]
    _check(Case("extend", 16, page, cfg, seed=11, qlens=qlens, prefix=prefix), page)


@pytest.mark.parametrize("page", [1, 16])
def test_extend_long_prefill(page):
    _check(Case("extend", 1, page, "smollm", seed=12, qlens=[MAX_CTX], prefix=[0]), page)
    _check(Case("extend", 2, page, "smollm", seed=13, qlens=[1000, 37], prefix=[1048, 0]), page)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B,n", [(1, 8), (16, 8), (64, 8), (4, 64)])
def test_verifyrandom_tree_mask(B, n, page, cfg):
    _check(Case("verify", B, page, cfg, seed=B * n + page, n=n), page)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("step", [0, 1, 3])
def test_draft_decode_masks(step, B, page):
    _check(Case("draft_decode", B, page, "smollm", seed=step * 100 + B, K=4, step=step), page)


def test_mask_bits_match_segment_packbits():
    """Our reading of FlashInfer's packed mask layout, on the device: the placeholder
    packed by flashinfer.segment_packbits plus set_block_bits equals the full mask packed
    by it (this is what a graph-captured forward relies on)."""
    rng = random.Random(0)
    B, q, E = 6, 8, 8
    prefix = torch.tensor([0, 1, 3, 7, 100, 2000])
    custom = torch.stack([random_tree_mask(q, rng) for _ in range(B)]).to(DEV)
    sizes = (q * (prefix + E)).tolist()
    indptr = torch.zeros(B + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(sizes), 0)
    indptr = indptr.to(DEV)
    hidden = full_mask(prefix, [q] * B, [E] * B, None, DEV)
    packed, byte_indptr = flashinfer.segment_packbits(hidden, indptr, bitorder="little")
    set_block_bits(packed, byte_indptr, prefix.to(DEV), custom)
    want, want_indptr = flashinfer.segment_packbits(full_mask(prefix, [q] * B, [E] * B, custom, DEV),
                                                    indptr, bitorder="little")
    assert torch.equal(byte_indptr, want_indptr)
    assert torch.equal(packed, want)


# -------------------------------------------------------------------------- CUDA graphs
class GraphHarness:
    """A GraphRunner over FlashInferBackend with static q/k/v buffers (W tokens per lane)."""

    SIZES = (1, 4, 8)

    def __init__(self, kind: GraphKind, page: int, W: int, K: int = 4):
        self.kind, self.W, self.K, self.page = kind, W, K, page
        mode = {GraphKind.TARGET_DECODE: "decode", GraphKind.TARGET_VERIFY: "verify",
                GraphKind.DRAFT_DECODE: "decode"}[kind]
        self.case = Case(mode, max(self.SIZES), page, "smollm", seed=21, n=W)
        c = self.case
        self.backend = _backend(c, page)
        self.steps = 2 if kind == GraphKind.DRAFT_DECODE else 1
        L = self.steps * W if kind == GraphKind.DRAFT_DECODE else W
        self.runner = GraphRunner(kind, self.SIZES, self.backend, width=W, slots_per_req=L,
                                  topk=K, hidden_size=8, mask_width=W, device=DEV)
        M = max(self.SIZES) * W
        self.qkv = [(torch.zeros(M, c.H, c.D, dtype=torch.bfloat16, device=DEV),
                     torch.zeros(M, c.Hkv, c.D, dtype=torch.bfloat16, device=DEV),
                     torch.zeros(M, c.Hkv, c.D, dtype=torch.bfloat16, device=DEV))
                    for _ in range(self.steps)]
        with torch.inference_mode():
            self.runner.capture(self.forward)

    def forward(self, view, backend=None, qkv=None) -> torch.Tensor:
        """The captured body (and, with a raw batch and its own q/k/v, the eager one)."""
        backend, qkv = backend or self.backend, qkv or self.qkv
        bs, W = view.batch_size, self.W
        T = bs * W
        if self.kind == GraphKind.TARGET_DECODE:
            fb = ForwardBatch(ForwardMode.DECODE, view.input_ids, view.positions, view.out_cache_loc,
                              view.req_pool_indices, view.seq_lens - 1, [1] * bs)
        elif self.kind == GraphKind.TARGET_VERIFY:
            fb = ForwardBatch(ForwardMode.TARGET_VERIFY, view.input_ids, view.positions,
                              view.out_cache_loc, view.req_pool_indices, view.seq_lens, [W] * bs,
                              custom_mask=view.custom_mask)
        else:
            return self._draft_forward(view, backend, qkv)
        backend.init_forward_metadata(fb)
        q, k, v = (t[:T] for t in qkv[0])
        return backend.forward(q, k, v, 0, fb)

    def _draft_forward(self, view, backend, qkv) -> torch.Tensor:
        """Two draft-decode steps as EagleWorker._draft forms them; step 1's ancestor mask
        comes from a gather on the top-k ids, i.e. from data only the graph sees."""
        bs, K = view.batch_size, self.K
        scratch = view.out_cache_loc.view(bs, self.steps * K)
        anc = torch.zeros(bs, K, 0, dtype=torch.bool, device=DEV)
        eye = torch.eye(K, dtype=torch.bool, device=DEV).expand(bs, K, K)
        outs = []
        for i in range(self.steps):
            cols = (i + 1) * K
            mask = torch.cat([anc, eye], dim=2)  # [bs, K, cols]
            fb = ForwardBatch(ForwardMode.DECODE, view.input_ids, view.positions,
                              scratch[:, i * K:cols].reshape(-1), view.req_pool_indices,
                              view.seq_lens, [K] * bs, new_kv_slots=scratch[:, :cols], custom_mask=mask)
            backend.init_forward_metadata(fb)
            q, k, v = (t[:bs * K] for t in qkv[i])
            outs.append(backend.forward(q, k, v, 0, fb).view(bs, K, *q.shape[1:]))
            parent = view.topk_index % K  # [bs, K] parent lane of each new lane
            anc = mask.gather(1, parent[:, :, None].expand(bs, K, cols))
        return torch.stack(outs, 1)  # [bs, steps, K, H, D]

    def raw_batch(self, raw: int, seed: int):
        """A batch of `raw` requests on rows 1..8, with fresh lengths, masks and q/k/v."""
        rng = random.Random(seed)
        gen = torch.Generator(device=DEV).manual_seed(seed)
        c, W, L = self.case, self.W, self.runner.slots_per_req
        rows = torch.tensor(rng.sample(range(1, max(self.SIZES) + 1), raw), device=DEV)
        prefix = torch.tensor([rng.randint(1, MAX_CTX - L) for _ in range(raw)], device=DEV)
        table = c.rt.req_to_token
        loc = table[rows[:, None], prefix[:, None] + torch.arange(L, device=DEV)].reshape(-1)
        seq = prefix + 1 if self.kind == GraphKind.TARGET_DECODE else prefix
        mask = topk_p = topk_index = hidden = None
        if self.kind == GraphKind.TARGET_VERIFY:
            mask = torch.stack([random_tree_mask(W, rng) for _ in range(raw)]).to(DEV)
        if self.kind == GraphKind.DRAFT_DECODE:
            topk_p = torch.rand(raw, self.K, device=DEV, generator=gen)
            topk_index = torch.randint(0, 1000, (raw, self.K), device=DEV, generator=gen)
            hidden = torch.zeros(raw, 8, device=DEV)
        qkv = [tuple(torch.randn(raw * W, h, c.D, device=DEV, generator=gen).bfloat16()
                     for h in (c.H, c.Hkv, c.Hkv)) for _ in range(self.steps)]
        ids = torch.zeros(raw * W, dtype=torch.int64, device=DEV)
        batch = GraphBatch(raw, ids, ids.clone(), loc, rows, seq, seq_lens_cpu=seq.cpu(),
                           seq_lens_sum=int(seq.sum()), width=W, topk_p=topk_p,
                           topk_index=topk_index, hidden=hidden, custom_mask=mask)
        return batch, qkv

    def replay(self, batch, qkv):
        n = batch.batch_size * self.W
        for static, fresh in zip(self.qkv, qkv):
            for dst, src in zip(static, fresh):
                dst[:n].copy_(src)
                dst[n:].zero_()
        return self.runner.replay(batch)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("kind,W", [(GraphKind.TARGET_DECODE, 1), (GraphKind.TARGET_VERIFY, 8),
                                    (GraphKind.DRAFT_DECODE, 4)])
def test_graph_replay_equals_eager(kind, W, page):
    """Replays at raw sizes 3 (padded to 4), 4, 8 and 1, each on fresh rows, lengths, masks
    and q/k/v, equal the eager backend (checked against the oracle above) on the raw batch."""
    h = GraphHarness(kind, page, W)
    eager = _backend(h.case, page)  # its own plans; same pools
    for trial, raw in enumerate([3, 4, 8, 1, 3]):
        batch, qkv = h.raw_batch(raw, seed=100 + trial)
        with torch.inference_mode():
            got = h.replay(batch, qkv).clone()
            assert batch.batch_size == raw and batch.seq_lens_sum == int(batch.seq_lens.sum())
            want = h.forward(batch, backend=eager, qkv=qkv)
        assert got.shape == want.shape
        torch.testing.assert_close(got.float(), want.float(), **TOL)


# --------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("page", [1, 16])
def test_smollm_greedy_flashinfer_equals_triton(tokenizer, chat_prompts, fp32_ref, page):
    pages = f"kv_cache.page_size={page}"
    ref = run(tokenizer, chat_prompts, "attention.backend=triton", pages)
    got = run(tokenizer, chat_prompts, "attention.backend=flashinfer", pages)
    n = check_near_ties(fp32_ref, chat_prompts, got, ref)
    print(f"flashinfer vs triton, page {page}: {n}/{len(chat_prompts)} diverged, all at near-ties")


def test_float32_is_refused_with_the_setting_named():
    from actors.worker.kv_cache import ReqToTokenPool, TokenToKVPool
    from actors.worker.rank_worker import make_backend
    kv = TokenToKVPool(64, 1, 2, 64, torch.float32, "cuda")
    with pytest.raises(ValueError, match="model.dtype"):
        make_backend("flashinfer", kv, ReqToTokenPool(4, 32, "cuda"), 1.0, page_size=16)
