"""The benchmarks' summaries: a level's slowest stream beside the mean (the HTTP client), and
how many tokens of an ignore_eos run come after the answers' EOS."""
from benchmarks.http_client import summarize


def _row(ttft: float, e2e: float, tokens: int) -> dict:
    return {"ttft": ttft, "e2e": e2e, "tokens": tokens, "chunks": tokens, "tpot": (e2e - ttft) / (tokens - 1),
            "gaps": [0.001] * (tokens - 1)}


def test_summary_reports_the_slowest_stream_beside_the_mean():
    rows = [_row(0.05, 1.0, 1024), _row(0.05, 1.0, 1024), _row(0.08, 1.6, 1024)]
    s = summarize(rows, seconds=1.65)
    assert s["tokens"] == 3072
    assert abs(s["tok_s"] - 3072 / 1.65) < 1e-9
    assert abs(s["e2e_s"] - 1.2) < 1e-9
    assert s["e2e_max_s"] == 1.6
    assert s["ttft_p50_ms"] == 50.0


def test_tokens_after_eos_count_each_short_answer_up_to_the_cap():
    from benchmarks.answer_lengths import after_eos
    ended, share = after_eos([100, 256, 1024], 256)
    assert ended == 1
    assert abs(share - 156 / (3 * 256)) < 1e-12


def test_server_side_counts_mixed_steps_with_the_rest():
    """Per-step figures divide by every step the engine ran, mixed ones included (a
    scheduler.mixed_steps server otherwise reports its phases per too few steps)."""
    from benchmarks.http_client import server_side
    before = {"kestrel_engine_steps_total:extend": 10, "kestrel_engine_steps_total:decode": 100,
              "kestrel_engine_steps_total:mixed": 0, "kestrel_engine_step_seconds_total:schedule": 1.0}
    after = {"kestrel_engine_steps_total:extend": 20, "kestrel_engine_steps_total:decode": 150,
             "kestrel_engine_steps_total:mixed": 40, "kestrel_engine_step_seconds_total:schedule": 1.1}
    got = server_side(before, after, 2.0)
    assert got["steps_s"] == 50.0  # 10 + 50 + 40 steps in 2 s
    assert abs(got["step_ms"]["schedule"] - 1.0) < 1e-9  # 0.1 s over 100 steps
    assert got["mixed_steps"] == 40 and got["extend_steps"] == 10


def test_busy_rate_leaves_out_the_tail_of_the_slowest_stream():
    """Two streams of one 256-token request each, one twice as fast: the level waits 2 s
    for the slow one (256 tok/s), while two streams always busy at the mean request's speed
    (512 tokens over 3 request-seconds) give 341 tok/s."""
    from benchmarks.http_client import busy_tok_s
    rows = [_row(0.05, 1.0, 256), _row(0.05, 2.0, 256)]
    assert summarize(rows, seconds=2.0)["tok_s"] == 256.0
    assert abs(busy_tok_s(rows, 2) - 2 * 512 / 3.0) < 1e-9
