"""HTTP load benchmark: `kestrel serve` against the in-process engine, same prompts.

    python -m benchmarks.http_bench [--concurrency 1 4 16] [--max-tokens 64]
        [--set KEY=VALUE ...] [--url http://127.0.0.1:8000]

Starts `kestrel serve` on a free port (unless --url points at a running server), sends
MT-bench first turns as streamed greedy chat requests at each concurrency level, and
reports TTFT, inter-token latency, end-to-end latency and tokens/s. Then runs the same
prompts through the in-process LLMEngine at batch = concurrency, so the table shows
what the Ray/Serve/HTTP path costs per token.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.offline import DATA, load_questions

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(overrides: list[str]) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "serve_app.cli", "serve", "--port", str(port)]
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    return proc, f"http://127.0.0.1:{port}"


async def wait_ready(url: str, timeout: float = 300.0) -> None:
    import httpx
    deadline = time.time() + timeout
    async with httpx.AsyncClient() as c:
        while time.time() < deadline:
            try:
                if (await c.get(url + "/v1/models", timeout=5)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"server at {url} not ready after {timeout:.0f}s")


async def one_request(client, url: str, question: str, max_tokens: int) -> dict:
    body = {"model": "SmolLM2-135M-Instruct", "stream": True, "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": question}],
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft": arrivals[0] - t0 if arrivals else end - t0, "e2e": end - t0,
            "itl": (arrivals[-1] - arrivals[0]) / max(1, tokens - 1) if arrivals else 0.0,
            "gaps": gaps, "tokens": tokens}


async def run_level(url: str, questions: list[str], concurrency: int, max_tokens: int) -> dict:
    import httpx
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        await one_request(client, url, questions[0], 4)  # warm-up
        t0 = time.perf_counter()
        rows = await asyncio.gather(*(one_request(client, url, q, max_tokens)
                                      for q in questions[:concurrency]))
        dt = time.perf_counter() - t0
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0
    return {"concurrency": concurrency, "tok_s": sum(r["tokens"] for r in rows) / dt,
            "ttft_ms": 1000 * statistics.mean(r["ttft"] for r in rows),
            "itl_ms": 1000 * statistics.mean(r["itl"] for r in rows),
            "itl_p90_ms": 1000 * pct([g for r in rows for g in r["gaps"]], 0.9),
            "e2e_s": statistics.mean(r["e2e"] for r in rows)}


def in_process(overrides: list[str], questions: list[str], batch: int, max_tokens: int) -> float:
    from configs.schema import load_config
    from serve_app.llm_engine import LLMEngine
    from serve_app.request import SamplingParams
    from serve_app.tokenizer import apply_chat_template
    eng = LLMEngine(load_config(overrides=overrides))
    prompts = [apply_chat_template(eng.tokenizer, [{"role": "user", "content": q}])
               for q in questions[:batch]]
    eng.generate(prompts[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    reqs = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--url", default=None)
    args = ap.parse_args(argv)
    overrides = ["device=cpu", "kv_cache.num_slots=16384", "scheduler.max_running_requests=32",
                 "scheduler.max_queued_requests=256"] + args.set
    questions = load_questions(Path(DATA), max(args.concurrency))
    proc = None
    url = args.url
    if url is None:
        proc, url = start_server(overrides)
    try:
        print(f"waiting for {url} ...", file=sys.stderr, flush=True)
        asyncio.run(wait_ready(url))
        levels = []
        for c in args.concurrency:
            levels.append(asyncio.run(run_level(url, questions, c, args.max_tokens)))
            print(f"concurrency {c}: {levels[-1]}", file=sys.stderr, flush=True)
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    for lv in levels:
        lv["in_process_tok_s"] = in_process(overrides, questions, lv["concurrency"], args.max_tokens)
        print(f"in-process batch {lv['concurrency']}: {lv['in_process_tok_s']:.1f} tok/s",
              file=sys.stderr, flush=True)
    print(f"\n{os.cpu_count()} cpus, {args.max_tokens} new tokens, greedy, streamed chat\n")
    print("| concurrency | HTTP tok/s | in-process tok/s (batch = concurrency) | HTTP / in-process "
          "| TTFT ms | ITL ms | ITL p90 ms | e2e s |")
    print("|---|---|---|---|---|---|---|---|")
    for lv in levels:
        print(f"| {lv['concurrency']} | {lv['tok_s']:.1f} | {lv['in_process_tok_s']:.1f} | "
              f"{lv['tok_s'] / lv['in_process_tok_s']:.2f} | {lv['ttft_ms']:.0f} | "
              f"{lv['itl_ms']:.1f} | {lv['itl_p90_ms']:.1f} | {lv['e2e_s']:.2f} |")


if __name__ == "__main__":
    main()
