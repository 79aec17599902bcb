"""The draft's token loss: cross-entropy against the target's distribution, through an LM
head, a chunk of rows at a time.

For each supervised row i the head's hidden h_i goes through the LM head W ([V, H]) and
is scored against the target's next-token probabilities p_i:
    ce_i = -sum_v p_i[v] * log_softmax(h_i @ W^T)[v],   loss = sum_i weight_i * ce_i.
Through autograd that holds several [rows, V] fp32 tensors per unrolled step (logits,
log-probabilities, the gathered targets, their product, and as many in the backward):
at 10k rows and SmolLM2's 49,152 ids, tens of gigabytes moved per training step, which
then bounds the step. `soft_ce` forms the gradient in the forward instead, chunk by
chunk (d ce_i / d logits_i = softmax_i * sum(p_i) - p_i), and keeps only d loss / d h
([rows, H]) and, when W trains (EAGLE-3's own head), d loss / d W ([V, H]).
`soft_ce_reference` is the plain autograd path, kept for the tests and the benchmark.
"""
from __future__ import annotations

import torch

CHUNK_ROWS = 2048  # rows of logits at once: [2048, 49152] fp32 is 400 MB


def _logits(h: torch.Tensor, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, H] @ [V, H]^T in `dtype` (bf16 under the trainer's autocast) -> [N, V] fp32."""
    return (h.to(dtype) @ w.to(dtype).t()).float()


def soft_ce_reference(hidden: torch.Tensor, weight: torch.Tensor, t_probs: torch.Tensor,
                      rows: torch.Tensor, row_weights: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """hidden [N, H], weight [V, H], t_probs [M, V] fp32, rows [N] int64 (row i's targets
    are t_probs[rows[i]]), row_weights [N] fp32 -> (weighted loss [], argmax ids [N])."""
    logits = _logits(hidden, weight, dtype)  # [N, V] fp32
    ce = -(t_probs[rows] * torch.log_softmax(logits, -1)).sum(-1)  # [N]
    return (ce * row_weights).sum(), logits.argmax(-1)


class _SoftCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, t_probs, rows, row_weights, dtype, chunk, grads):
        N, H = hidden.shape
        dev = hidden.device
        w = weight.detach().to(dtype)  # [V, H]; no copy when already in dtype
        loss = torch.zeros((), dtype=torch.float32, device=dev)
        guess = torch.empty(N, dtype=torch.int64, device=dev)  # [N] argmax of the logits
        d_hidden = torch.empty(N, H, dtype=torch.float32, device=dev) if grads else None  # [N, H]
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=dev) \
            if grads and ctx.needs_input_grad[1] else None
        for a in range(0, N, chunk):
            h = hidden[a:a + chunk].detach().to(dtype)  # [c, H]
            logits = _logits(h, w, dtype)  # [c, V] fp32
            guess[a:a + chunk] = logits.argmax(-1)
            t = t_probs[rows[a:a + chunk]]  # [c, V] fp32
            rw = row_weights[a:a + chunk]  # [c]
            lse = torch.logsumexp(logits, -1)  # [c]
            t_sum = t.sum(-1)  # [c]: 1 for a distribution
            # ce = sum_v t_v * (lse - logit_v)
            ce = lse * t_sum - torch.linalg.vecdot(t, logits)  # [c]
            loss += (ce * rw).sum()
            if not grads:  # evaluation: the loss and the argmax only
                continue
            # d(rw * ce) / d logits = softmax * (rw * sum(t)) - t * rw: softmax, then two
            # in-place passes (each pass over [c, V] costs as much as the matmul's output)
            g = torch.softmax(logits, -1).mul_((rw * t_sum)[:, None]).addcmul_(t, rw[:, None], value=-1.0)
            g = g.to(dtype)  # [c, V]: the matmul's input dtype, as autograd's backward would cast it
            d_hidden[a:a + chunk] = (g @ w).float()
            if d_weight is not None:
                d_weight += (g.t() @ h).float()
        ctx.mark_non_differentiable(guess)
        ctx.save_for_backward(d_hidden, d_weight)
        ctx.hidden_dtype, ctx.weight_dtype = hidden.dtype, weight.dtype
        return loss, guess

    @staticmethod
    def backward(ctx, grad_loss, _grad_guess):
        d_hidden, d_weight = ctx.saved_tensors
        gh = (d_hidden * grad_loss).to(ctx.hidden_dtype)
        gw = None if d_weight is None else (d_weight * grad_loss).to(ctx.weight_dtype)
        return gh, gw, None, None, None, None, None, None


def soft_ce(hidden: torch.Tensor, weight: torch.Tensor, t_probs: torch.Tensor, rows: torch.Tensor,
            row_weights: torch.Tensor, dtype: torch.dtype = torch.float32,
            chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """The same as soft_ce_reference, holding at most `chunk` rows of logits at a time.
    The loss is differentiable in hidden and (when it requires grad) weight; t_probs and
    row_weights are constants. Without grad mode (evaluation) no gradient is formed."""
    grads = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _SoftCE.apply(hidden, weight, t_probs.detach(), rows, row_weights.detach(), dtype, chunk, grads)
