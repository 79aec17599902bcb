"""The FP8 KV cache (kv_cache.dtype=fp8_e4m3) on a GPU: the compiled Triton kernel reading
E4M3 K/V tiles against paged_attention_ref on the same cache, with K scale 0.5 and V scale 2
(a reader that skips a scale is off by that factor), in bf16 and fp32 queries.

Modes: decode, extend over a cached prefix, tree verify, draft decode with ancestor masks;
page sizes 1 and 16 with pages scattered over the pool, B up to 64, contexts up to 2048,
SmolLM2's head layout (9 q / 3 kv heads, D=64) and a Llama-style one (32 / 8, D=128). Then
the Triton backend against the torch backend over FP8 pools (the store on the device), the
move of accepted slots, and a captured launch that reads the scales at replay.
"""
from __future__ import annotations

import random

import pytest
import torch
from kestrel_testing import random_draft_mask, random_tree_mask
from test_triton_backend import paged_forward_batch

from actors.attention.torch_native import TorchNativeBackend
from actors.worker.forward_batch import ForwardBatch
from actors.worker.kv_cache import ReqToTokenPool, TokenToKVPool

DEV = "cuda"
FP8 = torch.float8_e4m3fn
CONFIGS = {"smollm": (9, 3, 64), "llama": (32, 8, 128)}  # H, Hkv, D
MAX_CTX = 2048
K_SCALE, V_SCALE = 0.5, 2.0
# Dequantized K/V are exact in the query dtype and the scales apply in fp32: bf16 differs
# from the fp32 reference by bf16 P in the PV product and the bf16 output, as without FP8.
TOL = {torch.bfloat16: dict(atol=4e-3, rtol=1.6e-2), torch.float32: dict(atol=2e-4, rtol=2e-4)}


def _kernels():
    # Imported here, not at module level: collecting this file on a CPU-only machine must
    # not import triton before the unit tests switch on its interpreter.
    import kestrel_kernels.triton_attention as ta

    if type(ta._paged_attn_kernel).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET=1: the kernels are not compiled for the GPU")
    return ta


class Case:
    """An FP8 pool (every slot stored through TokenToKVPool.store), a paged table, one
    forward's queries and new K/V (not yet stored)."""

    def __init__(self, mode: str, B: int, page: int, cfg: str, seed: int,
                 q_dtype: torch.dtype = torch.bfloat16, n: int = 8, K: int = 4, step: int = 2):
        rng = random.Random(seed)
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.H, self.Hkv, self.D = CONFIGS[cfg]
        self.mode, self.B = mode, B
        self.masks = None
        if mode == "decode":
            qlens, E = [1] * B, [1] * B
        elif mode == "extend":
            qlens = [rng.randint(1, 300) for _ in range(B)]
            E = list(qlens)
        elif mode == "verify":
            qlens, E = [n] * B, [n] * B
            self.masks = [random_tree_mask(n, rng) for _ in range(B)]
        elif mode == "draft_decode":
            qlens, E = [K] * B, [(step + 1) * K] * B
            self.masks = [random_draft_mask(K, step, rng) for _ in range(B)]
        else:
            raise ValueError(mode)
        self.qlens, self.E = qlens, E
        self.prefix = [rng.randint(0, MAX_CTX - e) for e in E]
        ppr = -(-MAX_CTX // page)
        num_pages = B * ppr + 2
        pages = torch.randperm(num_pages - 1, device=DEV, generator=gen)[:B * ppr] + 1
        pos = torch.arange(ppr * page, device=DEV)
        self.rt = ReqToTokenPool(B + 1, ppr * page, DEV)
        self.rt.req_to_token[1:] = pages.view(B, ppr)[:, pos // page] * page + pos % page
        self.rows = torch.randperm(B, device=DEV, generator=gen) + 1  # [B] int64, row 0 unused
        S = num_pages * page
        self.pool = self.new_pool(S)
        self.pool.store(0, torch.arange(S, device=DEV),
                        torch.randn(S, self.Hkv, self.D, device=DEV, generator=gen),
                        torch.randn(S, self.Hkv, self.D, device=DEV, generator=gen))
        T = sum(qlens)
        self.q = torch.randn(T, self.H, self.D, device=DEV, generator=gen).to(q_dtype)  # [T, H, D]
        # New keys lean towards their own query group: a hot diagonal, so a one-key
        # visibility error shows above the roundings.
        G = self.H // self.Hkv
        q_group = self.q.float().view(T, self.Hkv, G, self.D).mean(2)  # [T, Hkv, D] fp32
        self.k = (torch.randn(T, self.Hkv, self.D, device=DEV, generator=gen)
                  + 2.0 * q_group).to(q_dtype)  # [T, Hkv, D]
        self.v = torch.randn(T, self.Hkv, self.D, device=DEV, generator=gen).to(q_dtype)
        table, rows = self.rt.req_to_token, self.rows.tolist()
        self.loc = torch.cat([table[r, p + e - m:p + e]
                              for r, p, e, m in zip(rows, self.prefix, self.E, self.qlens)])

    def new_pool(self, slots: int) -> TokenToKVPool:
        pool = TokenToKVPool(slots, 1, self.Hkv, self.D, FP8, DEV)
        pool.k_scale_all.fill_(K_SCALE)
        pool.v_scale_all.fill_(V_SCALE)
        return pool

    def kernel_args(self) -> tuple[tuple, dict]:
        """paged_attention(_ref) arguments, the new K/V stored first."""
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=DEV)  # noqa: E731
        self.pool.store(0, self.loc, self.k, self.v)
        qo = [0]
        for m in self.qlens:
            qo.append(qo[-1] + m)
        kw = dict(scale=self.D ** -0.5, k_scale=self.pool.k_scale[0], v_scale=self.pool.v_scale[0])
        if self.masks is not None:
            kw["custom_mask"] = torch.cat([m.reshape(-1) for m in self.masks]).to(DEV)
            sizes = [m.numel() for m in self.masks]
            kw["mask_indptr"] = t([sum(sizes[:i]) for i in range(len(sizes) + 1)])
        args = (self.q, self.pool.k[0], self.pool.v[0], self.rt.req_to_token, self.rows,
                t(self.prefix), t(self.E), t(qo), max(self.qlens))
        return args, kw

    def forward_batch(self) -> ForwardBatch:
        return paged_forward_batch(self, self.loc)


def _check_kernel(case: Case, num_kv_splits: int | None = None) -> None:
    ta = _kernels()
    args, kw = case.kernel_args()
    want = ta.paged_attention_ref(*args, **kw)  # [T, H, D] q dtype, from fp32
    got = ta.paged_attention(*args, **kw, num_kv_splits=num_kv_splits)
    assert got.dtype == case.q.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), **TOL[case.q.dtype])


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 7, 64])
def test_decode(B, page, cfg, q_dtype):
    _check_kernel(Case("decode", B, page, cfg, seed=B + page, q_dtype=q_dtype))


def test_decode_split_counts():
    case = Case("decode", 2, 16, "smollm", seed=3)
    for splits in (1, 2, 7, 16):
        _check_kernel(case, num_kv_splits=splits)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
def test_extend_with_cached_prefix(page, cfg, q_dtype):
    _check_kernel(Case("extend", 16, page, cfg, seed=11 + page, q_dtype=q_dtype))


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B,n", [(1, 8), (64, 8), (4, 64)])
def test_verify_tree_masks(B, n, page, cfg):
    _check_kernel(Case("verify", B, page, cfg, seed=B * n + page, n=n))


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 64])
def test_draft_decode_masks(B, page):
    _check_kernel(Case("draft_decode", B, page, "smollm", seed=100 + B, step=3))


@pytest.mark.parametrize("mode", ["decode", "extend", "verify", "draft_decode"])
def test_backend_matches_torch_native_over_fp8_pools(mode):
    """Each backend stores the new K/V quantized on the device and attends: the Triton
    backend and the torch one agree, and write the same bytes."""
    from actors.attention.triton_backend import TritonBackend

    _kernels()
    case = Case(mode, 8, 16, "smollm", seed=200)
    fb = case.forward_batch()
    twin = case.new_pool(case.pool.k[0].shape[0])
    twin.k_all.view(torch.uint8).copy_(case.pool.k_all.view(torch.uint8))
    twin.v_all.view(torch.uint8).copy_(case.pool.v_all.view(torch.uint8))
    native = TorchNativeBackend(twin, case.rt, case.D ** -0.5)
    native.init_forward_metadata(fb)
    want = native.forward(case.q.float(), case.k.float(), case.v.float(), 0, fb)  # [T, H, D] fp32
    backend = TritonBackend(case.pool, case.rt, case.D ** -0.5)
    backend.init_forward_metadata(fb)
    got = backend.forward(case.q, case.k, case.v, 0, fb)
    torch.testing.assert_close(got.float(), want, **TOL[torch.bfloat16])
    assert torch.equal(case.pool.k_all.view(torch.uint8), twin.k_all.view(torch.uint8))
    assert torch.equal(case.pool.v_all.view(torch.uint8), twin.v_all.view(torch.uint8))


def test_move_copies_stored_bytes_on_the_device():
    pool = TokenToKVPool(64, 3, 2, 16, FP8, DEV)
    for layer in range(3):
        pool.store(layer, torch.arange(64, device=DEV), torch.randn(64, 2, 16, device=DEV),
                   torch.randn(64, 2, 16, device=DEV))
    before = pool.k_all.view(torch.uint8).clone()  # [3, 64, 2, 16] uint8
    src, dst = torch.tensor([1, 2, 5], device=DEV), torch.tensor([2, 1, 9], device=DEV)
    pool.move(src, dst)
    after = pool.k_all.view(torch.uint8)
    assert torch.equal(after[:, [2, 1, 9]], before[:, [1, 2, 5]])
    assert torch.equal(after[:, 0], before[:, 0])


def test_a_captured_launch_reads_the_scales_at_replay():
    """Scales are device tensors: a graph captured at one scale, replayed after the pool's
    scales change, answers for the new scales (calibrated scales need no recapture)."""
    ta = _kernels()
    case = Case("verify", 4, 16, "smollm", seed=300)
    args, kw = case.kernel_args()
    out = torch.empty_like(case.q)
    ta.paged_attention(*args, **kw, num_kv_splits=4, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.paged_attention(*args, **kw, num_kv_splits=4, out=out)
    for k_scale, v_scale in ((K_SCALE, V_SCALE), (0.25, 3.0)):
        case.pool.k_scale_all.fill_(k_scale)
        case.pool.v_scale_all.fill_(v_scale)
        graph.replay()
        torch.testing.assert_close(out.float(), ta.paged_attention_ref(*args, **kw).float(),
                                   **TOL[torch.bfloat16])
