"""The CPU-side parts of the FlashInfer backend against straightforward references: page
tables from req_to_token, the full-rectangle custom mask and its packed bits, the replay
prefix rules, and the error that names the setting when FlashInfer cannot run here."""
from __future__ import annotations

import random
import sys

import numpy as np
import pytest
import torch

from actors.attention.flashinfer_metadata import full_mask, page_table, set_block_bits
from actors.worker.forward_batch import ForwardMode
from actors.worker.kv_cache import ReqToTokenPool, TokenToKVPool


def paged_table(rows: int, width: int, page: int, seed: int) -> torch.Tensor:
    """[rows, width] int64: each row a random set of whole pages (page 0 never used)."""
    gen = torch.Generator().manual_seed(seed)
    ppr = width // page
    pages = torch.randperm(rows * ppr, generator=gen) + 1
    pos = torch.arange(width)
    return pages.view(rows, ppr)[:, pos // page] * page + pos % page


@pytest.mark.parametrize("page", [1, 4, 16])
def test_page_table_matches_a_loop_and_addresses_every_key(page):
    rng = random.Random(page)
    table = paged_table(9, 64, page, seed=page)
    rows = torch.tensor([3, 1, 8, 5, 2])
    kv = torch.tensor([1, page, page + 1, 64, rng.randint(1, 64)])
    indptr, indices, last = page_table(table, rows, kv, page)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    want_ptr, want_idx, want_last = [0], [], []
    for r, n in zip(rows.tolist(), kv.tolist()):
        pages = -(-n // page)
        want_idx += [int(table[r, j * page]) // page for j in range(pages)]
        want_ptr.append(want_ptr[-1] + pages)
        want_last.append(n - (pages - 1) * page)
    assert indptr.tolist() == want_ptr
    assert indices.tolist() == want_idx
    assert last.tolist() == want_last
    # FlashInfer's reading of the table: key j of request b is slot
    # indices[indptr[b] + j // P] * P + j % P, which must be req_to_token[row_b, j].
    for b, (r, n) in enumerate(zip(rows.tolist(), kv.tolist())):
        for j in range(n):
            assert int(indices[indptr[b] + j // page]) * page + j % page == int(table[r, j])
        assert 1 <= last[b] <= page


def ref_full_mask(prefix, qlens, new, custom):
    out = []
    for b, (p, q, e) in enumerate(zip(prefix, qlens, new)):
        m = torch.zeros(q, p + e, dtype=torch.bool)
        m[:, :p] = True
        if custom is not None:
            m[:, p:] = custom[b, :q, :e]
        out.append(m.reshape(-1))
    return torch.cat(out)


def ref_packed(flat: torch.Tensor, sizes: list[int]):
    """flashinfer.segment_packbits(..., bitorder="little"): byte-aligned segments."""
    chunks, indptr, at = [], [0], 0
    for n in sizes:
        seg = np.packbits(flat[at:at + n].numpy().astype(np.uint8), bitorder="little")
        chunks.append(torch.from_numpy(seg.copy()))
        indptr.append(indptr[-1] + len(seg))
        at += n
    return torch.cat(chunks), torch.tensor(indptr, dtype=torch.int32)


def tree_masks(B: int, q: int, E: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    m = torch.rand(B, q, E, generator=gen) < 0.5
    m[:, :, -q:] |= torch.eye(q, dtype=torch.bool)  # a node always sees itself
    return m


def test_full_mask_uniform_and_ragged():
    prefix = [0, 5, 13, 2]
    custom = tree_masks(4, 6, 6, seed=1)
    got = full_mask(torch.tensor(prefix), [6] * 4, [6] * 4, custom, "cpu")
    assert torch.equal(got, ref_full_mask(prefix, [6] * 4, [6] * 4, custom))
    # Ragged requests cut their block out of a wider mask.
    qlens, new = [1, 6, 3, 2], [4, 6, 5, 2]
    got = full_mask(torch.tensor(prefix), qlens, new, custom, "cpu")
    assert torch.equal(got, ref_full_mask(prefix, qlens, new, custom))
    # The placeholder a replay plans with: prefix visible, block hidden.
    got = full_mask(torch.tensor(prefix), [6] * 4, [6] * 4, None, "cpu")
    assert torch.equal(got, ref_full_mask(prefix, [6] * 4, [6] * 4, None))


@pytest.mark.parametrize("q,E", [(1, 1), (4, 4), (4, 12), (8, 8)])
def test_block_bits_complete_the_placeholder(q, E):
    """Placeholder packed as FlashInfer packs it + set_block_bits == the full mask packed:
    also where rows share a byte (short prefixes) and segments end mid-byte."""
    prefix = [0, 1, 3, 7, 30]
    B = len(prefix)
    custom = tree_masks(B, q, E, seed=q * E)
    sizes = [q * (p + E) for p in prefix]
    placeholder = full_mask(torch.tensor(prefix), [q] * B, [E] * B, None, "cpu")
    packed, indptr = ref_packed(placeholder, sizes)
    packed = torch.cat([packed, torch.zeros(5, dtype=torch.uint8)])  # buffer tail: untouched
    set_block_bits(packed, indptr, torch.tensor(prefix), custom)
    want, want_indptr = ref_packed(ref_full_mask(prefix, [q] * B, [E] * B, custom), sizes)
    assert torch.equal(packed[:len(want)], want)
    assert torch.equal(indptr, want_indptr)
    assert not packed[len(want):].any()


def test_block_bits_clamp_a_negative_prefix():
    """A padded draft-extend lane's prefix (FILL - N) counts as empty, as in the plan."""
    custom = tree_masks(2, 3, 3, seed=5)
    prefix = torch.tensor([-2, 4])
    sizes = [3 * 3, 3 * 7]
    packed, indptr = ref_packed(full_mask(prefix.clamp(min=0), [3, 3], [3, 3], None, "cpu"), sizes)
    set_block_bits(packed, indptr, prefix, custom)
    want, _ = ref_packed(ref_full_mask([0, 4], [3, 3], [3, 3], custom), sizes)
    assert torch.equal(packed, want)


def test_replay_prefix_by_kind():
    """The replay hook turns the runner's seq_lens into prefixes per kind (FILL=1 lanes
    clamp at 0): target decode counts the decoded token, draft extend its N tokens (C09),
    target verify and draft decode the committed tokens."""
    from actors.attention.flashinfer_backend import FlashInferBackend as FB
    seq = torch.tensor([10, 11, 1, 1])
    assert FB._replay_prefix((ForwardMode.DECODE, False), seq, 1).tolist() == [9, 10, 0, 0]
    assert FB._replay_prefix((ForwardMode.DECODE, True), seq, 8).tolist() == [10, 11, 1, 1]
    assert FB._replay_prefix((ForwardMode.TARGET_VERIFY, False), seq, 4).tolist() == [10, 11, 1, 1]
    assert FB._replay_prefix((ForwardMode.DRAFT_EXTEND, False), seq, 4).tolist() == [6, 7, 0, 0]


def tiny_pools():
    return TokenToKVPool(64, 1, 2, 8, torch.float32, "cpu"), ReqToTokenPool(4, 32, "cpu")


def test_flashinfer_on_cpu_names_the_setting_and_the_alternatives():
    from actors.worker.rank_worker import make_backend
    kv, rt = tiny_pools()
    with pytest.raises(RuntimeError) as err:
        make_backend("flashinfer", kv, rt, 1.0, page_size=16)
    msg = str(err.value)
    assert "attention.backend=flashinfer" in msg and "CUDA" in msg
    assert "triton" in msg and "torch_native" in msg


def test_flashinfer_refuses_an_fp8_kv_cache_by_its_setting():
    from actors.worker.rank_worker import make_backend
    kv = TokenToKVPool(64, 1, 2, 8, torch.float8_e4m3fn, "cpu")
    with pytest.raises(ValueError) as err:
        make_backend("flashinfer", kv, ReqToTokenPool(4, 32, "cpu"), 1.0, page_size=16)
    msg = str(err.value)
    assert "kv_cache.dtype=fp8_e4m3" in msg and "attention.backend=triton" in msg


def test_missing_flashinfer_names_the_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer -> ImportError
    from actors.attention.flashinfer_backend import import_flashinfer
    with pytest.raises(RuntimeError) as err:
        import_flashinfer(torch.device("cuda"))
    msg = str(err.value)
    assert "flashinfer-python" in msg and "attention.backend=triton" in msg
    assert "attention.backend=torch_native" in msg


def test_module_imports_without_flashinfer(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    for name in ("actors.attention.flashinfer_backend", "actors.attention.flashinfer_metadata"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    import actors.attention.flashinfer_backend  # noqa: F401


def test_unknown_backend_lists_flashinfer():
    from actors.worker.rank_worker import make_backend
    kv, rt = tiny_pools()
    with pytest.raises(NotImplementedError, match="torch_native, triton, flashinfer"):
        make_backend("nope", kv, rt, 1.0)


# ---- the backend's plan/run orchestration, on CPU, over a stand-in for flashinfer ----------
# FakeFlashInfer keeps FlashInfer's contract as the backend relies on it: plan() takes host
# lengths and never runs while a graph is captured; graph-mode wrappers copy the plan into
# the caller's buffers, and run() reads those buffers (so a mask written after plan() counts);
# masks are packed as segment_packbits(bitorder="little") packs them.
CAPTURING = [False]


def _attend(q, kc, vc, qo, kv_indptr, indices, last, P, scale, causal, mask):
    qo, kv_indptr, indices, last = (t.long() for t in (qo, kv_indptr, indices, last))
    out = torch.empty_like(q)
    H, Hkv = q.shape[1], kc.shape[2]
    for b in range(last.numel()):
        pages = indices[kv_indptr[b]:kv_indptr[b + 1]]
        n = (pages.numel() - 1) * P + int(last[b])
        K = kc[pages].reshape(-1, Hkv, kc.shape[3])[:n].repeat_interleave(H // Hkv, 1)
        V = vc[pages].reshape(-1, Hkv, vc.shape[3])[:n].repeat_interleave(H // Hkv, 1)
        qb = q[qo[b]:qo[b + 1]]
        i, j = torch.arange(qb.shape[0])[:, None], torch.arange(n)[None, :]
        if mask is not None:
            buf, mindptr = mask
            bit = int(mindptr[b]) * 8 + i * n + j
            vis = ((buf.long()[bit // 8] >> (bit % 8)) & 1).bool()
        else:
            vis = (j <= i + n - qb.shape[0]) if causal else torch.ones_like(i * j, dtype=torch.bool)
        s = torch.einsum("qhd,khd->hqk", qb, K) * scale
        p = torch.softmax(s.masked_fill(~vis, float("-inf")), -1)
        out[qo[b]:qo[b + 1]] = torch.einsum("hqk,khd->qhd", p, V)
    return out


class _FakeWrapper:
    def __init__(self, workspace, layout, use_cuda_graph=False, **bufs):
        self.graph, self.bufs, self.t = use_cuda_graph, bufs, None

    def _keep(self, names, values):
        assert not CAPTURING[0], "plan() inside a capture"
        if not self.graph:
            return [None if v is None else v.clone() for v in values]
        kept = []
        for name, v in zip(names, values):
            buf = self.bufs.get(name)
            if v is not None:
                buf[:len(v)].copy_(v)
            kept.append(buf)
        return kept


class FakeDecode(_FakeWrapper):
    def plan(self, indptr, indices, last, H, Hkv, D, P, q_data_type=None, kv_data_type=None,
             sm_scale=None):
        self.t = self._keep(("paged_kv_indptr_buffer", "paged_kv_indices_buffer",
                             "paged_kv_last_page_len_buffer"), (indptr, indices, last))
        self.P, self.scale = P, sm_scale

    def run(self, q, kv):
        qo = torch.arange(q.shape[0] + 1)
        return _attend(q, *kv, qo, *self.t, self.P, self.scale, False, None)


class FakePrefill(_FakeWrapper):
    def plan(self, qo, kv_indptr, indices, last, H, Hkv, D, P, custom_mask=None, causal=False,
             sm_scale=None, q_data_type=None, kv_data_type=None):
        packed = mindptr = None
        if custom_mask is not None:
            sizes = ((qo[1:] - qo[:-1]).long() * ((kv_indptr[1:] - kv_indptr[:-1]).long() - 1) * P
                     + (qo[1:] - qo[:-1]).long() * last.long())
            packed, mindptr = ref_packed(custom_mask.cpu(), sizes.tolist())
        self.t = self._keep(("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf",
                             "paged_kv_last_page_len_buf", "custom_mask_buf", "mask_indptr_buf"),
                            (qo, kv_indptr, indices, last, packed, mindptr))
        self.P, self.scale, self.causal, self.masked = P, sm_scale, causal, packed is not None

    def run(self, q, kv):
        qo, kv_indptr, indices, last, packed, mindptr = self.t
        return _attend(q, *kv, qo, kv_indptr, indices, last, self.P, self.scale, self.causal,
                       (packed, mindptr) if self.masked else None)


class FakeFlashInfer:
    BatchDecodeWithPagedKVCacheWrapper = FakeDecode
    BatchPrefillWithPagedKVCacheWrapper = FakePrefill


@pytest.fixture
def fake_backend(monkeypatch):
    import actors.attention.flashinfer_backend as fib
    monkeypatch.setattr(fib, "import_flashinfer", lambda device: FakeFlashInfer)
    monkeypatch.setattr(fib, "WORKSPACE_BYTES", 16)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: CAPTURING[0])
    return fib.FlashInferBackend


class CpuCase:
    """Scattered pages, random fp32 K/V, one forward of `mode` (as the workers build it)."""

    def __init__(self, mode, B, page, seed, n=4, K=2, step=1, rows=None, prefix=None, like=None):
        from actors.worker.forward_batch import ForwardBatch
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        width, self.H, self.Hkv, self.D = 64, 6, 2, 8
        if like is not None:  # another case's table and pools (a graph's fresh inputs)
            self.rt, self.pool = like.rt, like.pool
        else:
            self.rt = ReqToTokenPool(B + 1, width, "cpu")
            self.rt.req_to_token[1:] = paged_table(B, width, page, seed)
            self.pool = TokenToKVPool(B * width + page, 1, self.Hkv, self.D, torch.float32, "cpu")
            self.pool.k[0].normal_(generator=gen)
            self.pool.v[0].normal_(generator=gen)
        mask = new_kv = None
        if mode == "decode":
            qlens, E = [1] * B, [1] * B
        elif mode == "extend":
            qlens = [rng.randint(1, 9) for _ in range(B)]
            E = qlens
        elif mode == "verify":
            qlens, E = [n] * B, [n] * B
            mask = tree_masks(B, n, n, seed)
        else:  # draft decode: K lanes, keys = (step+1)*K scratch slots, ancestor masks
            qlens, E = [K] * B, [(step + 1) * K] * B
            mask = tree_masks(B, K, (step + 1) * K, seed)
        rows = torch.arange(1, B + 1) if rows is None else rows
        prefix = [rng.randint(0, width - 12) for _ in range(B)] if prefix is None else prefix
        table = self.rt.req_to_token
        loc = torch.cat([table[r, p + e - q:p + e] for r, p, e, q in zip(rows.tolist(), prefix, E, qlens)])
        if mode == "draft_decode":
            new_kv = torch.stack([table[r, p:p + e] for r, p, e in zip(rows.tolist(), prefix, E)])
        T = sum(qlens)
        self.q = torch.randn(T, self.H, self.D, generator=gen)
        self.k = torch.randn(T, self.Hkv, self.D, generator=gen)
        self.v = torch.randn(T, self.Hkv, self.D, generator=gen)
        modes = {"decode": ForwardMode.DECODE, "extend": ForwardMode.EXTEND,
                 "verify": ForwardMode.TARGET_VERIFY, "draft_decode": ForwardMode.DECODE}
        self.fb = ForwardBatch(modes[mode], torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64),
                               loc, rows, torch.tensor(prefix), qlens, new_kv_slots=new_kv,
                               custom_mask=mask)

    def reference(self):
        from actors.attention.torch_native import TorchNativeBackend
        pool = TokenToKVPool(self.pool.k[0].shape[0], 1, self.Hkv, self.D, torch.float32, "cpu")
        pool.k[0].copy_(self.pool.k[0])
        pool.v[0].copy_(self.pool.v[0])
        native = TorchNativeBackend(pool, self.rt, self.D ** -0.5)
        native.init_forward_metadata(self.fb)
        return native.forward(self.q, self.k, self.v, 0, self.fb)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("mode", ["decode", "extend", "verify", "draft_decode"])
def test_eager_forward_equals_torch_native(fake_backend, mode, page):
    case = CpuCase(mode, 5, page, seed=7 + page)
    want = case.reference()
    backend = fake_backend(case.pool, case.rt, case.D ** -0.5, page_size=page)
    backend.init_forward_metadata(case.fb)
    wrapper = backend._decode if mode == "decode" else backend._prefill
    assert case.fb.attn_meta.wrapper is wrapper
    torch.testing.assert_close(backend.forward(case.q, case.k, case.v, 0, case.fb), want)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("mode,kind", [("decode", ForwardMode.DECODE),
                                       ("verify", ForwardMode.TARGET_VERIFY),
                                       ("draft_decode", ForwardMode.DECODE)])
def test_graph_protocol_replays_fresh_batches(fake_backend, mode, kind, page):
    """Capture hook, two warm-ups, a capture that only binds, then replays: the replay hook
    re-plans from the padded seq_lens (FILL lanes), the captured forward sets the mask
    bits, and the result equals torch_native on every replay's fresh inputs."""
    bs, raw = 4, 3
    draft = mode == "draft_decode"
    static = CpuCase(mode, bs, page, seed=1)
    backend = fake_backend(static.pool, static.rt, static.D ** -0.5, page_size=page)
    fb = static.fb  # the graph's static inputs
    spec = type("View", (), {"topk_p": torch.zeros(bs, 2) if draft else None})()
    backend.init_forward_metadata_capture_cuda_graph(bs, len(static.q), fb.req_pool_indices,
                                                     None, forward_mode=kind, spec=spec)

    def forward():
        backend.init_forward_metadata(fb)
        return backend.forward(static.q, static.k, static.v, 0, fb)

    with torch.inference_mode():  # as RankWorker captures; replays below run outside it
        forward(), forward()
        CAPTURING[0] = True
        try:
            forward()
        finally:
            CAPTURING[0] = False
    CAPTURING[0] = True
    try:
        for trial in range(2):
            # A raw batch of 3 padded to 4: lane 3 is row 0 with FILL (prefix 0 for decode).
            rows = torch.tensor([2, 4, 1, 0])
            fill_prefix = 0 if (kind == ForwardMode.DECODE and not draft) else 1
            prefix = [5 + trial, 30, 17 - trial, fill_prefix]
            fresh = CpuCase(mode, bs, page, seed=50 + trial, rows=rows, prefix=prefix, like=static)
            for name in ("out_cache_loc", "req_pool_indices", "prefix_lens"):
                getattr(fb, name).copy_(getattr(fresh.fb, name))
            for name in ("new_kv_slots", "custom_mask"):
                if getattr(fb, name) is not None:
                    getattr(fb, name).copy_(getattr(fresh.fb, name))
            for dst, src in ((static.q, fresh.q), (static.k, fresh.k), (static.v, fresh.v)):
                dst.copy_(src)
            seq = torch.tensor(prefix) + (1 if fill_prefix == 0 else 0)  # the runner's seq_lens
            CAPTURING[0] = False  # the hook runs outside the graph
            backend.init_forward_metadata_replay_cuda_graph(
                bs, fb.req_pool_indices, seq, int(seq.sum()), None, forward_mode=kind, spec=spec)
            CAPTURING[0] = True  # the "replay": what the capture recorded, no plan allowed
            got = forward()
            fresh.fb = fb
            torch.testing.assert_close(got[:raw * (len(static.q) // bs)],
                                       fresh.reference()[:raw * (len(static.q) // bs)])
    finally:
        CAPTURING[0] = False
    with pytest.raises(ValueError, match="C04"):
        backend.init_forward_metadata_replay_cuda_graph(
            bs, fb.req_pool_indices, torch.tensor([3, 3, 3, 1]), 9, None, forward_mode=kind, spec=spec)
