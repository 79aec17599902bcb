"""What one step costs the control plane, by transport: the step channel against a Ray
actor call and a Ray Compiled Graph, with a step-sized plan and output.

    python -m benchmarks.channel_bench [--batch 64] [--steps 2000]

Each transport carries a decode StepPlan of `--batch` requests (rows, sampling lists,
coins) to an actor-side function that does no work and returns a StepOutput of one token
per request; the figures are the transport's own cost. "one at a time": send, wait for
the answer, repeat (the round trip). "two in flight": the next plan goes out before the
previous answer is read, as the engine core sends them (the cost per step when the
channel is pipelined). The step channel runs its server in a Ray actor, as a RankActor
does, and the engine's end on an asyncio loop, as the engine core does.
"""
from __future__ import annotations

import argparse
import asyncio
import time

import numpy as np
import ray

from actors.protocol.step_plan import StepOutput, StepPlan


def make_plan(step: int, batch: int) -> StepPlan:
    return StepPlan(step, "decode", list(range(1, batch + 1)), temperature=[0.0] * batch,
                    top_p=[1.0] * batch, top_k=[-1] * batch, use_spec=True,
                    coins=np.zeros((batch, 1), dtype=np.float32))


def answer(plan: StepPlan) -> StepOutput:
    return StepOutput(plan.step_id, [[7] for _ in plan.rows], {"decode": 0.0})


@ray.remote
class Rank:
    def __init__(self):
        from actors.worker.step_channel import StepServer
        self.server = StepServer(answer)

    def address(self):
        return self.server.address, self.server.token

    def step(self, plan: StepPlan) -> StepOutput:
        return answer(plan)


def per_step_ms(seconds: float, steps: int) -> float:
    return 1000 * seconds / steps


def bench_channel(rank, batch: int, steps: int) -> tuple[float, float]:
    from serve_app.engine.rank_channel import RankChannel
    (host, port), token = ray.get(rank.address.remote())

    async def run() -> tuple[float, float]:
        ch = await RankChannel.connect(host, port, token, 0)
        t0 = time.perf_counter()
        for i in range(steps):
            ch.send(make_plan(i, batch))
            await ch.recv()
        one = per_step_ms(time.perf_counter() - t0, steps)
        t0 = time.perf_counter()
        ch.send(make_plan(0, batch))
        for i in range(1, steps):
            ch.send(make_plan(i, batch))
            await ch.recv()
        await ch.recv()
        two = per_step_ms(time.perf_counter() - t0, steps)
        ch.close()
        return one, two
    return asyncio.run(run())


def bench_actor_call(rank, batch: int, steps: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    for i in range(steps):
        ray.get(rank.step.remote(make_plan(i, batch)))
    one = per_step_ms(time.perf_counter() - t0, steps)
    t0 = time.perf_counter()
    prev = rank.step.remote(make_plan(0, batch))
    for i in range(1, steps):
        nxt = rank.step.remote(make_plan(i, batch))
        ray.get(prev)
        prev = nxt
    ray.get(prev)
    return one, per_step_ms(time.perf_counter() - t0, steps)


def bench_compiled_graph(rank, batch: int, steps: int) -> tuple[float, float]:
    from ray.dag import InputNode
    with InputNode() as inp:
        dag = rank.step.bind(inp)
    graph = dag.experimental_compile(_max_inflight_executions=2)
    try:
        for i in range(10):  # the channels' first use
            ray.get(graph.execute(make_plan(i, batch)))
        t0 = time.perf_counter()
        for i in range(steps):
            ray.get(graph.execute(make_plan(i, batch)))
        one = per_step_ms(time.perf_counter() - t0, steps)
        t0 = time.perf_counter()
        prev = graph.execute(make_plan(0, batch))
        for i in range(1, steps):
            nxt = graph.execute(make_plan(i, batch))
            ray.get(prev)
            prev = nxt
        ray.get(prev)
        return one, per_step_ms(time.perf_counter() - t0, steps)
    finally:
        graph.teardown()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=2000)
    args = ap.parse_args(argv)
    ray.init(include_dashboard=False, log_to_driver=False)
    rows = []
    for name, fn in (("step channel (TCP, actors/worker/step_channel.py)", bench_channel),
                     ("Ray actor call", bench_actor_call),
                     ("Ray Compiled Graph", bench_compiled_graph)):
        rank = Rank.remote()  # a fresh actor each: a compiled graph keeps its actor's loop
        ray.get(rank.address.remote())
        print(f"{name} ...", flush=True)
        rows.append((name, *fn(rank, args.batch, args.steps)))
        ray.kill(rank)
    print(f"\nbatch {args.batch}, plan and output of a decode step; ms per step\n")
    print("| transport | one at a time | two in flight |\n|---|---|---|")
    for name, one, two in rows:
        print(f"| {name} | {one:.3f} | {two:.3f} |")
    ray.shutdown()


if __name__ == "__main__":
    main()
