"""Paged attention for every forward mode, plan-free: one Triton kernel plus its torch reference.

The layout is ForwardBatch's (actors/worker/forward_batch.py): request b has q_b queries (rows
qo_indptr[b]..qo_indptr[b+1] of q) and attends to
  * its first prefix_lens[b] tokens, fully visible, then
  * E_b = new_kv_lens[b] new keys, visible through a custom mask ([q_b, E_b] row-major,
    flattened at mask_indptr[b]), or causal (query i sees new key j iff j <= i + E_b - q_b),
    or all of them (causal=False). A request whose mask block is empty (mask_indptr[b+1]
    == mask_indptr[b]) is causal (or full): a mixed step's tree-verify requests carry
    masks and its prefill chunks do not.
In every mode the new keys sit right after the prefix in the request's row of
req_to_token (extend / verify / draft extend write out_cache_loc there; draft decode's
scratch slots are req_to_token[row, seq + 0..E)), so key position p of request b lives in
slot req_to_token[req_pool_indices[b], p] for all p < prefix_b + E_b. Everything the kernel
reads is a device tensor of the batch; the launch needs only host ints known from shapes
(batch size, max queries per request), so it runs inside CUDA-graph capture.

Kernel: one program per (query block, request x kv head, kv split). A query block packs
Q_PER_BLOCK queries x GROUP query heads of one kv head into BLOCK_M rows (GQA: each K/V
tile is loaded once per kv head, not per query head; decode fills GROUP of the rows).
Keys are visited in BLOCK_N tiles with an fp32 online softmax (exp2 domain). With
num_splits > 1 (flash-decoding, for batches too small to fill the GPU) each split covers
a slice of the keys and writes a partial output + log-sum-exp; a second kernel merges them.
Up to BASE_KV_SPLITS splits divide any context evenly; a launch with more (a few streams
over a long context, `attention.max_kv_splits`) uses the extra ones only where each still
gets SPLIT_MIN_KEYS keys, so a short context splits as it would at BASE_KV_SPLITS; the
empty splits write only a -inf log-sum-exp, and the merge reads no partial output there.
The split count is a run-time argument, not a compile-time constant: it follows the
batch's shape, and as a constant every new prefill shape compiled a new kernel (0.5-1 s
on the H200, in front of the first token of every request in that batch).

Rows that see no key at all (only possible with an all-False custom mask row and no
prefix) come out as zeros here and in the reference; SDPA would give NaN.

An FP8 cache (kv_cache.dtype=fp8_e4m3, kestrel_kernels/kv_fp8.py) comes with k_scale and
v_scale, [1] fp32 device tensors: a stored value times its scale is the value. The kernel
converts each K/V tile to the query dtype (exact: E4M3 fits in fp16/bf16/fp32) and applies
the scales in fp32 where they are per-layer constants, K's to the scores and V's to the
normalised output, the same products as scaling every tile.
"""
from __future__ import annotations

import torch

from kestrel_kernels.kv_fp8 import dequantize_kv, gather_fp8
from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "paged_attention", "paged_attention_ref", "default_num_kv_splits",
           "MAX_KV_SPLITS"]

MAX_KV_SPLITS = 64
# The split count a launch takes by default (attention.max_kv_splits); any split count up to
# it keeps every key range as it was, and splits beyond it are used only where the context
# is long enough that each still covers SPLIT_MIN_KEYS keys.
BASE_KV_SPLITS = 16
SPLIT_MIN_KEYS = 512
# The merge kernel's split lanes: one compiled kernel for any count up to BASE_KV_SPLITS,
# a second for more.
assert BASE_KV_SPLITS <= MAX_KV_SPLITS and MAX_KV_SPLITS & (MAX_KV_SPLITS - 1) == 0
_LOG2E = 1.4426950408889634


# ------------------------------------------------------------------------------ reference
def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    new_kv_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_q_len: int,
    *,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    num_kv_splits: int | None = None,
    max_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch paged attention, per request, softmax in fp32 (same signature as
    :func:`paged_attention`; ``max_q_len``, ``num_kv_splits`` and ``max_kv_splits`` are
    accepted and unused).

    Args:
        q: [T, H, D] queries, requests concatenated.
        k_cache, v_cache: [S, Hkv, D] one layer's K/V by slot; H % Hkv == 0.
        req_to_token: [R, L] integer, slot of (row, position).
        req_pool_indices: [B] integer, row of each request.
        prefix_lens: [B] integer, fully visible keys.
        new_kv_lens: [B] integer, E_b keys after the prefix (E_b >= q_b).
        qo_indptr: [B+1] integer, query rows of request b are qo_indptr[b]..qo_indptr[b+1].
        custom_mask: [sum_b q_b*E_b] bool/uint8, request b's [q_b, E_b] row-major block
            starting at mask_indptr[b] ([B+1] integer); None = causal / full per ``causal``,
            as is a request whose block is empty.
        scale: softmax scale, default D ** -0.5.
        out: optional [T, H, D] output buffer.
        k_scale, v_scale: [1] fp32 for an FP8 cache (float8_e4m3fn): stored value * scale
            is the value; None for a cache in a float dtype.

    Returns:
        [T, H, D] in q's dtype.
    """
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    G = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    out = torch.empty_like(q) if out is None else out
    qo = qo_indptr.tolist()
    pre, new, rows = prefix_lens.tolist(), new_kv_lens.tolist(), req_pool_indices.tolist()
    mi = mask_indptr.tolist() if custom_mask is not None else None
    for b in range(len(rows)):
        q0, q1 = qo[b], qo[b + 1]
        ql, p, e = q1 - q0, pre[b], new[b]
        if ql == 0:
            continue
        slots = req_to_token[rows[b], :p + e].long()  # [kv] int64
        if k_scale is None:
            k, v = k_cache[slots].float(), v_cache[slots].float()  # [kv, Hkv, D] fp32
        else:
            k = dequantize_kv(gather_fp8(k_cache, slots), k_scale, torch.float32)  # [kv, Hkv, D] fp32
            v = dequantize_kv(gather_fp8(v_cache, slots), v_scale, torch.float32)  # [kv, Hkv, D] fp32
        k = k.repeat_interleave(G, dim=1)  # [kv, H, D] fp32, GQA expanded
        v = v.repeat_interleave(G, dim=1)  # [kv, H, D] fp32
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].float(), k) * scale  # [H, ql, kv] fp32
        vis = torch.ones(ql, p + e, dtype=torch.bool, device=q.device)  # [ql, kv] bool
        if custom_mask is not None and mi[b + 1] > mi[b]:
            vis[:, p:] = custom_mask[mi[b]:mi[b] + ql * e].view(ql, e).bool()
        elif causal:
            vis[:, p:] = torch.ones(ql, e, dtype=torch.bool, device=q.device).tril(e - ql)
        s = s.masked_fill(~vis, float("-inf"))
        w = torch.softmax(s, dim=-1).nan_to_num(0.0)  # rows with no visible key -> zeros
        out[q0:q1] = torch.einsum("hqk,khd->qhd", w, v).to(out.dtype)
    return out


# ------------------------------------------------------------------------------ kernels
if HAS_TRITON:

    @triton.jit
    def _attend_keys(
        acc, m_i, l_i, q, lo, hi, K, V, ReqToToken, row, kvh,
        stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, offs_d, d_ok, row_ok, q_idx,
        prefix, n_new, q_len, Mask, mask_base, masked, qk_scale,
        BLOCK_N: tl.constexpr, NEW_KEYS: tl.constexpr, HAS_MASK: tl.constexpr,
        CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    ):
        """Online softmax over key positions [lo, hi) of one request; NEW_KEYS applies the
        custom / causal visibility (positions >= prefix), else every key is visible."""
        offs_n = tl.arange(0, BLOCK_N)
        for start in range(lo, hi, BLOCK_N):
            pos = start + offs_n
            n_ok = pos < hi
            slot = tl.load(ReqToToken + row * stride_rt + pos, mask=n_ok, other=0).to(tl.int64)
            kv_ok = n_ok[:, None] & d_ok[None, :]
            k = tl.load(K + slot[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=kv_ok, other=0.0)
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
            vis = n_ok[None, :]
            if NEW_KEYS:
                j = pos - prefix  # index among the new keys
                if HAS_MASK:  # this request's bits, or causal where it has none (`masked`)
                    bits = tl.load(Mask + mask_base[:, None] + j[None, :],
                                   mask=vis & row_ok[:, None] & masked, other=0)
                    if CAUSAL:
                        seen = j[None, :] <= (q_idx + n_new - q_len)[:, None]
                    else:
                        seen = j[None, :] >= 0
                    vis = vis & tl.where(masked, bits != 0, seen)
                elif CAUSAL:
                    vis = vis & (j[None, :] <= (q_idx + n_new - q_len)[:, None])
            qk = tl.where(vis, qk, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key seen yet: no NaN
            p = tl.exp2(qk - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + slot[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=kv_ok, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype),
                                                input_precision=PRECISION)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit(do_not_specialize=["num_splits"])
    def _paged_attn_kernel(
        Q, K, V, Out, PartO, PartLse,
        ReqToToken, ReqIdx, PrefixLens, NewLens, QoIndptr, MaskIndptr, Mask,
        KScale, VScale,  # [1] fp32 each, read when KV_SCALED (an FP8 cache)
        qk_scale,  # softmax scale * log2(e): the softmax runs in the exp2 domain
        stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh,
        stride_ot, stride_oh, stride_rt,
        stride_pt, stride_ph, stride_ps,
        num_splits,
        NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, Q_PER_BLOCK: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
        HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
        BASE_SPLITS: tl.constexpr, SPLIT_MIN: tl.constexpr, KV_SCALED: tl.constexpr,
    ):
        qblk = tl.program_id(0)
        pid = tl.program_id(1)
        split = tl.program_id(2)
        b = pid // NUM_KV_HEADS
        kvh = pid % NUM_KV_HEADS

        q_start = tl.load(QoIndptr + b).to(tl.int64)
        q_len = (tl.load(QoIndptr + b + 1) - q_start).to(tl.int32)
        row = tl.load(ReqIdx + b).to(tl.int64)
        prefix = tl.load(PrefixLens + b).to(tl.int32)
        n_new = tl.load(NewLens + b).to(tl.int32)
        q0 = qblk * Q_PER_BLOCK

        # Row r of the tile is query q0 + r // GROUP, query head kvh * GROUP + r % GROUP.
        offs_m = tl.arange(0, BLOCK_M)
        q_loc = offs_m // GROUP
        q_idx = q0 + q_loc
        head = kvh * GROUP + offs_m % GROUP
        row_ok = (q_loc < Q_PER_BLOCK) & (q_idx < q_len)
        tok = q_start + q_idx
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(Q + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        if HAS_MASK:  # row r's mask bits start at mask_base[r]; none: causal (`masked` False)
            mask_start = tl.load(MaskIndptr + b).to(tl.int64)
            masked = tl.load(MaskIndptr + b + 1).to(tl.int64) > mask_start
            mask_base = mask_start + q_idx.to(tl.int64) * n_new
        else:
            masked = False  # unused
            mask_base = q_idx.to(tl.int64)  # unused

        # Keys this block can see: causal blocks stop after their last query's diagonal.
        kv_end = prefix + n_new
        if CAUSAL:
            last_q = tl.minimum(q0 + Q_PER_BLOCK, q_len) - 1
            diagonal = tl.minimum(kv_end, prefix + last_q + (n_new - q_len) + 1)
            if HAS_MASK:
                kv_end = tl.where(masked, kv_end, diagonal)
            else:
                kv_end = diagonal
        kv_end = tl.where(q0 < q_len, kv_end, 0)  # query block past this request: no work
        if SPLIT:
            # Past BASE_SPLITS splits only while each keeps SPLIT_MIN: a short context
            # splits as it would at BASE_SPLITS, the launch's other splits stay empty.
            active = tl.minimum(num_splits, tl.maximum(BASE_SPLITS, tl.cdiv(kv_end, SPLIT_MIN)))
            chunk = tl.cdiv(tl.cdiv(kv_end, active), BLOCK_N) * BLOCK_N
            lo = split * chunk
            hi = tl.minimum(lo + chunk, kv_end)
        else:
            lo = 0
            hi = kv_end
        if KV_SCALED:  # dequantized K: every score carries K's scale
            qk_scale = qk_scale * tl.load(KScale)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Keys every row of the block sees need no mask work: the prefix, and of the new
        # keys (causal) those up to the block's first diagonal, so a prefill chunk masks only
        # its diagonal tiles and a decode step visits its keys in one unmasked run.
        if CAUSAL:
            shared = prefix + tl.minimum(tl.maximum(q0 + n_new - q_len + 1, 0), n_new)
        else:
            shared = prefix + n_new
        if HAS_MASK:
            shared = tl.where(masked, prefix, shared)
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, lo, tl.minimum(hi, shared), K, V, ReqToToken, row, kvh,
            stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, offs_d, d_ok, row_ok, q_idx,
            prefix, n_new, q_len, Mask, mask_base, masked, qk_scale,
            BLOCK_N=BLOCK_N, NEW_KEYS=False, HAS_MASK=HAS_MASK, CAUSAL=CAUSAL,
            PRECISION=PRECISION)
        acc, m_i, l_i = _attend_keys(
            acc, m_i, l_i, q, tl.maximum(lo, shared), hi, K, V, ReqToToken, row, kvh,
            stride_rt, stride_ks, stride_kh, stride_vs, stride_vh, offs_d, d_ok, row_ok, q_idx,
            prefix, n_new, q_len, Mask, mask_base, masked, qk_scale,
            BLOCK_N=BLOCK_N, NEW_KEYS=True, HAS_MASK=HAS_MASK, CAUSAL=CAUSAL,
            PRECISION=PRECISION)

        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # no visible key -> zeros
        if KV_SCALED:  # dequantized V: the weighted sum carries V's scale
            o = o * tl.load(VScale)
        out_ok = row_ok[:, None] & d_ok[None, :]
        if SPLIT:
            # An empty split (past the keys: most of a wide launch over a short context)
            # writes only its -inf lse; the merge reads no output where lse is -inf.
            po = tok[:, None] * stride_pt + head[:, None] * stride_ph + split * stride_ps
            tl.store(PartO + po + offs_d[None, :], o, mask=out_ok & (lo < hi))
            lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
            # PartLse is contiguous [T, H, num_splits].
            tl.store(PartLse + (tok * (NUM_KV_HEADS * GROUP) + head) * num_splits + split, lse,
                     mask=row_ok)
        else:
            tl.store(Out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     o.to(Out.dtype.element_ty), mask=out_ok)

    @triton.jit(do_not_specialize=["num_splits"])
    def _merge_splits_kernel(
        PartO, PartLse, Out,
        stride_pt, stride_ph, stride_ps, stride_ot, stride_oh, num_splits,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        num_heads = tl.num_programs(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_ok = offs_s < num_splits
        d_ok = offs_d < HEAD_DIM
        base = t * stride_pt + h * stride_ph
        lse = tl.load(PartLse + (t * num_heads + h) * num_splits + offs_s, mask=s_ok,
                      other=float("-inf"))
        m = tl.max(lse, 0)
        w = tl.exp2(lse - tl.where(m == float("-inf"), 0.0, m))  # empty split -> weight 0
        denom = tl.sum(w, 0)
        seen = lse > float("-inf")  # a split with no visible key (or none at all) adds nothing
        part = tl.load(PartO + base + offs_s[:, None] * stride_ps + offs_d[None, :],
                       mask=s_ok[:, None] & d_ok[None, :] & seen[:, None], other=0.0)
        o = tl.sum(w[:, None] * part, 0) / tl.where(denom > 0, denom, 1.0)
        tl.store(Out + t * stride_ot + h * stride_oh + offs_d, o.to(Out.dtype.element_ty),
                 mask=d_ok)


# ------------------------------------------------------------------------------ launcher
_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:  # queried once per device, not on every launch
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _launch_config(max_q_len: int, group: int, head_dim: int) -> dict:
    """Tile sizes: the rows cover all of a request's (query, head) pairs when few (decode,
    verify), 64 rows otherwise; D padded to a power of two."""
    block_d = max(16, triton.next_power_of_2(head_dim))
    want = max(1, max_q_len) * group
    block_m = max(16, min(64, triton.next_power_of_2(want)), triton.next_power_of_2(group))
    block_n = 64 if block_d <= 128 else 32
    # Swept on an H200 (SmolLM2 and Llama head layouts, contexts of 2048): decode tiles are
    # tiny, so 2 warps and more programs per SM; bigger tiles gain from a third stage.
    small = block_m <= 16
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
                num_warps=2 if small else 4, num_stages=2 if small else 3)


def default_num_kv_splits(num_programs: int, num_tokens: int, num_heads: int, head_dim: int,
                          device: torch.device, max_splits: int = BASE_KV_SPLITS) -> int:
    """Key splits so that about 4 programs per SM run (flash-decoding; measured on H200),
    at most `max_splits`. Past BASE_KV_SPLITS rounded down: one split more than fits
    leaves a second wave of a few programs (docs/benchmarks.md, "long contexts split 64
    ways").

    Depends on shapes only, never on device data (the context length is unknown on the
    host): a captured graph and its eager twin pick the same value. Splits over a short
    context are empty and cost one tiny program each.
    """
    if device.type != "cuda":
        return 1  # the CPU interpreter gains nothing from splits
    slots, programs = 4 * _sm_count(device), max(1, num_programs)
    want = -(-slots // programs)
    if want > BASE_KV_SPLITS:
        want = max(BASE_KV_SPLITS, slots // programs)
    splits = max(1, min(max_splits, MAX_KV_SPLITS, want))
    # Bound the fp32 partial buffer ([T, H, splits, D]) at 64 MiB.
    cap = max(1, (16 << 20) // max(1, num_tokens * num_heads * head_dim))
    return max(1, min(splits, cap))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    new_kv_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    max_q_len: int,
    *,
    custom_mask: torch.Tensor | None = None,
    mask_indptr: torch.Tensor | None = None,
    causal: bool = True,
    scale: float | None = None,
    num_kv_splits: int | None = None,
    max_kv_splits: int = BASE_KV_SPLITS,
    out: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton paged attention; arguments as :func:`paged_attention_ref`.

    ``max_q_len`` (host int) bounds q_b for the launch grid; ``num_kv_splits`` forces the
    number of key splits (default :func:`default_num_kv_splits`, at most ``max_kv_splits``).
    No device value is read on the host, so the call can be captured in a CUDA graph.
    """
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use paged_attention_ref")
    T, H, D = q.shape
    Hkv = k_cache.shape[1]
    if H % Hkv:
        raise ValueError(f"{H} query heads do not group over {Hkv} kv heads")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1 or req_to_token.stride(-1) != 1:
        raise ValueError("k_cache, v_cache and req_to_token need a contiguous last dim")
    q = q if q.stride(-1) == 1 else q.contiguous()
    out = torch.empty_like(q) if out is None else out  # [T, H, D] q.dtype
    B = req_pool_indices.numel()
    if T == 0 or B == 0:
        return out
    if B * Hkv > 65535:  # grid axis 1 (requests x kv heads) is capped by CUDA
        raise ValueError(f"{B} requests x {Hkv} kv heads exceed one launch (65535)")
    G = H // Hkv
    scale = D ** -0.5 if scale is None else scale
    cfg = _launch_config(max_q_len, G, D)
    q_per_block = cfg["BLOCK_M"] // G
    n_qblk = max(1, -(-max_q_len // q_per_block))
    if num_kv_splits is None:
        num_kv_splits = default_num_kv_splits(n_qblk * B * Hkv, T, H, D, q.device, max_kv_splits)
    splits = max(1, int(num_kv_splits))
    if splits > MAX_KV_SPLITS:
        raise ValueError(f"num_kv_splits={splits} exceeds MAX_KV_SPLITS={MAX_KV_SPLITS}")
    has_mask = custom_mask is not None
    if has_mask:
        if mask_indptr is None:
            raise ValueError("custom_mask needs mask_indptr")
        mask = custom_mask.reshape(-1)
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask  # [M] uint8
    else:
        mask = mask_indptr = qo_indptr  # never read (HAS_MASK=False): any valid pointer
    if splits > 1:
        # Per-split normalised outputs and log2-sum-exp, merged by _merge_splits_kernel.
        part_o = torch.empty(T, H, splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(T, H, splits, dtype=torch.float32, device=q.device)
        sp = part_o.stride()
    else:
        part_o = part_lse = out  # never written (SPLIT=False)
        sp = (0, 0, 0)
    scaled = k_scale is not None
    if scaled != (v_scale is not None):
        raise ValueError("an FP8 cache needs both k_scale and v_scale")
    if not scaled:
        k_scale = v_scale = qo_indptr  # never read (KV_SCALED=False): any valid pointer
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (n_qblk, B * Hkv, splits)
    _paged_attn_kernel[grid](
        q, k_cache, v_cache, out, part_o, part_lse,
        req_to_token, req_pool_indices, prefix_lens, new_kv_lens, qo_indptr, mask_indptr, mask,
        k_scale, v_scale, scale * _LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        req_to_token.stride(0), sp[0], sp[1], sp[2], splits,
        NUM_KV_HEADS=Hkv, GROUP=G, Q_PER_BLOCK=q_per_block, HEAD_DIM=D,
        SPLIT=splits > 1, HAS_MASK=has_mask, CAUSAL=bool(causal), PRECISION=precision,
        BASE_SPLITS=BASE_KV_SPLITS, SPLIT_MIN=SPLIT_MIN_KEYS, KV_SCALED=scaled, **cfg,
    )
    if splits > 1:
        lanes = BASE_KV_SPLITS if splits <= BASE_KV_SPLITS else MAX_KV_SPLITS
        _merge_splits_kernel[(T, H)](
            part_o, part_lse, out, sp[0], sp[1], sp[2], out.stride(0), out.stride(1), splits,
            HEAD_DIM=D, BLOCK_D=cfg["BLOCK_D"], BLOCK_S=lanes, num_warps=lanes // BASE_KV_SPLITS,
        )
    return out
