"""The open-loop benchmark's parts that need no server: the arrival schedule, the mix, the
summary against the SLO, the client's request bodies and the plot's series."""
import json
import math
import statistics

import pytest

from benchmarks.arrivals import arrival_offsets
from benchmarks.http_client import request_body
from benchmarks.length_mix import load_mix, mt_bench_mix, requests_for
from benchmarks.open_loop import summarize_open, table
from benchmarks.plot_open_loop import series


def _gaps(offsets):
    return [b - a for a, b in zip(offsets, offsets[1:])]


def test_poisson_arrivals_keep_the_rate_and_the_spread_of_exponential_gaps():
    offsets = arrival_offsets(20001, rate=10.0, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    gaps = _gaps(offsets)
    assert abs(statistics.mean(gaps) - 0.1) < 0.003  # 20000 gaps: the mean's sd is 0.0007
    assert abs(statistics.stdev(gaps) / statistics.mean(gaps) - 1.0) < 0.05


def test_burstiness_below_one_spreads_the_gaps_at_the_same_rate():
    gaps = _gaps(arrival_offsets(20001, rate=10.0, burstiness=0.25, seed=3))
    assert abs(statistics.mean(gaps) - 0.1) < 0.01
    assert statistics.stdev(gaps) / statistics.mean(gaps) > 1.7  # 1 / sqrt(0.25) = 2


def test_one_seed_gives_every_rate_the_same_schedule_scaled():
    slow, fast = arrival_offsets(50, 2.0, seed=7), arrival_offsets(50, 8.0, seed=7)
    assert all(math.isclose(a, 4 * b, rel_tol=1e-9) for a, b in zip(slow, fast))
    assert arrival_offsets(50, 2.0, seed=8) != slow


def test_bursts_arrive_together_and_keep_the_mean_rate():
    offsets = arrival_offsets(10, rate=4.0, burst=4, burstiness=math.inf)
    assert offsets == [0.0] * 4 + [1.0] * 4 + [2.0] * 2  # groups of 4 every 4 / 4 req/s
    poisson = arrival_offsets(40000, rate=4.0, burst=4, seed=1)
    groups = [poisson[i:i + 4] for i in range(0, len(poisson), 4)]
    assert all(len(set(g)) == 1 for g in groups)
    assert abs(poisson[-1] / (len(groups) - 1) - 1.0) < 0.03


def test_rate_inf_sends_everything_at_once_and_bad_settings_are_refused():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    for bad in ({"rate": 0.0}, {"rate": 1.0, "burstiness": 0.0}, {"rate": 1.0, "burst": 0}):
        with pytest.raises(ValueError):
            arrival_offsets(3, **bad)


def _row(ttft, tpot, tokens=101, gaps=(0.01,), lag=0.0):
    return {"ttft": ttft, "tpot": tpot, "tokens": tokens, "e2e": ttft + tpot * (tokens - 1),
            "chunks": len(gaps) + 1, "gaps": list(gaps), "lag": lag, "end": 0.0}


def test_goodput_counts_requests_within_both_bounds_and_failures_as_missed():
    rows = [_row(0.1, 0.02), _row(0.5, 0.05),           # on both bounds: met
            _row(0.6, 0.02), _row(0.1, 0.06),           # one bound missed each
            {"error": "RuntimeError: HTTP 503", "lag": 0.002, "end": 0.0}]
    s = summarize_open(rows, seconds=2.0, slo_ttft_s=0.5, slo_tpot_s=0.05)
    assert (s["requests"], s["completed"], s["failed"]) == (5, 4, 1)
    assert s["errors"] == ["RuntimeError: HTTP 503"]
    assert s["goodput_req_s"] == 1.0 and s["slo_met_share"] == 0.4
    assert s["req_s"] == 2.0 and s["tok_s"] == 4 * 101 / 2.0
    assert s["send_lag_p99_ms"] == 2.0


def test_percentiles_of_synthetic_timings():
    rows = [_row(ttft=i / 1000, tpot=(100 - i) / 1000, gaps=[i / 1000] * 2) for i in range(1, 101)]
    s = summarize_open(rows, seconds=10.0, slo_ttft_s=1.0, slo_tpot_s=1.0)
    assert s["ttft_p50_ms"] == pytest.approx(51) and s["ttft_p99_ms"] == pytest.approx(100)
    assert s["tpot_p50_ms"] == pytest.approx(50) and s["tpot_p99_ms"] == pytest.approx(99)
    assert s["itl_p50_ms"] == pytest.approx(51) and s["itl_p99_ms"] == pytest.approx(100)
    assert s["e2e_p99_s"] == pytest.approx(max(r["e2e"] for r in rows))
    assert "| 2 |" in table("x", [{**s, "request_rate": 2}])


def test_a_rate_where_everything_failed_has_no_latencies():
    s = summarize_open([{"error": "x", "lag": 0.0, "end": 0.0}], 1.0, 0.5, 0.05)
    assert s["ttft_p99_ms"] is None and s["goodput_req_s"] == 0.0
    assert "| - |" in table("x", [{**s, "request_rate": "inf"}])


def test_the_named_mix_is_mt_bench_with_seeded_answer_lengths_in_range():
    mix = mt_bench_mix(seed=0)
    assert len(mix) == 80
    assert all(64 <= r["max_tokens"] <= 512 for r in mix)
    assert len({r["max_tokens"] for r in mix}) > 40
    assert mix == mt_bench_mix(seed=0) and mix != mt_bench_mix(seed=1)
    assert mix[0]["messages"][0]["role"] == "user"


def test_a_mix_file_loads_chats_and_prompts_and_names_a_bad_line(tmp_path):
    good = tmp_path / "mix.jsonl"
    good.write_text(json.dumps({"prompt": "Once", "max_tokens": 8}) + "\n\n"
                    + json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}) + "\n")
    assert load_mix(good) == [{"prompt": "Once", "max_tokens": 8},
                              {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 300}]
    for bad in ({"prompt": "x"}, {"prompt": "x", "max_tokens": 0},
                {"prompt": "x", "messages": [], "max_tokens": 4}, {"max_tokens": 4}):
        f = tmp_path / "bad.jsonl"
        f.write_text(json.dumps({"prompt": "ok", "max_tokens": 1}) + "\n" + json.dumps(bad) + "\n")
        with pytest.raises(ValueError, match="bad.jsonl:2"):
            load_mix(f)


def test_requests_cycle_the_mix_in_a_seeded_order():
    mix = [{"prompt": str(i), "max_tokens": 1} for i in range(5)]
    reqs = requests_for(mix, 12, seed=0)
    assert len(reqs) == 12
    assert sorted(r["prompt"] for r in reqs[:5]) == [str(i) for i in range(5)]  # every row once a pass
    assert reqs == requests_for(mix, 12, seed=0) and reqs != requests_for(mix, 12, seed=1)


def test_request_bodies_route_chats_and_prompts():
    route, body = request_body("m", "hello", 16, {"temperature": 0.7})
    assert route == "/v1/chat/completions" and body["messages"] == [{"role": "user", "content": "hello"}]
    assert body["ignore_eos"] and body["temperature"] == 0.7 and body["max_tokens"] == 16
    route, body = request_body("m", {"prompt": "Once"}, 8, None)
    assert route == "/v1/completions" and body["prompt"] == "Once" and "messages" not in body


def test_the_plot_puts_rate_inf_past_the_highest_rate():
    lv = {"goodput_req_s": 1.0, "ttft_p99_ms": 5.0, "tpot_p99_ms": 1.0}
    s = series({"rates": [{**lv, "request_rate": "inf"}, {**lv, "request_rate": 8.0}, {**lv, "request_rate": 2.5}]})
    assert s["x"] == [2.5, 8, 16] and s["labels"] == ["2.5", "8", "inf"]
