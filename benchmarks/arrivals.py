"""When an open-loop run's requests arrive: offsets in seconds from the run's start.

Requests arrive in groups of `burst` (1: one at a time). The gaps between groups are
gamma-distributed with shape `burstiness` and mean burst / rate, as vLLM's
benchmark_serving draws them: shape 1 is a Poisson process, below 1 the arrivals bunch up
(the gaps' coefficient of variation is 1 / sqrt(shape)), and `inf` spaces the groups
evenly. The mean request rate is `rate` whatever the shape and burst; rate `inf` sends
every request at once. One seed gives the same draws at every rate, scaled, so a sweep's
rates differ only in speed.
"""
from __future__ import annotations

import math
import random


def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, burst: int = 1, seed: int = 0) -> list[float]:
    """n offsets (s, non-decreasing, the first 0) for requests arriving at `rate` per second."""
    if not rate > 0 or not burstiness > 0 or burst < 1:
        raise ValueError(f"need rate > 0, burstiness > 0, burst >= 1; got {rate}, {burstiness}, {burst}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    mean_gap = burst / rate
    offsets: list[float] = []
    t = 0.0
    while len(offsets) < n:
        offsets += [t] * min(burst, n - len(offsets))
        t += mean_gap if math.isinf(burstiness) else rng.gammavariate(burstiness, mean_gap / burstiness)
    return offsets
