"""The mixed dp_attention run that the CPU tests (tests/unit/test_dp_attention.py) and the
GPU test (tests/gpu/test_dp_attention_graphs_gpu.py) drive, and the check of the graph
steps each rank recorded in it (tests/dp_rank_hooks.py `record_graph_steps`).

One request first (the other ranks idle), then a batch that the engine spreads unevenly
(different batch sizes, some finishing early), then long prompts in 16-token chunks while
the batch decodes."""
from __future__ import annotations

import asyncio

from actors.graphs.cuda_graph_runner import padded_size
from actors.worker.forward_batch import ForwardMode
from local_dp_engine import collect
from spec_helpers import CHAIN, TREE, random_prompts

SHAPES = {"plain": (), "chain": CHAIN, "tree": TREE}
IDLE, DECODE, EXTEND, VERIFY = (int(m) for m in (ForwardMode.IDLE, ForwardMode.DECODE,
                                                 ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY))
FIRST, BATCH, LATE = random_prompts(1, seed=1), random_prompts(7, seed=2), random_prompts(3, seed=3)
BATCH_TOKENS = [24, 6, 24, 10, 24, 16, 20]
LATE = [p * 3 for p in LATE]  # 15-120 tokens: several chunks each
LATE_TOKENS, FIRST_TOKENS = 12, 24
# Every prompt of the run and its output length.
LENGTHS = [(p, FIRST_TOKENS) for p in FIRST] + list(zip(BATCH, BATCH_TOKENS)) + [
    (p, LATE_TOKENS) for p in LATE]


def greedy(n: int) -> dict:
    return dict(max_tokens=n, ignore_eos=True)


async def mixed_run(eng) -> list[tuple[list[int], list[int]]]:
    """FIRST alone, BATCH once FIRST decodes, LATE once BATCH decodes, on a LocalDPEngine
    -> (prompt, tokens)."""
    c = eng.client
    first = c.add_request(FIRST[0], greedy(FIRST_TOKENS), "first")
    head = await first.__anext__()  # prefilled (the other ranks idled through it)
    batch = [c.add_request(p, greedy(n), f"b{i}") for i, (p, n) in enumerate(zip(BATCH, BATCH_TOKENS))]
    heads = [await s.__anext__() for s in batch]
    late = [c.add_request(p, greedy(LATE_TOKENS), f"l{i}") for i, p in enumerate(LATE)]
    rest = await asyncio.gather(collect(first), *(collect(s) for s in batch + late))
    got = [head.new_token_ids + rest[0][0]]
    got += [h.new_token_ids + r[0] for h, r in zip(heads, rest[1:1 + len(batch)])]
    got += [r[0] for r in rest[1 + len(batch):]]
    return list(zip(FIRST + BATCH + LATE, got))


def draft_shape(shape: str) -> tuple[int, int, int]:
    """(K, S, N) of a shape; plain: one token per request."""
    keys = ("draft.topk", "draft.num_steps", "draft.num_draft_tokens")
    values = dict(o.split("=", 1) for o in SHAPES[shape])
    return tuple(int(values[k]) for k in keys if k in values) or (1, 1, 1)


def graph_phases(shape: str, bs: int) -> list[tuple[str, int]]:
    """(phase, padded tokens) of a graph step of size bs, as the tests count them."""
    if shape == "plain":
        return [("target", bs)]
    K, S, N = draft_shape(shape)
    return [(f"draft_decode.{i}", bs * K) for i in range(S - 1)] + [
        ("target", bs * N), ("draft_extend", bs * N)]


def check_graph_steps(reports: list[dict], shape: str, sizes: list[int],
                      replays_per_step: int) -> set[str]:
    """Asserts, from every rank's recorded steps, that a rank's row can run a graph iff it
    idles or decodes at most max(sizes) requests; that the group replays graphs iff every
    row can, at the next captured size over the largest batch, and then every rank, an
    idle one too, replays `replays_per_step` graphs holding exactly the step's phases at
    that size, and that no rank replays any in an eager step. Returns the kinds of step
    seen among those the tests are about."""
    lane = draft_shape(shape)[2]
    work = VERIFY if shape != "plain" else DECODE
    per_rank = [r["graph_steps"] for r in reports]
    assert len({len(s) for s in per_rank}) == 1
    seen = set()
    for step in zip(*per_rank):
        modes, tokens, bs = step[0]["modes"], step[0]["tokens"], step[0]["graph_bs"]
        assert all((s["modes"], s["tokens"], s["graph_bs"]) == (modes, tokens, bs) for s in step)
        batches = [t // lane for t in tokens]
        can = [m == IDLE or (m == work and b <= sizes[-1]) for m, b in zip(modes, batches)]
        assert [bool(s["can_run_graph"]) for s in step] == can, step
        want = padded_size(sizes, max(batches)) if all(can) and set(modes) != {IDLE} else None
        assert bs == want, step
        for s in step:
            assert [p for r in s["replays"] for p in r] == (graph_phases(shape, bs) if bs else [])
            assert len(s["replays"]) == (replays_per_step if bs else 0)
        if bs and IDLE in modes:
            seen.add("graph beside an idle rank")
        if bs and any(m == work and padded_size(sizes, b) < bs for m, b in zip(modes, batches)):
            seen.add("graph padded past a rank's own size")
        if EXTEND in modes and work in modes:
            seen.add("eager prefill beside a decode")
        if bs is None and EXTEND not in modes and max(batches) > sizes[-1]:
            seen.add("eager above the largest size")
    return seen
