"""Triton kernel for the penalties of `kestrel_kernels.penalties` (its `_penalize` is the reference).

The repetition, frequency and presence penalties are one elementwise formula over logits
[B, N, V] with each row's counts of emitted ids broadcast over its N tree nodes. In torch
that is about eight passes over the logits (each comparison, division, product, select and
difference its own kernel): at batch 64 of 8-node trees, 100 MB of fp32 logits per pass,
some 1.7 GB of traffic per step. Here it is one read and one write. The counts and the
prompt flags are read with strides, so the same kernel serves the rows' counts [B, V]
(node stride 0) and the tree's path entries [B, N, N] (counts per entry), and every
penalized logit on a GPU comes from this one formula: a tree node and a plain step that
see the same value and count compute the same result. Each operation rounds as torch's
does: the division to nearest, and no multiply-add fusion (enable_fp_fusion=False), so the
kernel's values are the reference's bit for bit.
"""
from __future__ import annotations

import torch

from kestrel_kernels.triton_available import HAS_TRITON, tl, triton

__all__ = ["HAS_TRITON", "penalize_triton"]

BLOCK_V = 1024  # ids per program


if HAS_TRITON:

    @triton.jit
    def _penalize_kernel(
        X, C, P, Out, Rep, Freq, Pres, N, V,
        sxb, sxn, scb, scn, spb, spn,
        HAS_PROMPT: tl.constexpr, BLOCK: tl.constexpr,
    ):
        node = tl.program_id(0).to(tl.int64)  # b * N + n
        b, n = node // N, node % N
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < V
        x = tl.load(X + b * sxb + n * sxn + offs, mask=ok, other=0.0)
        c = tl.load(C + b * scb + n * scn + offs, mask=ok, other=0).to(tl.float32)
        counted = c > 0
        seen = counted
        if HAS_PROMPT:
            seen = seen | (tl.load(P + b * spb + n * spn + offs, mask=ok, other=0) != 0)
        rep = tl.load(Rep + b)
        y = tl.where(seen, tl.where(x > 0, tl.math.div_rn(x, rep), x * rep), x)
        y = y - tl.load(Freq + b) * c
        y = y - tl.load(Pres + b) * counted.to(tl.float32)
        tl.store(Out + node * V + offs, y, mask=ok)


def _strides(t: torch.Tensor, B: int, N: int, V: int) -> tuple[int, int]:
    """(batch, node) strides of `t` as [B, N, V] ([B, V]: node stride 0); the last dim
    must be contiguous."""
    t3 = t if t.dim() == 3 else t[:, None, :]
    t3 = t3.expand(B, N, V)
    if t3.stride(2) != 1:
        raise ValueError("the penalties kernel needs a contiguous last dimension")
    return t3.stride(0), t3.stride(1)


def penalize_triton(x: torch.Tensor, count: torch.Tensor, in_prompt: torch.Tensor | None,
                    rep: torch.Tensor, freq: torch.Tensor, pres: torch.Tensor) -> torch.Tensor:
    """`_penalize` on the GPU: x [B, N, V] float32; count [B, V] or [B, N, V] (any number
    type), in_prompt the same shapes in bool or None; rep, freq, pres [B] float32 -> a new
    [B, N, V] float32 tensor."""
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed; use kestrel_kernels.penalties")
    B, N, V = x.shape
    if x.stride(2) != 1:
        x = x.contiguous()
    out = torch.empty((B, N, V), dtype=torch.float32, device=x.device)  # [B, N, V] penalized
    if out.numel() == 0:
        return out
    scb, scn = _strides(count, B, N, V)
    prompt = in_prompt.view(torch.uint8) if in_prompt is not None else count  # any pointer when absent
    spb, spn = _strides(prompt, B, N, V)
    block = min(BLOCK_V, triton.next_power_of_2(V))
    _penalize_kernel[(B * N, triton.cdiv(V, block))](
        x, count, prompt, out, rep.float().contiguous(), freq.float().contiguous(),
        pres.float().contiguous(), N, V, x.stride(0), x.stride(1), scb, scn, spb, spn,
        HAS_PROMPT=in_prompt is not None, BLOCK=block, num_warps=4, enable_fp_fusion=False,
    )
    return out
