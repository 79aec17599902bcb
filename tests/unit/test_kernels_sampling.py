"""kestrel_kernels.sampling: process_logits and sample_from_probs."""
from __future__ import annotations

import math

import pytest
import torch
from scipy.stats import chisquare

from kestrel_kernels.sampling import process_logits, sample_from_probs


def _row(logits, temperature, top_p, top_k):
    """One-row call helper; returns probs [V] float32."""
    return process_logits(
        torch.tensor([logits], dtype=torch.float32),
        torch.tensor([temperature], dtype=torch.float32),
        torch.tensor([top_p], dtype=torch.float32),
        torch.tensor([top_k], dtype=torch.int64),
    )[0]


def _reference_row(logits: list[float], temperature: float, top_p: float, top_k: int) -> list[float]:
    """Independent per-row reference in plain Python (top-k, renormalise, top-p)."""
    m = max(logits)
    e = [math.exp((x - m) / temperature) for x in logits]
    z = sum(e)
    p = [x / z for x in e]
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))  # stable: lower id first on ties
    kept = order if top_k <= 0 else order[:top_k]
    zk = sum(p[i] for i in kept)
    pk = {i: p[i] / zk for i in kept}
    final = []
    cum = 0.0
    for r, i in enumerate(kept):
        if r == 0 or cum < top_p or top_p >= 1.0:
            final.append(i)
        cum += pk[i]
    zf = sum(p[i] for i in final)
    return [p[i] / zf if i in final else 0.0 for i in range(len(p))]


def test_hand_computed_temperature_topk_topp():
    # logits/T = [4, 2, 0, -2]; softmax ~ [0.8668, 0.1173, 0.0159, 0.0021].
    # top_k=3 drops token 3; top_p=0.9 on the renormalised top-3: exclusive cumsum
    # [0, 0.868, 0.984] -> keep tokens 0 and 1 only.
    probs = _row([2.0, 1.0, 0.0, -1.0], temperature=0.5, top_p=0.9, top_k=3)
    e4, e2 = math.exp(4.0), math.exp(2.0)
    expected = torch.tensor([e4 / (e4 + e2), e2 / (e4 + e2), 0.0, 0.0])
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-6)


def test_hand_computed_topk_only():
    probs = _row([0.0, 3.0, 1.0, 2.0], temperature=1.0, top_p=1.0, top_k=2)
    e3, e2 = math.exp(3.0), math.exp(2.0)
    expected = torch.tensor([0.0, e3 / (e3 + e2), 0.0, e2 / (e3 + e2)])
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=1e-6)


def test_no_limits_is_plain_softmax_with_temperature():
    logits = torch.tensor([[0.3, -1.2, 2.5, 0.0, 1.1]])
    for top_k in (0, -1, 5, 100):
        probs = process_logits(logits, torch.tensor([1.7]), torch.tensor([1.0]), torch.tensor([top_k]))
        torch.testing.assert_close(probs, torch.softmax(logits / 1.7, dim=-1))


def test_top_p_keeps_smallest_set_reaching_p():
    # probs proportional to [0.5, 0.25, 0.125, 0.125]
    logits = [math.log(0.5), math.log(0.25), math.log(0.125), math.log(0.125)]
    p_below = _row(logits, 1.0, 0.74, 0)  # 0.5 < 0.74 <= 0.75 -> {0, 1}
    assert (p_below > 0).tolist() == [True, True, False, False]
    torch.testing.assert_close(p_below, torch.tensor([2 / 3, 1 / 3, 0.0, 0.0]))
    p_above = _row(logits, 1.0, 0.76, 0)  # 0.75 < 0.76 -> {0, 1, 2} (tie 2/3 -> lower id)
    assert (p_above > 0).tolist() == [True, True, True, False]
    p_tiny = _row(logits, 1.0, 0.01, 0)  # the top token is always kept
    assert p_tiny.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_ties_ranked_toward_lower_token_id():
    probs = _row([1.0, 2.0, 2.0, 2.0, 0.0], 1.0, 1.0, 2)
    assert (probs > 0).tolist() == [False, True, True, False, False]
    torch.testing.assert_close(probs[1], torch.tensor(0.5))


def test_greedy_rows_are_one_hot_not_nan():
    logits = torch.tensor([[0.1, 5.0, 4.0], [3.0, -1.0, 2.0], [0.0, 0.0, 1.0]])
    temperature = torch.tensor([0.0, 0.8, 0.0])
    probs = process_logits(logits, temperature, torch.tensor([0.9, 1.0, 0.5]), torch.tensor([0, 0, 2]))
    assert not torch.isnan(probs).any()
    assert probs[0].tolist() == [0.0, 1.0, 0.0]
    assert probs[2].tolist() == [0.0, 0.0, 1.0]
    torch.testing.assert_close(probs[1], torch.softmax(logits[1] / 0.8, dim=-1))


def test_batched_rows_match_independent_reference():
    g = torch.Generator().manual_seed(7)
    T, V = 64, 12
    logits = torch.randn(T, V, generator=g) * 2
    logits[::5, 3] = logits[::5, 4]  # some exact ties
    temperature = torch.rand(T, generator=g) * 1.5 + 0.2
    top_p = torch.rand(T, generator=g) * 0.9 + 0.1
    top_p[::7] = 1.0
    top_k = torch.randint(-1, V + 2, (T,), generator=g)
    probs = process_logits(logits, temperature, top_p, top_k)
    assert probs.shape == (T, V) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(T))
    for t in range(T):
        ref = _reference_row(logits[t].tolist(), float(temperature[t]), float(top_p[t]), int(top_k[t]))
        torch.testing.assert_close(probs[t], torch.tensor(ref), atol=1e-5, rtol=1e-4, msg=f"row {t}")


def test_sample_inverse_cdf_boundaries():
    probs = torch.tensor([[0.25, 0.25, 0.5]] * 4 + [[0.0, 0.5, 0.5], [0.5, 0.5, 0.0]])
    coins = torch.tensor([0.0, 0.2499, 0.25, 0.75, 0.0, 0.9999999])
    tokens = sample_from_probs(probs, coins)
    assert tokens.dtype == torch.int64
    # first index whose cumsum exceeds coin*total; zero-prob tokens are skipped
    assert tokens.tolist() == [0, 0, 1, 2, 1, 1]


def test_sample_unnormalised_and_edge_coin():
    probs = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0]])  # total 8
    assert sample_from_probs(probs, torch.tensor([0.2])).tolist() == [1]  # 1.6 < 2
    assert sample_from_probs(probs, torch.tensor([0.3])).tolist() == [3]
    # coin just below 1 in float32: must still land on a positive-probability token
    assert sample_from_probs(probs, torch.tensor([1.0 - 2**-24])).tolist() == [3]


def test_sample_frequencies_follow_probs_and_skip_zero_prob():
    g = torch.Generator().manual_seed(1234)
    p = torch.tensor([0.1, 0.0, 0.4, 0.2, 0.0, 0.3])
    T = 20000
    coins = torch.rand(T, generator=g)
    tokens = sample_from_probs(p.expand(T, -1), coins)
    counts = torch.bincount(tokens, minlength=p.numel()).double()
    assert counts[p == 0].sum() == 0
    nz = p > 0
    expected = p[nz].double() / p[nz].double().sum() * T
    assert chisquare(counts[nz].numpy(), expected.numpy()).pvalue > 1e-3
    # a shifted distribution is clearly rejected by the same check (the test can fail)
    shifted = torch.tensor([0.2, 0.3, 0.2, 0.3], dtype=torch.float64)
    assert chisquare(counts[nz].numpy(), (shifted.double() * T).numpy()).pvalue < 1e-6


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sample_never_returns_zero_prob_token_random(seed):
    g = torch.Generator().manual_seed(seed)
    T, V = 512, 16
    probs = torch.rand(T, V, generator=g)
    probs[torch.rand(T, V, generator=g) < 0.6] = 0.0
    probs[:, 5] += 1e-3  # keep every row non-empty
    coins = torch.rand(T, generator=g)
    coins[:8] = 1.0 - 2**-24
    coins[8:16] = 0.0
    tokens = sample_from_probs(probs, coins)
    assert (probs[torch.arange(T), tokens] > 0).all()


def test_unfiltered_rows_skip_the_sort_and_match_a_no_op_filter():
    """filtered=False skips the sort; top_k = V goes through the sort yet keeps every
    token: the two distributions agree."""
    torch.manual_seed(3)
    V = 300
    logits = torch.randn(5, V) * 3
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.0, 2.0])
    fast = process_logits(logits, temperature, torch.ones(5), torch.zeros(5, dtype=torch.int64), filtered=False)
    slow = process_logits(logits, temperature, torch.ones(5), torch.full((5,), V, dtype=torch.int64))
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-6)
    assert torch.equal(fast[3], torch.nn.functional.one_hot(logits[3].argmax(), V).float())


def _mixed_rows(T: int = 24, V: int = 500, seed: int = 5):
    """Rows of every kind: greedy, plain temperature, top-k, top-p, min-p and mixes."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, V, generator=g) * 3
    temperature = torch.rand(T, generator=g) + 0.3
    temperature[::5] = 0.0
    top_p = torch.rand(T, generator=g) * 0.5 + 0.5
    top_p[::3] = 1.0
    top_k = torch.randint(-1, 40, (T,), generator=g)
    top_k[::4] = 0
    min_p = torch.rand(T, generator=g) * 0.1
    min_p[::2] = 0.0
    return logits, temperature, top_p, top_k, min_p


def test_a_row_is_processed_alone_whatever_else_is_in_the_batch():
    """Each row comes back as if processed alone, bit for bit; rows that truncate nothing
    are their softmax exactly, so the filtered flag changes nothing for them (it only lets
    a batch without truncation skip the sort)."""
    logits, temperature, top_p, top_k, min_p = _mixed_rows()
    batch = process_logits(logits, temperature, top_p, top_k, min_p)
    for i in range(logits.shape[0]):
        alone = process_logits(logits[i:i + 1], temperature[i:i + 1], top_p[i:i + 1], top_k[i:i + 1],
                               min_p[i:i + 1])
        assert torch.equal(alone[0], batch[i]), f"row {i}"
    plain = (top_k <= 0) & (top_p >= 1.0) & (min_p == 0)
    assert 0 < int(plain.sum()) < len(plain)
    unfiltered = process_logits(logits[plain], temperature[plain], top_p[plain], top_k[plain], None,
                                filtered=False)
    assert torch.equal(unfiltered, batch[plain])


def test_sample_rows_is_argmax_for_greedy_rows_and_the_sampled_rows_alone_for_the_rest():
    from kestrel_kernels.sampling import sample_rows
    logits, temperature, top_p, top_k, min_p = _mixed_rows()
    coins = torch.rand(logits.shape[0], generator=torch.Generator().manual_seed(1))
    tokens = sample_rows(logits, temperature, top_p, top_k, min_p, coins)
    hot = temperature > 0
    assert torch.equal(tokens[~hot], logits[~hot].argmax(-1))
    alone = sample_from_probs(process_logits(logits[hot], temperature[hot], top_p[hot], top_k[hot],
                                             min_p[hot]), coins[hot])
    assert torch.equal(tokens[hot], alone)
    assert not torch.equal(tokens[hot], logits[hot].argmax(-1))  # the coins decided some rows


def test_sampling_reads_nothing_on_the_host():
    """No op of the sampling reads a device value on the host (on a GPU each would wait for
    the stream: benchmarks/step_ops.py): what the data decides is selected on the device."""
    from benchmarks.step_ops import HostReads
    from kestrel_kernels.sampling import sample_rows
    logits, temperature, top_p, top_k, min_p = _mixed_rows()
    coins = torch.rand(logits.shape[0])
    edge = torch.tensor([[0.0, 2.0, 0.0, 6.0, 0.0]])  # a coin at the top of the range: the rare branch
    reads = HostReads()
    reads.active = True
    with reads:
        sample_rows(logits, temperature, top_p, top_k, min_p, coins)
        sample_rows(logits, temperature, torch.ones_like(top_p), torch.zeros_like(top_k), None, coins,
                    filtered=False)
        sample_from_probs(edge, torch.tensor([1.0 - 2**-24]))
    assert reads.reads == []
