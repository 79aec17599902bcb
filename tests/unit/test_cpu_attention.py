"""The CPU attention kernel (kestrel_kernels/cpu_attention.cpp) against SDPA, and its batch
invariance: a query's output is the same bits alone, among other queries, and with its
request's key list padded."""
import pytest
import torch

from kestrel_kernels import cpu_build
from kestrel_kernels.cpu_attention import paged_attention, paged_attention_ref

pytestmark = pytest.mark.skipif(cpu_build.unavailable_reason() is not None,
                                reason=f"the CPU kernels: {cpu_build.unavailable_reason()}")

H, HKV, D, SLOTS = 6, 2, 64, 400


def _batch(g, kv_lens, qlens, pad=0):
    """Requests with kv_lens keys (the last qlens of them new, causal) -> metadata as the
    torch backend builds it; `pad` extra masked-out key columns."""
    B, L, Q = len(kv_lens), max(kv_lens) + pad, max(qlens)
    perm = torch.randperm(SLOTS, generator=g)
    kv_index = torch.zeros(B, L, dtype=torch.int64)
    mask = torch.zeros(B, Q, L, dtype=torch.bool)
    used = 0
    for b, (n, q) in enumerate(zip(kv_lens, qlens)):
        kv_index[b, :n] = perm[used:used + n]
        used += n
        mask[b, :q, :n - q] = True
        mask[b, :q, n - q:n] = torch.ones(q, q, dtype=torch.bool).tril()
        mask[b, q:, 0] = True
    lens = torch.tensor(qlens)
    q_batch = torch.repeat_interleave(torch.arange(B), lens)
    q_slot = torch.arange(int(lens.sum())) - (torch.cumsum(lens, 0) - lens)[q_batch]
    return kv_index, mask[:, None], q_batch, q_slot


@pytest.mark.parametrize("kv_lens,qlens", [([1], [1]), ([37, 5, 130], [1, 1, 1]), ([50, 9], [4, 4]),
                                           ([20, 33], [7, 3]), ([70, 12], [9, 1])])
def test_kernel_equals_sdpa(kv_lens, qlens):
    g = torch.Generator().manual_seed(len(kv_lens) * 7 + sum(qlens))
    kc, vc = torch.randn(SLOTS, HKV, D, generator=g), torch.randn(SLOTS, HKV, D, generator=g)
    meta = _batch(g, kv_lens, qlens, pad=3)
    q = torch.randn(sum(qlens), H, D, generator=g) * 2
    out = paged_attention(q, kc, vc, *meta, D ** -0.5)
    ref = paged_attention_ref(q, kc, vc, *meta, D ** -0.5)
    assert out.shape == ref.shape == (sum(qlens), H, D)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)


def test_a_querys_output_does_not_depend_on_the_batch():
    """The last token of a 4-row verify, and the same token as a one-row decode step beside
    other requests and with padded key lists: the same bits."""
    g = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(SLOTS, HKV, D, generator=g), torch.randn(SLOTS, HKV, D, generator=g)
    q = torch.randn(4, H, D, generator=g)
    verify = _batch(g, [60], [4])
    out = paged_attention(q, kc, vc, *verify, D ** -0.5)
    kv_index, mask, _, _ = verify
    for i in range(4):
        # the same request as a decode step over its first 57 + i keys, among two others
        n = 57 + i
        others = _batch(g, [n, 30, 90], [1, 1, 1], pad=11)
        others[0][0, :n] = kv_index[0, :n]
        qi = torch.cat([q[i:i + 1], torch.randn(2, H, D, generator=g)])
        alone = paged_attention(qi, kc, vc, *others, D ** -0.5)
        assert torch.equal(alone[0], out[i]), i


def test_a_tree_rows_output_does_not_depend_on_the_rows_beside_it():
    """A tree verify of 9 rows (grouped four at a time, sharing the prefix's loads) against
    each row alone over the same keys (the prefix, its ancestors, itself): the same bits."""
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(SLOTS, HKV, D, generator=g), torch.randn(SLOTS, HKV, D, generator=g)
    P, parent = 45, [-1, 0, 0, 1, 1, 2, 3, 4, 7]
    N = len(parent)
    kv_index = torch.randperm(SLOTS, generator=g)[:P + N][None]  # [1, P + N]
    mask = torch.zeros(1, 1, N, P + N, dtype=torch.bool)
    mask[..., :P] = True
    for i in range(N):
        j = i
        while j >= 0:  # the node and its ancestors
            mask[0, 0, i, P + j] = True
            j = parent[j]
    q = torch.randn(N, H, D, generator=g)
    rows = torch.arange(N)
    out = paged_attention(q, kc, vc, kv_index, mask, torch.zeros(N, dtype=torch.int64), rows, D ** -0.5)
    ref = paged_attention_ref(q, kc, vc, kv_index, mask, torch.zeros(N, dtype=torch.int64), rows, D ** -0.5)
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5)
    for i in range(N):
        keys = kv_index[0, mask[0, 0, i]][None]  # [1, n] this row's keys, in order
        alone = paged_attention(q[i:i + 1], kc, vc, keys, torch.ones(1, 1, 1, keys.shape[1], dtype=torch.bool),
                                torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), D ** -0.5)
        assert torch.equal(alone[0], out[i]), i
