"""The penalties kernel compiled on the GPU at serving size (64 rows of 8-node trees x
SmolLM2's 49152 ids): the torch reference's values bit for bit (each operation rounded as
torch rounds it); captured in a CUDA graph and replayed on new logits; then
`apply_processing` on a tree with paths against the same on the CPU (the torch reference
throughout). tests/unit/test_triton_penalties.py
has the exact cases in the interpreter."""
from __future__ import annotations

import pytest
import torch

# Imported first: on a CPU-only machine the unit module switches on Triton's interpreter
# before anything imports triton.
from unit.test_triton_penalties import case  # isort: skip

from kestrel_kernels import penalties  # noqa: E402
from kestrel_kernels import triton_penalties as tpk  # noqa: E402
from kestrel_testing import require_compiled_triton  # noqa: E402

B, N, V = 64, 8, 49152


@pytest.fixture(autouse=True)
def _compiled():
    require_compiled_triton(tpk, "_penalize_kernel")


def test_kernel_at_serving_size_and_in_a_graph():
    gen = torch.Generator().manual_seed(0)
    x, count, in_prompt, *_ = case(5, N, V, False, True, gen)
    x, count, in_prompt = (t.repeat(13, 1, 1)[:B] for t in (x, count, in_prompt))
    rep, freq, pres = (torch.rand(B, generator=gen) * s + o for s, o in ((1.0, 0.5), (1.0, -0.3), (1.0, -0.2)))
    ref = penalties._penalize(x, count.float(), in_prompt, rep.view(B, 1, 1), freq.view(B, 1, 1), pres.view(B, 1, 1))
    dev = [t.cuda() for t in (x, count, in_prompt, rep, freq, pres)]
    out = tpk.penalize_triton(*dev)
    assert torch.equal(out.cpu(), ref)
    untouched = (count == 0) & ~in_prompt
    assert torch.equal(out.cpu()[untouched.expand(B, N, V)], x[untouched.expand(B, N, V)])
    static_x = dev[0].clone()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_out = tpk.penalize_triton(static_x, *dev[1:])
    new = torch.randn(B, N, V, generator=gen)
    static_x.copy_(new.cuda())
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, tpk.penalize_triton(new.cuda(), *dev[1:]))


def test_apply_processing_on_a_tree_matches_the_cpu():
    """The whole processing of tree nodes, paths and all: the GPU's (the kernel for the rows
    and for the path entries, torch for the rest) against the CPU's (torch)."""
    gen = torch.Generator().manual_seed(1)
    b, n, v = 6, 8, 4096
    logits = torch.randn(b, n, v, generator=gen) * 3
    counts = torch.randint(0, 3, (b, v), generator=gen) * (torch.rand(b, v, generator=gen) < 0.1)
    prompt = torch.rand(b, v, generator=gen) < 0.05
    path_tokens = torch.randint(0, 64, (b, n), generator=gen)  # small ids: repeats on paths
    parent = [-1, 0, 0, 1, 1, 3, 2, 5]  # a tree: node i's parent
    path = torch.zeros(n, n, dtype=torch.bool)
    for i in range(1, n):
        j = i
        while j > 0:
            path[i, j] = True
            j = parent[j]
    path_mask = path.expand(b, n, n).contiguous()
    p = penalties.Processing(
        presence=torch.full((b,), 0.4), frequency=torch.full((b,), 0.3), repetition=torch.full((b,), 1.2),
        min_tokens=torch.zeros(b, dtype=torch.int64), bias_token=torch.full((b, 1), 5),
        bias_value=torch.full((b, 1), -1.5), stop_token=torch.full((b, 0), -1, dtype=torch.int64),
        bad_last=torch.full((b, 0), -1, dtype=torch.int64), bad_prefix=torch.full((b, 0, 1), -1, dtype=torch.int64))
    num_out = torch.full((b,), 3, dtype=torch.int64)
    cpu = penalties.apply_processing(logits, p, counts, num_out, prompt, path_tokens, path_mask)
    to = lambda t: t.cuda()  # noqa: E731
    pg = penalties.Processing(*(to(getattr(p, f)) for f in p.__dataclass_fields__))
    gpu = penalties.apply_processing(to(logits), pg, to(counts), to(num_out), to(prompt), to(path_tokens),
                                     to(path_mask)).cpu()
    torch.testing.assert_close(gpu, cpu, rtol=0, atol=0)
    assert not torch.equal(cpu, logits)  # the processing did something
