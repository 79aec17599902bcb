"""A sampled request's coins are drawn a block of steps at a time; the stream must be the
one per-step draws from the same seeded generator give (so seeded outputs never change
with the block size), across block boundaries."""
import torch

from serve_app.engine.request import COIN_BLOCK, CoinStream


def test_block_draws_equal_per_step_draws():
    width, steps = 9, 2 * COIN_BLOCK + 5
    stream = CoinStream(1234, width)
    got = torch.stack([torch.from_numpy(stream.next().copy()) for _ in range(steps)])
    g = torch.Generator().manual_seed(1234)
    want = torch.stack([torch.rand(width, generator=g) for _ in range(steps)])
    assert torch.equal(got, want)
    assert ((got >= 0) & (got < 1)).all() and got.unique().numel() > steps
