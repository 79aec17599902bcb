"""The soak generator (benchmarks/soak.py) at CI size against the real Serve app: mixed
streams, completions, abandoned streams and bad requests from several clients at once;
nothing failed or lost, every bad request a 4xx with an error body, and the KV cache and
the running count back where they started. The full sizes run by hand (docs/reliability.md)."""
from __future__ import annotations

import asyncio

import pytest

pytestmark = [pytest.mark.timeout(300)]


def test_soak_loses_nothing_and_returns_the_kv(server):
    from benchmarks.soak import healthy, soak
    server.wait_idle()
    report = asyncio.run(soak(server.base_url, streams=6, seconds=10, max_tokens=16, seed=1,
                              request_timeout_s=120, rss_every_s=2))
    print({k: report[k] for k in ("requests", "completed", "stopped", "rejected", "busy", "failed",
                                  "lost", "tok_s", "rss_growth_mb", "examples")})
    assert healthy(report), report
    # The mix really ran: every kind of request came up and was answered as it should be.
    assert report["completed"] >= 5 and report["stopped"] >= 1 and report["rejected"] >= 1, report
