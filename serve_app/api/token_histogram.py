"""A histogram that takes an observation many times at once, for the per-token metrics.

Streaming a chunk of n tokens observes the inter-token gap n times and the tokens counter
once; prometheus_client's Histogram takes a lock and walks its buckets per observation, a
few microseconds each, on the event loop that also writes every stream's chunks (about a
twentieth of the replica's CPU at hundreds of streams, with speculation's chunks of several
tokens). Here an observation of any count is one bisect and three additions, without a
lock: the replica's metrics are updated and read on its one event loop. Exported at scrape
time in the Histogram's text format (`_bucket{le}`, `_sum`, `_count`)."""
from __future__ import annotations

import bisect

from prometheus_client.core import HistogramMetricFamily


class TokenHistogram:
    """One label value's histogram (the model's name), registered as a collector."""

    def __init__(self, name: str, documentation: str, model: str, buckets: tuple[float, ...]):
        self.name, self.documentation, self.model = name, documentation, model
        self.bounds = list(buckets)
        self.counts = [0] * (len(buckets) + 1)  # per bucket, the last one +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        """`value` observed `count` times."""
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def describe(self):
        return []

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=["model"])
        cumulative, buckets = 0, []
        for le, n in zip([*map(str, self.bounds), "+Inf"], self.counts):
            cumulative += n
            buckets.append((le, cumulative))
        family.add_metric([self.model], buckets, self.sum)
        yield family
