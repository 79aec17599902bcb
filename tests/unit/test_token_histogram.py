"""TokenHistogram exports what prometheus_client's Histogram would for the same observations."""
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from serve_app.api.token_histogram import TokenHistogram

BUCKETS = (0.005, 0.01, 0.1, 1.0)


def test_counted_observations_export_like_the_histogram():
    ref_registry, registry = CollectorRegistry(), CollectorRegistry()
    ref = Histogram("x_seconds", "doc", ["model"], buckets=BUCKETS, registry=ref_registry).labels("m")
    ours = TokenHistogram("x_seconds", "doc", "m", BUCKETS)
    registry.register(ours)
    for value, count in ((0.003, 4), (0.01, 1), (0.5, 3), (7.0, 2), (0.0, 0)):
        for _ in range(count):
            ref.observe(value)
        ours.observe(value, count)

    def series(reg):
        return sorted(line for line in generate_latest(reg).decode().splitlines()
                      if line.startswith("x_seconds_") and "_created" not in line)
    assert series(registry) == series(ref_registry)
    assert 'x_seconds_bucket{le="0.01",model="m"} 5.0' in series(registry)
