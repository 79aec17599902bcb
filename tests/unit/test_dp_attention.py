"""parallel.dp_attention, end to end without Ray: the engine core and front end here, each
rank a process of its own (tests/local_dp_engine.py) joined over gloo, on the tiny random
target in fp32. The group's greedy tokens equal one rank's, plain and speculative; the
steps really mix idle ranks, different batch sizes, prefills beside decodes and a
preemption; an int32 producer never puts an int32 tensor into a collective; a rank
that leaves the protocol, hangs or dies fails the requests with an error, never a hang;
the weights are split; the real model on two ranks picks one rank's tokens. With
CUDA graphs (the CPU's eager stand-in, through the same collectives) the same tokens
come out, and the recorded steps show which were replayed at one size by every rank."""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time

import pytest
import torch

import dp_rank_hooks
from actors.dp.attention_group import DPAttentionGroup
from actors.dp.step_phases import DraftShape, GraphStep, Phase, graph_step, step_phases
from actors.dp.sync import DPSyncResult, make_sync_row
from actors.worker.forward_batch import ForwardMode
from dp_scenario import (EXTEND, FIRST, FIRST_TOKENS, IDLE, LENGTHS, SHAPES, VERIFY, DECODE,
                         check_graph_steps, greedy, mixed_run)
from local_dp_engine import LocalDPEngine, collect
from serve_app.engine.request import SamplingParams
from serve_app.engine.request_stream import StreamFailed
from spec_helpers import random_prompts, tiny_config, tiny_engine

pytestmark = pytest.mark.timeout(600)

# In the mixed run (tests/dp_scenario.py) rank 0's KV is short, so it preempts.
RANK0_SLOTS = 200  # rank 0's KV: less than its share of the batch needs at once


@pytest.fixture(scope="module")
def dp_cfg(tiny_llama_dir):
    def make(W: int, shape: str, *extra: str):
        return tiny_config(tiny_llama_dir, *SHAPES[shape], f"parallel.dp_size={W}",
                           "parallel.dp_attention=true", "model.max_model_len=160",
                           "scheduler.chunked_prefill_size=16", *extra, spec=shape != "plain")
    return make


@pytest.fixture(scope="module")
def loop():
    """One event loop for the engines' tasks, on a thread of its own."""
    lp = asyncio.new_event_loop()
    t = threading.Thread(target=lp.run_forever, daemon=True)
    t.start()
    yield lambda coro, timeout=300: asyncio.run_coroutine_threadsafe(coro, lp).result(timeout)
    lp.call_soon_threadsafe(lp.stop)
    t.join()


@pytest.fixture(scope="module")
def one_rank(tiny_llama_dir):
    """Every prompt's greedy tokens from one plain rank (the in-process engine)."""
    eng = tiny_engine(tiny_llama_dir, spec=False)
    reqs = eng.generate([p for p, _ in LENGTHS], [SamplingParams(**greedy(n)) for _, n in LENGTHS])
    return {tuple(p): r.output_ids for (p, _), r in zip(LENGTHS, reqs)}


def _expected_weight_bytes(info: dict, arch, W: int, rank: int) -> int:
    """The whole model, less the embedding and MLPs, plus this rank's shards of them."""
    H, V, I, L = arch.hidden_size, arch.vocab_size, arch.intermediate_size, arch.num_layers
    Ir = len(torch.arange(I).tensor_split(W)[rank])
    shard = -(-V // W)
    return info["full_weight_bytes"] + 4 * (shard * H - V * H + L * 3 * H * (Ir - I))


# Plain and the tree on two ranks; three ranks (an odd vocabulary split) with the tree, whose
# step touches every collective plain does. No chain: it is the tree with topk 1, and nothing
# under actors/dp or actors/spec branches on the shape (test time: 2 cores).
# Three ranks long, for make test's budget: two already step in lockstep with idle turns.
# Two plain ranks long too: test_graph_steps_emit_the_tokens_of_one_rank[plain] runs the same
# mixed run on them (idle turns, prefill beside decode, eager steps) to one rank's tokens;
# rank 0's preemptions and the weight shards are checked here by the tree case.
@pytest.mark.parametrize("W,shape", [pytest.param(2, "plain", marks=pytest.mark.long), (2, "tree"),
                                     pytest.param(3, "tree", marks=pytest.mark.long)])
def test_ranks_in_lockstep_emit_the_tokens_of_one_rank(loop, one_rank, dp_cfg, tiny_llama_dir,
                                                       W, shape):
    cfg = dp_cfg(W, shape)

    async def run():
        eng = await LocalDPEngine.start(cfg, hook=dp_rank_hooks.record_steps,
                                        info_overrides={0: {"num_slots": RANK0_SLOTS}})
        try:
            got = await mixed_run(eng)
            stats = await eng.stats()
        finally:
            reports = await eng.stop()
        return eng.infos, got, stats, reports

    infos, got, stats, reports = loop(run())
    for prompt, tokens in got:
        assert tokens == one_rank[tuple(prompt)], prompt
    # The steps were the ones this test is about (every rank saw the same syncs).
    steps = reports[0]["steps"]
    assert all(r["steps"] == steps for r in reports)
    work = VERIFY if shape != "plain" else DECODE
    assert any(IDLE in m and set(m) != {IDLE} for m, _ in steps), "no step with an idle rank"
    assert any(m.count(work) >= 2 and len({t[i] for i, x in enumerate(m) if x == work}) > 1
               for m, t in steps), "no step with two decoding ranks of different batch sizes"
    assert any(EXTEND in m and work in m for m, _ in steps), "no prefill beside a decode"
    assert stats[0]["preemptions"] > 0 and all(s["preemptions"] == 0 for s in stats[1:]), stats
    from actors.models.loader import load_model_weights
    arch, _ = load_model_weights(tiny_llama_dir)
    for rank, info in enumerate(infos):  # (a draft head's weights are in both figures)
        assert info["weight_bytes"] == _expected_weight_bytes(info, arch, W, rank)


@pytest.mark.parametrize("shape", ["plain", "tree"])  # no chain: as above
def test_graph_steps_emit_the_tokens_of_one_rank(loop, one_rank, dp_cfg, shape):
    """attention.cuda_graphs under dp_attention, captured at sizes [1, 2, 4] as the CPU's eager
    stand-in (the padded static buffers of a replay, through the gloo collectives): 2
    ranks' greedy tokens equal one rank's. From the steps every rank recorded: a rank's
    row can run a graph iff it idles or decodes at most 4 requests; the group replays
    graphs iff every row can, at the next captured size over the largest batch, and
    then every rank, an idle one too, replays graphs holding exactly the step's phases
    at that size; otherwise no rank replays any. Among them: graph steps beside an idle
    rank and with a rank padded past its own size, an eager step for a prefill beside a
    decode and one for a batch above 4. The chain replays whole iterations (the step
    graph), the tree one graph per phase."""
    per_phase = ("attention.spec_step_graph=false",) if shape == "tree" else ()
    cfg = dp_cfg(2, shape, *per_phase)

    async def run():
        eng = await LocalDPEngine.start(cfg, hook=dp_rank_hooks.stand_in_graphs)
        try:
            got = await mixed_run(eng)
        finally:
            reports = await eng.stop()
        return got, reports

    got, reports = loop(run())
    for prompt, tokens in got:
        assert tokens == one_rank[tuple(prompt)], prompt
    seen = check_graph_steps(reports, shape, dp_rank_hooks.GRAPH_SIZES,
                             replays_per_step=3 if shape == "tree" else 1)
    assert len(seen) == 4, seen


def run_seed_scenario(loop, one_rank, dp_cfg, hook):
    """The seed scenario on two ranks (rank 0 busy with an int32 producer, rank 1 idle)
    under `hook`: the tokens are one rank's, rank 0 produced int32, every integer either
    rank hands to torch.distributed is int64, and both hand the same collectives.
    Returns the two ranks' reports."""
    cfg = dp_cfg(2, "chain")

    async def run():
        eng = await LocalDPEngine.start(cfg, hook=hook)
        try:
            got = (await eng.run(FIRST, [greedy(FIRST_TOKENS)]))[0][0]
        finally:
            reports = await eng.stop()
        return got, reports

    got, (busy, idle) = loop(run())
    assert got == one_rank[tuple(FIRST[0])]
    assert busy["int32_outputs"] > 0
    for r in (busy, idle):
        ints = {d for _, d, _ in r["collectives"] if not d.is_floating_point}
        assert ints == {torch.int64}, ints
    assert busy["collectives"] == idle["collectives"]
    return busy, idle


def test_seed_scenario_int32_producer_beside_an_idle_rank(loop, one_rank, dp_cfg):
    """Rank 0 verifies with an int32 producer while rank 1 idles through every phase: each
    tensor either hands to torch.distributed is int64 or floating, both hand the same
    collectives of the same shapes, and the tokens are one rank's. The engine's own step
    sync then carries a count above 2**32 exactly."""
    busy, idle = run_seed_scenario(loop, one_rank, dp_cfg, dp_rank_hooks.seed_scenario)
    assert idle["int32_outputs"] == 0
    assert {tuple(m) for m, _ in busy["steps"]} >= {(EXTEND, IDLE), (VERIFY, IDLE)}, busy["steps"]
    big = dp_rank_hooks.BIG
    K, N = 1, 4  # CHAIN
    want = [("draft_decode.0", big * K, big * K), ("draft_decode.1", big * K, big * K),
            ("target", big * N, big * N), ("draft_extend", big * N, big)]
    assert [p[:3] for p in busy["big_phases"]] == want == [p[:3] for p in idle["big_phases"]]
    assert [p[3] for p in idle["big_phases"]] == [0, 0, 0, 0]


def test_seed_scenario_on_the_graph_path(loop, one_rank, dp_cfg):
    """C02/C03 with graphs (the stand-in): rank 0 verifies with an int32 producer inside
    its graphs while rank 1, idle, replays the same graphs with every lane padded: each
    integer either hands to torch.distributed is int64, both hand the same collectives,
    the tokens are one rank's, and the decode steps were graph steps on both ranks."""
    busy, idle = run_seed_scenario(loop, one_rank, dp_cfg, dp_rank_hooks.seed_scenario_with_graphs)
    graphs = [(b["modes"], b["graph_bs"], bool(b["replays"]), bool(i["replays"]))
              for b, i in zip(busy["graph_steps"], idle["graph_steps"])]
    assert ([VERIFY, IDLE], 1, True, True) in graphs, graphs
    assert all(bs is None for m, bs, _, _ in graphs if EXTEND in m)


def test_graph_step_choice():
    """The group's graph for a step, from its rows: every rank able, one busy mode (the
    graphs'), the next captured size over the largest batch; its phases are the same on
    every rank, an idle one's too. Otherwise eager."""
    draft = DraftShape(num_steps=3, topk=2, num_draft_tokens=4)
    V, I, E, D = ForwardMode.TARGET_VERIFY, ForwardMode.IDLE, ForwardMode.EXTEND, ForwardMode.DECODE

    def sync(modes, tokens, can=True):
        return DPSyncResult(tokens, tokens, can, E in modes, max(tokens), modes)

    mixed = sync([V, V, I], [3 * 4, 1 * 4, 0])
    graph = graph_step(mixed, [1, 2, 4], draft)
    assert graph == GraphStep(V, 4)
    want = [("draft_decode.0", 8, 8), ("draft_decode.1", 8, 8), ("target", 16, 16),
            ("draft_extend", 16, 4)]
    for rank in range(3):
        assert [(p.name, p.tokens, p.rows) for p in step_phases(mixed, rank, draft, graph)] == want
        assert all((p.own_tokens, p.own_rows) == (p.tokens, p.rows)
                   for p in step_phases(mixed, rank, draft, graph))
    assert graph_step(sync([D, I], [3, 0]), [1, 2, 4], None) == GraphStep(D, 4)
    assert graph_step(sync([D, D], [2, 1]), [1, 2, 4], None) == GraphStep(D, 2)
    for eager, sizes, d in [(sync([V, I], [4, 0], can=False), [1, 2, 4], draft),  # a rank can't
                            (sync([E, V], [30, 4]), [1, 2, 4], draft),  # a prefill beside
                            (sync([I, I], [0, 0]), [1, 2, 4], draft),  # nothing to run
                            (sync([D, I], [4, 0]), [1, 2, 4], draft),  # not the graphs' mode
                            (sync([D, I], [1, 0]), None, None)]:  # nothing captured
        assert graph_step(eager, sizes, d) is None


def test_a_graph_replay_takes_exactly_its_phases():
    """A replayed graph must hold the step's next phases; a CUDA graph (no Python inside)
    takes them at once, the stand-in through its forwards, and must take exactly them."""
    dp = DPAttentionGroup(0, 1, num_target_layers=1, draft=None, timeout_s=5)
    dp.join("127.0.0.1", None)
    dp.graph_sizes = [1, 2]
    dp.begin_step(make_sync_row(2, 2, True, False, ForwardMode.DECODE))
    assert dp.graph == GraphStep(ForwardMode.DECODE, 2)
    target = Phase("target", 2, 2, 2, 2)
    with pytest.raises(RuntimeError, match="replays a graph of"):
        dp.replay_graph([Phase("target", 1, 1, 1, 1)], lambda: None, runs_python=False)
    with pytest.raises(RuntimeError, match="ran other forwards"):  # a stand-in that ran none
        dp.replay_graph([target], lambda: None, runs_python=True)
    replayed = []
    dp.replay_graph([target], lambda: replayed.append(1), runs_python=False)
    assert replayed == [1] and not dp.pending
    dp.end_step()
    assert dp.graph is None


def test_an_idle_rank_that_skips_its_collectives_fails_the_requests_not_hangs(loop, dp_cfg):
    """Rank 1 runs no forward when idle and does not notice: rank 0's collectives lose
    their partner, and the group's timeout turns that into the replica's error."""
    cfg = dp_cfg(2, "plain", "parallel.dp_timeout_s=3")

    async def run():
        eng = await LocalDPEngine.start(cfg, hook=dp_rank_hooks.idle_rank_skips_its_collectives)
        try:
            t0 = time.monotonic()
            with pytest.raises(StreamFailed) as failed:
                await eng.run(FIRST, [greedy(FIRST_TOKENS)])
            took = time.monotonic() - t0
            with pytest.raises(RuntimeError, match="rank group failed"):
                await eng.client.check_health()
        finally:
            await eng.stop()
        return str(failed.value), took

    message, took = loop(run())
    assert "rank 0" in message and "Timed out" in message, message
    assert took < 15, took


def test_a_killed_rank_fails_the_requests_at_once(loop, dp_cfg):
    cfg = dp_cfg(2, "plain")

    async def run():
        eng = await LocalDPEngine.start(cfg)
        try:
            stream = eng.client.add_request(FIRST[0], greedy(120), "long")
            await stream.__anext__()
            t0 = time.monotonic()
            eng.procs[1].kill()
            with pytest.raises(StreamFailed) as failed:
                await collect(stream)
            took = time.monotonic() - t0
            with pytest.raises(RuntimeError, match="rank group failed"):
                await eng.client.check_health()
        finally:
            await eng.stop()
        return str(failed.value), took

    message, took = loop(run())
    assert "rank 1 closed its step channel" in message, message
    assert took < 10, took


def test_a_hung_rank_fails_the_requests_after_the_timeout(loop, dp_cfg):
    """Rank 1 stops (SIGSTOP) mid-stream: its channel stays open, but rank 0's next
    collective gives up after parallel.dp_timeout_s, and that fails the replica."""
    cfg = dp_cfg(2, "plain", "parallel.dp_timeout_s=3")

    async def run():
        eng = await LocalDPEngine.start(cfg)
        try:
            stream = eng.client.add_request(FIRST[0], greedy(120), "long")
            await stream.__anext__()
            t0 = time.monotonic()
            os.kill(eng.procs[1].pid, signal.SIGSTOP)
            with pytest.raises(StreamFailed) as failed:
                await collect(stream)
            took = time.monotonic() - t0
        finally:
            eng.procs[1].kill()
            await eng.stop()
        return str(failed.value), took

    message, took = loop(run())
    assert "rank 0" in message and "Timed out" in message, message
    assert took < 15, took


def test_step_phases_of_a_mixed_step():
    """A prefill rank, a speculative rank and an idle rank: the group runs the draft-decode
    phases, the target and draft extend, each padded to the largest rank's size; the
    prefill rank has no part in draft decode, the idle rank none at all."""
    draft = DraftShape(num_steps=3, topk=2, num_draft_tokens=4)
    sync = DPSyncResult(tokens_per_rank=[30, 3 * 4, 0], logprob_tokens_per_rank=[2, 12, 0],
                        can_run_graph=False, is_extend=True, max_tokens=30,
                        forward_mode_per_rank=[ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY,
                                               ForwardMode.IDLE])
    names = ["draft_decode.0", "draft_decode.1", "target", "draft_extend"]
    padded = [(6, 6), (6, 6), (30, 12), (30, 3)]
    own = {0: [(0, 0), (0, 0), (30, 2), (30, 2)], 1: [(6, 6), (6, 6), (12, 12), (12, 3)],
           2: [(0, 0)] * 4}
    for rank in range(3):
        phases = step_phases(sync, rank, draft)
        assert [p.name for p in phases] == names
        assert [(p.tokens, p.rows) for p in phases] == padded
        assert [(p.own_tokens, p.own_rows) for p in phases] == own[rank]
    plain = DPSyncResult([5, 0], [5, 0], False, False, 5, [ForwardMode.DECODE, ForwardMode.IDLE])
    assert [(p.name, p.tokens) for p in step_phases(plain, 1, None)] == [("target", 5)]
    with pytest.raises(ValueError, match="whole number"):
        step_phases(DPSyncResult([5], [5], False, False, 5, [ForwardMode.TARGET_VERIFY]), 0, draft)


@pytest.mark.parametrize("shape", [
    # Long, for make test's budget: the tree case waits for the step before inside `launch`
    # on lockstep ranks the same way (its target step is plain's with a tree mask), and plain
    # grammar steps launched ahead are held to one-at-a-time output in
    # test_grammar_launch_ahead.py.
    pytest.param("plain", marks=pytest.mark.long),
    "tree"])
def test_grammar_rows_launched_ahead_on_lockstep_ranks(loop, grammar_model, tokenizer, shape):
    """Structured outputs under dp_attention, each rank's grammar plans launched before its
    step ahead finished (tests/dp_rank_hooks.py late_ready): a rank's masks wait inside
    `launch` for its own step before, whose collectives every rank has issued, so nothing
    hangs, and its channel answers that step from there; the group's greedy tokens equal
    one plain rank's, grammar rows beside free ones."""
    import json

    from serve_app.text.grammar import GrammarCompiler
    from serve_app.engine.llm_engine import LLMEngine
    c = GrammarCompiler(tokenizer)
    grammars = [c.compile(("json_schema", json.dumps({"type": "object"}))), None,
                c.compile(("regex", "[a-z]{2,6}(-[0-9]{2})?")), c.compile(("choice", '["alpha", "beta"]'))]
    prompts = random_prompts(8, vocab=len(tokenizer), seed=8)
    params = [dict(max_tokens=8 + 3 * i, grammar=grammars[i % len(grammars)]) for i in range(len(prompts))]
    one = LLMEngine(tiny_config(grammar_model, spec=False), tokenizer=tokenizer)
    want = [r.output_ids for r in one.generate(prompts, [SamplingParams(**p) for p in params])]
    cfg = tiny_config(grammar_model, *SHAPES[shape], "parallel.dp_size=2", "parallel.dp_attention=true",
                      spec=shape != "plain")

    async def run():
        eng = await LocalDPEngine.start(cfg, tokenizer=tokenizer, hook=dp_rank_hooks.late_ready)
        try:
            got = await eng.run(prompts, params)
        finally:
            reports = await eng.stop()
        return [tokens for tokens, _ in got], reports

    got, reports = loop(run())
    assert got == want
    assert all(r["grammar_ahead"] > 0 for r in reports), reports
    # Each rank's channel answered steps from inside a grammar step's launch, where its
    # masks had read their tokens (LockstepWorker.on_steps_back).
    assert all(r["answered_inside_launch"] > 0 for r in reports), reports


def test_smollm2_on_two_ranks_equals_one_rank(loop, chat_prompts, plain_chat_outputs):
    """The real model (30 layers of split MLPs, whose partial sums round in another order
    than one rank's): 2 ranks' greedy tokens for 8 chat prompts equal one rank's."""
    from configs.schema import load_config
    n = 24
    cfg = load_config(overrides=["model.dtype=float32", "device=cpu", "draft.enabled=false",
                                 "kv_cache.num_slots=8192", "scheduler.max_running_requests=16",
                                 "parallel.dp_size=2", "parallel.dp_attention=true"])

    async def run():
        eng = await LocalDPEngine.start(cfg)
        try:
            return await eng.run(chat_prompts, [greedy(n)] * len(chat_prompts))
        finally:
            await eng.stop()

    got = [tokens for tokens, _ in loop(run())]
    assert got == [ref[:n] for ref in plain_chat_outputs]
