"""The load client of the HTTP benchmarks: streamed chat completions, timed per chunk.

One level = `concurrency` streams started together (or, at concurrency 1, prompts one
after another). One asyncio process parses every SSE line of every stream, and at tens
of thousands of chunks per second that process becomes what is measured (on the H200 host
it ran at 80% of a core at 64 streams): above `streams_per_client` streams the level is
split over several client processes, started at one wall-clock instant, each warming its
own connections first. The same client drives Kestrel and any other OpenAI-compatible
server. Only aiohttp and the standard library are imported here, so a client process
starts in a fraction of a second.
"""
from __future__ import annotations

import asyncio
import json
import math
import multiprocessing as mp
import re
import statistics
import time


async def sse_chunks(response):
    """The JSON chunks of a streamed response, up to [DONE] (an error event included)."""
    async for line in response.content:
        if not line.startswith(b"data: "):
            continue
        data = line[6:].strip()
        if data == b"[DONE]":
            return
        yield json.loads(data)


async def one_request(session, url: str, model: str, question: str, max_tokens: int,
                      extra: dict | None = None) -> dict:
    """One streamed chat; `extra` fields (sampling settings, a response_format) go into
    the body over the greedy defaults."""
    body = {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": question}],
            "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for chunk in sse_chunks(r):
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices")
            if choices and (choices[0].get("delta") or {}).get("content"):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": (arrivals[0] if arrivals else end) - t0, "e2e": end - t0, "tokens": tokens,
            "chunks": len(arrivals),
            "tpot": (arrivals[-1] - arrivals[0]) / max(1, tokens - 1) if arrivals else 0.0,
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])]}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def summarize(rows: list[dict], seconds: float) -> dict:
    ttft = [r["ttft"] for r in rows]
    gaps = [g for r in rows for g in r["gaps"]]
    return {"requests": len(rows), "tokens": sum(r["tokens"] for r in rows), "seconds": seconds,
            "tok_s": sum(r["tokens"] for r in rows) / seconds,
            "chunks_s": sum(r["chunks"] for r in rows) / seconds,
            "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "ttft_mean_ms": 1000 * statistics.mean(ttft),
            "tpot_ms": 1000 * statistics.mean(r["tpot"] for r in rows),
            "gap_p50_ms": 1000 * pct(gaps, 0.5), "gap_p99_ms": 1000 * pct(gaps, 0.99),
            "e2e_s": statistics.mean(r["e2e"] for r in rows),
            # the slowest stream sets a level's wall time; with speculation a step advances
            # each stream by its own accepted length, so two runs whose mean stream is equally
            # fast can differ here (session 19: the tree at 1024 tokens, with a grammar)
            "e2e_max_s": max(r["e2e"] for r in rows)}


# ---- the server's side, from /metrics ---------------------------------------------------------
_SAMPLE = re.compile(r'^(kestrel_[a-z_]+)(?:\{([^}]*)\})? ([0-9.eE+-]+)$')


async def scrape(session, url: str) -> dict[str, float]:
    """Summed over labels but the one that matters: 'name' or 'name:mode/phase'."""
    try:
        async with session.get(url + "/metrics") as r:
            if r.status != 200:
                return {}
            text = await r.text()
    except Exception:  # noqa: BLE001 - a server without Kestrel's metrics
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        sub = re.search(r'(?:mode|phase)="([a-z_]+)"', labels)
        key = f"{name}:{sub.group(1)}" if sub else name
        out[key] = out.get(key, 0.0) + value
    return out


def server_side(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = d.get("kestrel_engine_steps_total:extend", 0) + d.get("kestrel_engine_steps_total:decode", 0)
    if not steps:
        return {}
    per_step = {p: 1000 * d.get(f"kestrel_engine_step_seconds_total:{p}", 0.0) / steps
                for p in ("schedule", "process", "execute", "recv", "compile")}
    pipelined = d.get("kestrel_engine_steps_total:pipelined", 0)
    ttft_n = d.get("kestrel_time_to_first_token_seconds_count", 0)
    accepts = d.get("kestrel_spec_accept_length_count", 0)
    return {"steps_s": steps / seconds, "step_ms": per_step,
            # the collector's full passes stop a step loop: their seconds in all
            "gc_s": d.get("kestrel_engine_step_seconds_total:gc", 0.0),
            "extend_steps": d.get("kestrel_engine_steps_total:extend", 0),
            "accept_mean": d.get("kestrel_spec_accept_length_sum", 0.0) / accepts if accepts else None,
            "wait_ms_per_pipelined_step": 1000 * d.get("kestrel_engine_step_seconds_total:wait", 0.0)
            / pipelined if pipelined else None,
            "gpu_idle_ms_per_pipelined_step": 1000 * d.get("kestrel_engine_step_seconds_total:gpu_idle", 0.0)
            / pipelined if pipelined else None,
            "pipelined_share": pipelined / steps,
            "server_ttft_mean_ms": 1000 * d.get("kestrel_time_to_first_token_seconds_sum", 0.0) / ttft_n
            if ttft_n else None}


# ---- one level ----------------------------------------------------------------------------
def _session(streams: int):
    import aiohttp
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams + 8),
                                 timeout=aiohttp.ClientTimeout(total=1800))


def _client_process(conn, url: str, model: str, questions: list[str], max_tokens: int,
                    extra: dict | None) -> None:
    """A child: warm its connections at its share of the batch, say ready, start its
    streams at the wall-clock time the parent sends, and send back (rows, end time)."""
    async def run() -> None:
        async with _session(len(questions)) as session:
            await asyncio.gather(*(one_request(session, url, model, q, 4, extra) for q in questions))
            conn.send("ready")
            start_at = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            await asyncio.sleep(max(0.0, start_at - time.time()))
            rows = await asyncio.gather(*(one_request(session, url, model, q, max_tokens, extra)
                                          for q in questions))
            conn.send((rows, time.time()))
    try:
        asyncio.run(run())
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))


async def _run_split(url: str, model: str, questions: list[str], max_tokens: int,
                     procs: int, session, extra: dict | None) -> tuple[list[dict], float, dict, dict]:
    ctx = mp.get_context("spawn")
    per = math.ceil(len(questions) / procs)
    shares = [questions[i:i + per] for i in range(0, len(questions), per)]
    pipes, children = [], []
    for share in shares:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_client_process, args=(child, url, model, share, max_tokens, extra), daemon=True)
        p.start()
        pipes.append(parent)
        children.append(p)
    loop = asyncio.get_running_loop()
    try:
        for msg in await asyncio.gather(*(loop.run_in_executor(None, p.recv) for p in pipes)):
            if msg != "ready":
                raise RuntimeError(f"a client process failed: {msg[1]}")
        before = await scrape(session, url)
        start_at = time.time() + 0.05
        for p in pipes:
            p.send(start_at)
        rows, ends = [], []
        for msg in await asyncio.gather(*(loop.run_in_executor(None, p.recv) for p in pipes)):
            if msg[0] == "error":
                raise RuntimeError(f"a client process failed: {msg[1]}")
            rows += msg[0]
            ends.append(msg[1])
        seconds = max(ends) - start_at
        after = await scrape(session, url)
    finally:
        for p in children:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return rows, seconds, before, after


async def run_level(url: str, model: str, questions: list[str], concurrency: int,
                    max_tokens: int, c1_prompts: int, streams_per_client: int = 16,
                    extra: dict | None = None) -> dict:
    procs = max(1, math.ceil(concurrency / streams_per_client)) if concurrency > 1 else 1
    async with _session(concurrency) as session:
        if procs > 1:
            rows, seconds, before, after = await _run_split(url, model, questions[:concurrency],
                                                            max_tokens, procs, session, extra)
        else:
            # Warm-up at the level's batch, as the in-process run does (kernels compiled
            # for these shapes, connections open).
            await asyncio.gather(*(one_request(session, url, model, q, 4, extra)
                                   for q in questions[:max(1, concurrency)]))
            before = await scrape(session, url)
            t0 = time.perf_counter()
            if concurrency == 1:
                rows = [await one_request(session, url, model, q, max_tokens, extra)
                        for q in questions[:c1_prompts]]
            else:
                rows = await asyncio.gather(*(one_request(session, url, model, q, max_tokens, extra)
                                              for q in questions[:concurrency]))
            seconds = time.perf_counter() - t0
            after = await scrape(session, url)
    return {"concurrency": concurrency, "client_processes": procs, **summarize(rows, seconds),
            "server": server_side(before, after, seconds)}


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle of an even count), carrying
    every run's tokens/s beside it."""
    ranked = sorted(runs, key=lambda r: r["tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "tok_s_runs": [r["tok_s"] for r in runs]}
