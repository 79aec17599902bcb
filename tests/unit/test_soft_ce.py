"""The chunked soft-target cross-entropy against the plain autograd path: loss, argmax and
gradients, with a frozen LM head (EAGLE-1: the target's) and a trained one (EAGLE-3)."""
import pytest
import torch

from training.soft_ce import soft_ce, soft_ce_reference


def _case(N=37, H=16, V=101, M=29, seed=0, hard=False, weight_grad=False):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, H, generator=g, requires_grad=True)  # [N, H] f32
    weight = torch.randn(V, H, generator=g).requires_grad_(weight_grad)  # [V, H] f32
    t_logits = 3 * torch.randn(M, V, generator=g)  # [M, V]
    t_probs = (torch.nn.functional.one_hot(t_logits.argmax(-1), V).float() if hard
               else torch.softmax(t_logits, -1))  # [M, V] f32
    rows = torch.randint(0, M, (N,), generator=g)  # [N] int64, rows repeat
    row_weights = torch.rand(N, generator=g) * (torch.rand(N, generator=g) > 0.2)  # [N], some zero
    return hidden, weight, t_probs, rows, row_weights


def _grads(fn, hidden, weight, *rest, **kw):
    loss, guess = fn(hidden, weight, *rest, **kw)
    params = [hidden] + ([weight] if weight.requires_grad else [])
    return loss.detach(), guess, torch.autograd.grad(3.5 * loss, params)


@pytest.mark.parametrize("chunk", [1, 8, 64])
@pytest.mark.parametrize("weight_grad", [False, True])
@pytest.mark.parametrize("hard", [False, True])
def test_chunked_equals_the_autograd_path(chunk, weight_grad, hard):
    case = _case(hard=hard, weight_grad=weight_grad)
    ref_loss, ref_guess, ref_grads = _grads(soft_ce_reference, *case)
    loss, guess, grads = _grads(soft_ce, *case, chunk=chunk)
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    assert torch.equal(guess, ref_guess)
    assert len(grads) == len(ref_grads) == 1 + weight_grad
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_targets_that_do_not_sum_to_one():
    # the gradient is softmax * sum(p) - p, not softmax - p
    hidden, weight, t_probs, rows, row_weights = _case()
    t_probs = t_probs * torch.linspace(0.2, 1.5, t_probs.shape[0])[:, None]
    ref = _grads(soft_ce_reference, hidden, weight, t_probs, rows, row_weights)
    got = _grads(soft_ce, hidden, weight, t_probs, rows, row_weights, chunk=5)
    torch.testing.assert_close(got[0], ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[2][0], ref[2][0], atol=1e-5, rtol=1e-5)


def test_bfloat16_logits_match_the_autograd_path_in_bfloat16():
    # the trainer's GPU path: the LM head's matmuls in bf16, the loss in fp32
    case = _case(N=64, H=32, V=257, weight_grad=True)
    ref = _grads(soft_ce_reference, *case, dtype=torch.bfloat16)
    got = _grads(soft_ce, *case, dtype=torch.bfloat16, chunk=16)
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)
    for a, b in zip(got[2], ref[2]):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)
    assert got[2][0].dtype == torch.float32 and got[2][1].dtype == torch.float32



def test_evaluation_forms_no_gradient():
    # under no_grad (the trainer's held-out evaluation): the same loss and argmax, nothing saved
    case = _case(weight_grad=True)
    ref_loss, ref_guess = soft_ce_reference(*case)
    with torch.no_grad():
        loss, guess = soft_ce(*case, chunk=8)
    assert loss.grad_fn is None and torch.equal(guess, ref_guess)
    torch.testing.assert_close(loss, ref_loss.detach(), atol=1e-5, rtol=1e-5)
