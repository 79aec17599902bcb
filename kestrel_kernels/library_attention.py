"""A long prefill chunk's attention through cuDNN's fused attention (torch's SDPA kernels),
beside its torch reference.

On Hopper, cuDNN's attention runs a causal chunk of thousands of queries at 500-560 TFLOP/s
where Kestrel's Triton kernel runs 300-330 (docs/benchmarks.md, "A long prompt's chunks
through cuDNN"). cuDNN reads contiguous K/V and aligns a causal mask to the top-left
corner, so a chunk of C queries that follows P cached keys is attended in two calls, each
returning its log-sum-exp, and the two outputs are merged by them:
  * the prefix's first Pf = P // PREFIX_BLOCK * PREFIX_BLOCK keys, all visible (not causal);
  * the rest of the prefix (r = P - Pf keys) and the chunk's own keys, causal: the chunk's
    queries follow r query rows of zeros, so that top-left alignment shows each real query
    all r keys and the chunk's keys up to its own.
cuDNN builds a plan for each new shape on its first call (45-900 ms on an H100), so both
calls are padded to shapes from a small set: queries (and the causal part's keys, at the
end, where no real query sees them) to a multiple of QUERY_BUCKET rows. warm_up builds every
plan a configuration can reach before serving. The request's keys are first gathered from
the paged cache into contiguous copies.
"""
from __future__ import annotations

import torch

__all__ = ["chunk_attention", "chunk_attention_ref", "attend_with_lse", "attend_with_lse_ref",
           "library_attention_supported", "plan_shapes", "warm_up"]

PREFIX_BLOCK = 4096  # the non-causal call's keys: a multiple of this
QUERY_BUCKET = 512  # both calls' query rows, and the causal call's keys: a multiple of this


def round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def attend_with_lse_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, H, Sq, D], k/v [1, Hkv, Sk, D] (Hkv divides H; with causal, Sq == Sk) ->
    (out [1, H, Sq, D] in q's dtype, natural log-sum-exp [1, H, Sq] fp32), in fp32 math."""
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [1, H, Sk, D] fp32
    vf = v.float().repeat_interleave(group, dim=1)
    s = torch.matmul(q.float(), kf.transpose(-1, -2)) * scale  # [1, H, Sq, Sk] fp32
    if causal:
        sq, sk = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # [1, H, Sq] fp32
    out = torch.matmul(torch.exp(s - lse[..., None]), vf)  # [1, H, Sq, D] fp32
    return out.to(q.dtype), lse


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """attend_with_lse_ref by cuDNN's fused attention (CUDA, fp16/bf16): grouped K/V heads
    are read as they are, without repeating them."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale)[:2]
    return out, lse.reshape(out.shape[:3])


def merge_by_lse(o1: torch.Tensor, l1: torch.Tensor, o2: torch.Tensor, l2: torch.Tensor) -> torch.Tensor:
    """The attention over two disjoint key sets from each one's output ([1, H, Sq, D]) and
    log-sum-exp ([1, H, Sq] fp32): o1's weight is exp(l1) / (exp(l1) + exp(l2))."""
    w1 = torch.sigmoid(l1.float() - l2.float())[..., None]  # [1, H, Sq, 1] fp32
    return torch.lerp(o2.float(), o1.float(), w1).to(o1.dtype)


def chunk_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slots: torch.Tensor, prefix_len: int, scale: float, attend=attend_with_lse,
                    block: int = PREFIX_BLOCK, bucket: int = QUERY_BUCKET) -> torch.Tensor:
    """One request's chunk: q [C, H, D], its keys at slots [P + C] int64 of k_cache/v_cache
    ([S, Hkv, D]; the chunk's own keys already stored, last), P = prefix_len fully visible
    and the chunk's causal -> [C, H, D]. The calls' shapes: see the module's docstring."""
    C, H, D = q.shape
    Hkv = k_cache.shape[1]
    Pf = prefix_len // block * block
    r = prefix_len - Pf
    S = round_up(r + C, bucket)  # the causal call's queries and keys
    Cq = round_up(C, bucket)  # the prefix call's queries
    rows = q.new_zeros(max(S, r + Cq), H, D)  # [L, H, D]: r zero rows, the chunk, zeros
    rows[r:r + C] = q
    qs = rows.transpose(0, 1).unsqueeze(0)  # [1, H, L, D], a view
    k = k_cache.new_zeros(S, Hkv, D)  # [S, Hkv, D]: the prefix's rest, the chunk, zeros
    v = v_cache.new_zeros(S, Hkv, D)
    torch.index_select(k_cache, 0, slots[Pf:], out=k[:r + C])
    torch.index_select(v_cache, 0, slots[Pf:], out=v[:r + C])
    out, lse = attend(qs[:, :, :S], k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), True, scale)
    out, lse = out[:, :, r:r + C], lse[:, :, r:r + C]
    if Pf:
        kp = k_cache.index_select(0, slots[:Pf]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, Pf, D]
        vp = v_cache.index_select(0, slots[:Pf]).transpose(0, 1).unsqueeze(0)
        o1, l1 = attend(qs[:, :, r:r + Cq], kp, vp, False, scale)
        out = merge_by_lse(o1[:, :, :C], l1[:, :, :C], out, lse)
    return out[0].transpose(0, 1)  # [C, H, D], a view


def plan_shapes(min_tokens: int, max_tokens: int, max_len: int, block: int = PREFIX_BLOCK,
                bucket: int = QUERY_BUCKET) -> list[tuple[bool, int, int]]:
    """Every (causal, query rows, keys) call chunk_attention makes for chunks of min_tokens
    to max_tokens queries whose prefix and chunk together stay within max_len tokens."""
    if min_tokens > min(max_tokens, max_len):
        return []
    # The causal call: r + C is any length from min_tokens up to a block past the longest chunk.
    top = min(max_tokens + block - 1, max_len)
    shapes = [(True, s, s) for s in range(round_up(min_tokens, bucket), round_up(top, bucket) + 1, bucket)]
    # The prefix call: each query bucket's shortest chunk leaves room for the longest prefix.
    for cq in range(round_up(min_tokens, bucket), round_up(max_tokens, bucket) + 1, bucket):
        shortest = max(min_tokens, cq - bucket + 1)
        shapes += [(False, cq, pf) for pf in range(block, max_len - shortest + 1, block)]
    return shapes


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
            device: torch.device, shapes: list[tuple[bool, int, int]]) -> None:
    """One call of each shape (plan_shapes), so that cuDNN builds its plans now."""
    for causal, sq, sk in shapes:
        q = torch.zeros(1, num_heads, sq, head_dim, dtype=dtype, device=device)  # [1, H, Sq, D]
        k = torch.zeros(1, num_kv_heads, sk, head_dim, dtype=dtype, device=device)  # [1, Hkv, Sk, D]
        attend_with_lse(q, k, k, causal, head_dim ** -0.5)


def chunk_attention_ref(q, k_cache, v_cache, slots, prefix_len, scale) -> torch.Tensor:
    """chunk_attention with the fp32 reference for each part."""
    return chunk_attention(q, k_cache, v_cache, slots, prefix_len, scale, attend=attend_with_lse_ref)


def library_attention_supported(dtype: torch.dtype, num_heads: int, num_kv_heads: int,
                                head_dim: int, device: torch.device) -> str | None:
    """None where chunk_attention runs on this device and layout, else why not. A probe
    call makes sure this torch build and cuDNN take the shape."""
    if device.type != "cuda":
        return "it needs CUDA"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"cuDNN's attention runs bfloat16 or float16 K/V, not {dtype}"
    if head_dim % 8 or head_dim > 128:
        return f"cuDNN's attention takes a head size of at most 128 in multiples of 8, not {head_dim}"
    try:
        q = torch.zeros(1, num_heads, 64, head_dim, dtype=dtype, device=device)  # [1, H, 64, D]
        k = torch.zeros(1, num_kv_heads, 64, head_dim, dtype=dtype, device=device)  # [1, Hkv, 64, D]
        attend_with_lse(q, k, k, True, 1.0)
        attend_with_lse(q, k, k, False, 1.0)
    except RuntimeError as e:
        return f"cuDNN's attention refused the layout: {str(e).splitlines()[0][:160]}"
    return None
