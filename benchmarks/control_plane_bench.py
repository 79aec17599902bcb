"""The serving path's own cost, with a worker that only takes time: CPU, no model.

    python -m benchmarks.control_plane_bench [--streams 1 16 64 256] [--step-ms 5]
        [--max-tokens 256] [--spec] [--rounds 1] [--out DIR]

A stand-in rank worker in its own process serves the step channel: every step takes
--step-ms (a GPU of known speed) and returns random tokens (1 per request, or 1-3 with
--spec, as speculation accepts them). The engine core (scheduler, step loop) runs in a
second process, as its Ray actor does, and this process runs what an Engine replica runs
for HTTP: the EngineClient (request streams with the real tokenizer's detokenization)
and the OpenAI FastAPI app under uvicorn; a client process streams chat completions at
each stream count. Since the worker costs nothing but its sleep, every gap
between its steps is the control plane's: it reports steps/s against the 1000/step-ms a
free control plane would reach, the worker's idle time before each queued step, tokens/s
and SSE chunks/s. (Ray Serve's wrappers and HAProxy are not in this path: the
http_bench --tiny-model run measures the whole stack.)
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import sys
import time
from pathlib import Path

MODEL = "SmolLM2-135M-Instruct"


def _worker_main(conn, step_ms: float, max_accept: int) -> None:
    """Child process: a StepServer whose steps sleep `step_ms` and return random tokens."""
    from actors.worker.step_channel import StepServer
    from actors.protocol.step_plan import StepOutput
    rng = random.Random(0)

    def execute(plan):
        time.sleep(step_ms / 1000.0)
        if plan.mode == "extend":
            tokens = [[rng.randrange(100, 16000)] if last else [] for last in plan.last_chunk]
        else:
            tokens = [[rng.randrange(100, 16000) for _ in range(rng.randint(1, max_accept))]
                      for _ in plan.rows]
        return StepOutput(plan.step_id, tokens, {plan.mode: step_ms / 1000.0})

    server = StepServer(execute)
    conn.send((server.address, server.token))
    server.thread.join()


def _core_main(conn, cfg_dict: dict, info: dict, address, token: str) -> None:
    """Child process: the engine core (schedulers, step loop), as its Ray actor runs it."""
    from configs.schema import KestrelConfig
    from serve_app.engine.engine_core import EngineCore
    from serve_app.engine.rank_channel import RankChannel

    async def run():
        cfg = KestrelConfig.model_validate(cfg_dict)
        channel = await RankChannel.connect(*address, token, 0)
        core = EngineCore(cfg, [info], [channel], info["eos_token_ids"])
        host, port = await core.listen("127.0.0.1")
        conn.send((host, port, core.token))
        await asyncio.Event().wait()

    asyncio.run(run())


def _client_main(conn, url: str, streams: list[int], max_tokens: int, rounds: int) -> None:
    from benchmarks.http_bench import DATA, load_questions
    from benchmarks.http_client import run_level
    qs = load_questions(Path(DATA), 80)
    questions = [qs[i % len(qs)] for i in range(max(streams))]
    out = []
    for c in streams:
        conn.send(("start", c))
        out.append(asyncio.run(run_level(url, MODEL, questions, c, max_tokens, c1_prompts=4, rounds=rounds)))
        conn.send(("level", out[-1]))
    conn.send(("done", None))


def engine_info(cfg) -> dict:
    """What a RankWorker's info() would say for this configuration."""
    from actors.worker.kv_cache import max_request_slots
    spec = cfg.draft.enabled
    page = cfg.kv_cache.page_size
    window = cfg.draft.window if spec else 1
    return {"num_slots": cfg.kv_cache.num_slots, "num_rows": cfg.scheduler.max_running_requests + 2,
            "max_context": max_request_slots(cfg.model.max_model_len, window, page), "window": window,
            "eos_token_ids": [2]}


async def serve(cfg, front, port: int, stop: asyncio.Event) -> None:
    """This process: the replica's front end (EngineClient, the OpenAI app, uvicorn)."""
    import uvicorn

    from actors.models.loader import default_model_path
    from serve_app.engine.engine_client import EngineClient
    from serve_app.api.openai_server import OpenAIServer, build_api
    from serve_app.text.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path())
    engine = await EngineClient.connect(cfg, 1, *front, tok)
    server = uvicorn.Server(uvicorn.Config(build_api(OpenAIServer(cfg, engine, tok)), host="127.0.0.1",
                                           port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    await stop.wait()
    server.should_exit = True
    await task
    engine.stop()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--step-ms", type=float, default=5.0, help="time the stand-in worker takes per step")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--spec", action="store_true", help="1-3 tokens per request per step")
    ap.add_argument("--rounds", type=int, default=1, help="requests each stream sends one after another")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)

    from benchmarks.http_bench import _free_port
    from configs.schema import load_config
    most = max(args.streams)
    cfg = load_config(overrides=["device=cpu", f"draft.enabled={str(args.spec).lower()}",
                                 "draft.path=random", f"scheduler.max_running_requests={most}",
                                 f"scheduler.max_queued_requests={most}", "kv_cache.num_slots=1048576",
                                 "model.max_model_len=4096", "scheduler.chunked_prefill_size=16384",
                                 *args.set])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    worker = ctx.Process(target=_worker_main, args=(child, args.step_ms, 3 if args.spec else 1),
                         daemon=True)
    worker.start()
    address, token = parent.recv()
    core_parent, core_child = ctx.Pipe()
    core = ctx.Process(target=_core_main, daemon=True,
                       args=(core_child, cfg.model_dump(mode="json"), engine_info(cfg), address, token))
    core.start()
    front = core_parent.recv()
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cparent, cchild = ctx.Pipe()
    # Not a daemon: run_level spreads many streams over client processes of its own.
    client = ctx.Process(target=_client_main, args=(cchild, url, args.streams, args.max_tokens, args.rounds))
    levels: list[dict] = []

    async def run() -> None:
        stop = asyncio.Event()
        srv = asyncio.create_task(serve(cfg, front, port, stop))
        await asyncio.sleep(2.0)  # the tokenizer loads, uvicorn binds
        client.start()
        loop = asyncio.get_running_loop()
        cpu0 = time.process_time()
        while True:
            kind, level = await loop.run_in_executor(None, cparent.recv)
            if kind == "done":
                break
            if kind == "start":
                cpu0 = time.process_time()
                continue
            # This process's CPU time (the front end's, for all practical purposes) per SSE
            # chunk: the figure to drive down, steadier than rates on a small machine.
            chunks = level["chunks_s"] * level["seconds"]
            level["engine_cpu_us_per_chunk"] = 1e6 * (time.process_time() - cpu0) / max(1, chunks)
            levels.append(level)
            print(f"{level['concurrency']} streams: {level['tok_s']:.0f} tok/s, server {level['server']}",
                  file=sys.stderr, flush=True)
        stop.set()
        await srv

    asyncio.run(run())
    core.kill()
    worker.kill()
    ideal = 1000.0 / args.step_ms
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"control_plane_{'spec' if args.spec else 'plain'}_{args.step_ms:g}ms"
    (Path(args.out) / f"{name}.json").write_text(json.dumps(
        {"step_ms": args.step_ms, "spec": args.spec, "max_tokens": args.max_tokens,
         "cpus": os.cpu_count(), "levels": levels}, indent=1))
    print(f"\n{os.cpu_count()} cpus, a {args.step_ms:g} ms step, {'1-3 tokens' if args.spec else '1 token'} "
          f"per request per step, {args.max_tokens} tokens per stream\n")
    print("| streams | steps/s (free: %.0f) | worker idle ms / queued step | tok/s | chunks/s | "
          "front-end CPU us / chunk | per step ms: schedule, process | TTFT p50 ms | "
          "chunk gap p50 / p99 ms | prefill steps |" % ideal)
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lv in levels:
        sv = lv["server"]
        st = sv.get("step_ms", {})
        print(f"| {lv['concurrency']} | {sv.get('steps_s', 0):.0f} | "
              f"{sv.get('wait_ms_per_pipelined_step') or 0:.3f} | {lv['tok_s']:.0f} | "
              f"{lv['chunks_s']:.0f} | {lv['engine_cpu_us_per_chunk']:.0f} | {st.get('schedule', 0):.2f}, {st.get('process', 0):.2f} | "
              f"{lv['ttft_p50_ms']:.0f} | {lv['gap_p50_ms']:.1f} / {lv['gap_p99_ms']:.1f} | "
              f"{sv.get('extend_steps', 0):.0f} |")


if __name__ == "__main__":
    main()
