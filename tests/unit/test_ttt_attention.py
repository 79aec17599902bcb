"""The training-time-test attention against its dense-mask reference: outputs and gradients
at every unrolled step, with grouped KV heads, in float32 and under bfloat16 autocast."""
import pytest
import torch

from training.ttt_attention import TTTAttention, ttt_attention, ttt_attention_dense


def _steps(B=2, T=37, Hq=6, Hkv=2, D=16, steps=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda H: torch.randn(B * T, H, D, generator=g, requires_grad=True)  # noqa: E731  [B*T, H, D] f32
    return [(mk(Hq), mk(Hkv), mk(Hkv)) for _ in range(steps)]


def _run(attend, steps, B=2, T=37):
    attn = TTTAttention(B, T, attend)
    return [attn(q, k, v, 0) for q, k, v in steps]  # per step [B*T, Hq, D]


def test_every_step_equals_the_dense_mask_with_gradients():
    steps = _steps()
    fast, dense = _run(ttt_attention, steps), _run(ttt_attention_dense, steps)
    for n, (a, b) in enumerate(zip(fast, dense)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"step {n}")
    w = torch.randn(len(fast), *fast[0].shape, generator=torch.Generator().manual_seed(1))
    grads = []
    for outs in (fast, dense):
        loss = sum((o * w[i]).sum() for i, o in enumerate(outs))
        grads.append(torch.autograd.grad(loss, [t for s in steps for t in s]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_a_later_step_sees_its_own_chain_only():
    # step 2's query at position p: changing step 1's key at another position q != p must not
    # move it, changing the one at p must
    steps = _steps(B=1, T=8, steps=3)
    base = _run(ttt_attention, steps, B=1, T=8)[2].detach()
    q1, k1, v1 = steps[1]
    k1b = k1.detach().clone()
    k1b[5] += 3.0
    moved = _run(ttt_attention, [steps[0], (q1, k1b, v1), steps[2]], B=1, T=8)[2].detach()
    changed = (moved - base).abs().amax(dim=(1, 2)) > 1e-6  # [T] bool
    assert changed.tolist() == [p == 5 for p in range(8)]


@pytest.mark.parametrize("n", [1, 6])
def test_bfloat16_autocast_stays_near_the_reference(n):
    steps = _steps(steps=n + 1, seed=n)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast = _run(ttt_attention, steps)[-1].float()
    dense = _run(ttt_attention_dense, steps)[-1]
    torch.testing.assert_close(fast, dense, atol=3e-2, rtol=3e-2)
