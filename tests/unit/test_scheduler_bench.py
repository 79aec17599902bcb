"""The scheduler micro-benchmark runs, and the scheduler still plans what it planned.

The digest covers every plan (rows, sampling settings, KV writes with their slot ids,
coins) and every finished request (reason, length, text). The pinned values were
recorded before the batch-512 rework of the scheduler's hot paths (batched KV growth,
the decode fast path, the radix cache's lasting eviction heap), which kept them. The
speculative plans' half changed once since, with the h200 preset's tree (16 nodes: 17
coins a sampled request a step instead of 9); its finished requests' half did not.
"""
import pytest

from benchmarks import scheduler_bench

# mode: (arguments, digest, preemptions expected). Speculative (1-3 tokens a step) with
# a KV pool so small that decode preempts; plain decode with one the prefix cache fills.
PINNED = {
    "spec": (["--kv-slots", "2000"], "39056f48124ff91d-860845208cef24d6", True),
    "plain": (["--plain", "--kv-slots", "6000"], "5d2616136417ab0f-993ab963cc9a1d77", False),
}


@pytest.mark.parametrize("mode", sorted(PINNED))
def test_scheduler_bench_tiny(mode, capsys):
    args, digest, preempts = PINNED[mode]
    result = scheduler_bench.main(["--running", "16", "--waiting", "200", "--steps", "120",
                                   "--max-tokens", "96", "--max-model-len", "256",
                                   "--eos-rate", "0.02", *args])
    out = capsys.readouterr().out
    assert "schedule ms" in out and result["decode"]["steps"] > 0
    assert result["extend"]["steps"] > 0  # finished requests were replaced from the queue
    assert (result["preemptions"] > 0) == preempts
    assert result["digest"] == digest


def test_streamed_requests_are_planned_the_same():
    """--stream (outputs to an outbox, token ids only, encoded each step as the engine core
    sends them) plans every step as the run without streams does; only the finished
    requests' half of the digest (which holds their text) differs."""
    common = ["--running", "16", "--waiting", "100", "--steps", "60", "--max-tokens", "96",
              "--max-model-len", "256", "--eos-rate", "0.02", "--greedy"]
    quiet, streamed = scheduler_bench.main(common), scheduler_bench.main([*common, "--stream"])
    assert quiet["digest"].split("-")[0] == streamed["digest"].split("-")[0]
    assert streamed["decode"]["send_ms"] > 0 and quiet["decode"]["send_ms"] == 0
