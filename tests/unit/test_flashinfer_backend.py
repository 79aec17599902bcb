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
from actors.dp.sync import ForwardMode
from actors.kv_cache import ReqToTokenPool, TokenToKVPool


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
    from actors.rank_worker import make_backend
    kv, rt = tiny_pools()
    with pytest.raises(RuntimeError) as err:
        make_backend("flashinfer", kv, rt, 1.0, page_size=16)
    msg = str(err.value)
    assert "attention.backend=flashinfer" in msg and "CUDA" in msg
    assert "triton" in msg and "torch_native" in msg


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
    from actors.rank_worker import make_backend
    kv, rt = tiny_pools()
    with pytest.raises(NotImplementedError, match="torch_native, triton, flashinfer"):
        make_backend("nope", kv, rt, 1.0)
