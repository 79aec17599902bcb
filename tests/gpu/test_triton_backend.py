"""TritonBackend on a GPU in bf16 against TorchNativeBackend run in fp32 on the same values.

Modes: decode, extend over a cached prefix (ragged chunks, and one long prefill), target
verify with tree masks, draft decode with ancestor masks over the scratch window. Page
sizes 1 and 16 (pages scattered over the pool), B up to 64, contexts up to 2048, SmolLM2's
head layout (9 q / 3 kv heads, D=64) and a Llama-style one (32 / 8, D=128). Then a CUDA
graph of metadata + forward, captured once and replayed on fresh inputs, equals eager.
"""
from __future__ import annotations

import random

import pytest
import torch
from kestrel_testing import random_draft_mask, random_tree_mask

from actors.attention.torch_native import TorchNativeBackend
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.worker.kv_cache import ReqToTokenPool, TokenToKVPool

DEV = "cuda"
CONFIGS = {"smollm": (9, 3, 64), "llama": (32, 8, 128)}  # H, Hkv, D
MAX_CTX = 2048
# bf16 inputs are exact in fp32; what differs is bf16 P in the PV product and bf16 output.
TOL = dict(atol=4e-3, rtol=1.6e-2)


def _backend_cls():
    # Imported here, not at module level: collecting this file on a CPU-only machine must
    # not import triton before the unit tests switch on its interpreter.
    import kestrel_kernels.triton_attention as ta
    from actors.attention.triton_backend import TritonBackend

    if type(ta._paged_attn_kernel).__name__ == "InterpretedFunction":
        pytest.skip("TRITON_INTERPRET=1: the kernels are not compiled for the GPU")
    return TritonBackend


def paged_forward_batch(case, loc: torch.Tensor) -> ForwardBatch:
    """The ForwardBatch of a case (mode, rt, rows, prefix, E, qlens, masks) writing `loc`:
    new_kv_slots for draft decode only, the case's masks when it has them."""
    table, rows = case.rt.req_to_token, case.rows.tolist()
    positions = torch.cat([torch.arange(p + e - n, p + e, device=DEV)
                           for p, e, n in zip(case.prefix, case.E, case.qlens)])
    new_kv = None
    if case.mode == "draft_decode":
        new_kv = torch.stack([table[r, p:p + e] for r, p, e in zip(rows, case.prefix, case.E)])
    mask = torch.stack(case.masks).to(DEV) if case.masks is not None else None
    mode = ForwardMode.DECODE if case.mode in ("decode", "draft_decode") else ForwardMode.EXTEND
    return ForwardBatch(mode, torch.zeros(sum(case.qlens), dtype=torch.int64, device=DEV),
                        positions, loc, case.rows.clone(),
                        torch.tensor(case.prefix, dtype=torch.int64, device=DEV),
                        list(case.qlens), new_kv_slots=new_kv, custom_mask=mask)


class Case:
    """Paged pools (bf16 for Triton, an fp32 copy for the oracle) and one forward's inputs."""

    def __init__(self, mode: str, B: int, page: int, cfg: str, seed: int, *,
                 qlens: list[int] | None = None, prefix: list[int] | None = None,
                 n: int = 8, K: int = 4, step: int = 0):
        rng = random.Random(seed)
        gen = torch.Generator(device=DEV).manual_seed(seed)
        self.H, self.Hkv, self.D = CONFIGS[cfg]
        self.mode, self.B = mode, B
        masks = None
        if mode == "decode":
            qlens, E = [1] * B, [1] * B
        elif mode == "extend":
            E = list(qlens)
        elif mode == "verify":
            qlens, E = [n] * B, [n] * B
            masks = [random_tree_mask(n, rng) for _ in range(B)]
        elif mode == "draft_decode":
            qlens, E = [K] * B, [(step + 1) * K] * B
            masks = [random_draft_mask(K, step, rng) for _ in range(B)]
        else:
            raise ValueError(mode)
        if prefix is None:
            prefix = [rng.randint(0, MAX_CTX - e) for e in E]
        self.qlens, self.E, self.prefix = qlens, E, prefix
        # Paged table: every request owns ceil(MAX_CTX/page) pages drawn at random from the
        # pool (page 0 reserved), so positions are contiguous only inside a page.
        ppr = -(-MAX_CTX // page)
        num_pages = B * ppr + 2
        pages = torch.randperm(num_pages - 1, device=DEV, generator=gen)[:B * ppr] + 1
        pos = torch.arange(ppr * page, device=DEV)
        self.rt = ReqToTokenPool(B + 1, ppr * page, DEV)
        self.rt.req_to_token[1:] = (pages.view(B, ppr)[:, pos // page] * page + pos % page)
        self.rows = torch.randperm(B, device=DEV, generator=gen) + 1  # [B] int64, row 0 unused
        S = num_pages * page
        self.pool = TokenToKVPool(S, 1, self.Hkv, self.D, torch.bfloat16, DEV)
        self.pool.k[0].copy_(torch.randn(S, self.Hkv, self.D, device=DEV, generator=gen))
        self.pool.v[0].copy_(torch.randn(S, self.Hkv, self.D, device=DEV, generator=gen))
        self.pool32 = TokenToKVPool(S, 1, self.Hkv, self.D, torch.float32, DEV)
        self.pool32.k[0].copy_(self.pool.k[0])
        self.pool32.v[0].copy_(self.pool.v[0])
        T = sum(qlens)
        self.q = torch.randn(T, self.H, self.D, device=DEV, generator=gen).bfloat16()  # [T,H,D]
        # New keys lean towards their own query group: a hot diagonal (weight ~5% of a
        # 2048-key softmax) so a one-key visibility error shows above bf16 rounding.
        G = self.H // self.Hkv
        q_group = self.q.float().view(T, self.Hkv, G, self.D).mean(2)  # [T, Hkv, D] fp32
        self.k = (torch.randn(T, self.Hkv, self.D, device=DEV, generator=gen)
                  + 2.0 * q_group).bfloat16()  # [T, Hkv, D] bf16
        self.v = torch.randn(T, self.Hkv, self.D, device=DEV, generator=gen).bfloat16()
        self.masks = masks

    def forward_batch(self) -> ForwardBatch:
        """As the workers build it; the q_b tokens written are the newest q_b new keys."""
        table, rows = self.rt.req_to_token, self.rows.tolist()
        loc = torch.cat([table[r, p + e - n:p + e]
                         for r, p, e, n in zip(rows, self.prefix, self.E, self.qlens)])
        return paged_forward_batch(self, loc)

    def oracle(self, fb: ForwardBatch) -> torch.Tensor:
        native = TorchNativeBackend(self.pool32, self.rt, self.D ** -0.5)
        native.init_forward_metadata(fb)
        return native.forward(self.q.float(), self.k.float(), self.v.float(), 0, fb)


def _check(case: Case, num_kv_splits: int | None = None) -> None:
    fb = case.forward_batch()
    want = case.oracle(fb)  # [T, H, D] fp32
    backend = _backend_cls()(case.pool, case.rt, case.D ** -0.5, num_kv_splits=num_kv_splits)
    backend.init_forward_metadata(fb)
    got = backend.forward(case.q, case.k, case.v, 0, fb)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want, **TOL)
    # The backend stored exactly the new tokens' K/V.
    assert torch.equal(case.pool.k[0].float(), case.pool32.k[0])
    assert torch.equal(case.pool.v[0].float(), case.pool32.v[0])


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 7, 64])
def test_decode(B, page, cfg):
    _check(Case("decode", B, page, cfg, seed=B + page))


def test_decode_long_context_split_counts():
    """One context of exactly MAX_CTX keys, every split count from none to many."""
    case = Case("decode", 2, 16, "smollm", seed=3, prefix=[MAX_CTX - 1, 5])
    for splits in (1, 2, 7, 16):
        _check(case, num_kv_splits=splits)


def _compiled_variants(kernel) -> int:
    """Compiled specializations of a Triton kernel on this device, whatever the cache's
    layout in this Triton version (a dict per device, or a tuple holding one)."""
    caches = getattr(kernel, "device_caches", None) or getattr(kernel, "cache", {})
    n = 0
    for entry in caches.values():
        first = entry[0] if isinstance(entry, tuple) else entry
        n += len(first)
    return n


def test_a_new_split_count_compiles_no_new_kernel():
    """Split counts follow the batch's shape: as a compile-time constant each new one
    compiled the kernel again (0.5-1 s in front of a batch's first tokens)."""
    from kestrel_kernels import triton_attention as ta
    case = Case("decode", 2, 16, "smollm", seed=5, prefix=[300, 40])
    _check(case, num_kv_splits=2)
    before = (_compiled_variants(ta._paged_attn_kernel), _compiled_variants(ta._merge_splits_kernel))
    for splits in (3, 5, 11, 16):
        _check(case, num_kv_splits=splits)
    after = (_compiled_variants(ta._paged_attn_kernel), _compiled_variants(ta._merge_splits_kernel))
    assert after == before, (before, after)


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
def test_extend_with_cached_prefix(page, cfg):
    rng = random.Random(page)
    B = 16
    qlens = [rng.randint(1, 300) for _ in range(B)]
    prefix = [rng.randint(0, MAX_CTX - q) for q in qlens]
    _check(Case("extend", B, page, cfg, seed=11, qlens=qlens, prefix=prefix))


@pytest.mark.parametrize("page", [1, 16])
def test_extend_long_prefill(page):
    _check(Case("extend", 1, page, "smollm", seed=12, qlens=[MAX_CTX], prefix=[0]))
    _check(Case("extend", 2, page, "smollm", seed=13, qlens=[1000, 37], prefix=[1048, 0]))


@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B,n", [(1, 8), (16, 8), (64, 8), (4, 64), (64, 64)])
def test_verifyrandom_tree_mask(B, n, page, cfg):
    _check(Case("verify", B, page, cfg, seed=B * n + page, n=n))


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("B", [1, 8, 64])
@pytest.mark.parametrize("step", [0, 1, 3])
def test_draft_decode_masks(step, B, page):
    _check(Case("draft_decode", B, page, "smollm", seed=step * 100 + B, K=4, step=step))


# -------------------------------------------------------------------------- CUDA graphs
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_cuda_graph_replay_equals_eager(mode):
    """Metadata + store + attention captured once on static inputs; each replay on fresh
    rows, lengths, masks and q/k/v equals the eager forward bit for bit, and the oracle."""
    B, n = 16, 8
    case = Case(mode, B, 16, "smollm", seed=21, n=n)
    fb = case.forward_batch()  # its tensors are the graph's static inputs
    q_s, k_s, v_s = case.q.clone(), case.k.clone(), case.v.clone()
    backend = _backend_cls()(case.pool, case.rt, case.D ** -0.5)

    def step() -> torch.Tensor:
        backend.init_forward_metadata(fb)
        return backend.forward(q_s, k_s, v_s, 0, fb)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):  # compile the kernels outside the capture
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = step()

    for trial in range(3):
        fresh = Case(mode, B, 16, "smollm", seed=100 + trial, n=n)
        # Same table and pools; new rows, prefixes, masks and tokens.
        fresh.rt, fresh.pool, fresh.pool32 = case.rt, case.pool, case.pool32
        new = fresh.forward_batch()
        for name in ("out_cache_loc", "req_pool_indices", "prefix_lens", "positions"):
            getattr(fb, name).copy_(getattr(new, name))
        if fb.custom_mask is not None:
            fb.custom_mask.copy_(new.custom_mask)
        for dst, src in ((q_s, fresh.q), (k_s, fresh.k), (v_s, fresh.v)):
            dst.copy_(src)
        graph.replay()
        got = out_s.clone()
        want = step()  # eager, same inputs (re-stores the same K/V)
        assert torch.equal(got, want)
        fresh.q, fresh.k, fresh.v = q_s, k_s, v_s
        case.pool32.k[0].copy_(case.pool.k[0])  # the oracle's pool gets the stored K/V
        case.pool32.v[0].copy_(case.pool.v[0])
        torch.testing.assert_close(got.float(), fresh.oracle(new), **TOL)
