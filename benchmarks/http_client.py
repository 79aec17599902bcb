"""The load client of the HTTP benchmarks: streamed chat (or text) completions, timed per chunk.

`one_request` sends one request and times its chunks; the closed levels here and the
open-loop runs (benchmarks/open_loop.py) both send through it. One level = `concurrency`
streams started together (or, at concurrency 1, prompts one after another). One asyncio
process parses every SSE line of every stream, and at tens of thousands of chunks per
second that process becomes what is measured (on the H200 host it ran at 80% of a core at
64 streams): above `streams_per_client` streams the level is split over several client
processes, started at one wall-clock instant, each warming its own connections first; each
process sends its share of jobs (offset from that instant, request, max_tokens), all at
offset 0 for a closed level. The same client drives Kestrel and any other
OpenAI-compatible server. Only aiohttp and the standard library are imported here, so a
client process starts in a fraction of a second.
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


def request_body(model: str, item: str | dict, max_tokens: int, extra: dict | None) -> tuple[str, dict]:
    """(route, body) for a question (a chat's user turn) or a mix row ({"messages": [...]} for
    chat, {"prompt": "..."} for text completions); `extra` fields (sampling settings, a
    response_format) go into the body over the greedy defaults."""
    if isinstance(item, str):
        item = {"messages": [{"role": "user", "content": item}]}
    route = "/v1/chat/completions" if "messages" in item else "/v1/completions"
    text = {"messages": item["messages"]} if "messages" in item else {"prompt": item["prompt"]}
    return route, {"model": model, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                   "ignore_eos": True, **text, "stream_options": {"include_usage": True}, **(extra or {})}


async def one_request(session, url: str, model: str, item: str | dict, max_tokens: int,
                      extra: dict | None = None) -> dict:
    """One streamed request (see `request_body`), timed: TTFT, end to end, the gaps between
    chunks with text, and TPOT over the tokens after the first (usage's count)."""
    route, body = request_body(model, item, max_tokens, extra)
    t0 = time.perf_counter()
    arrivals: list[float] = []
    tokens = 0
    async with session.post(url + route, json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for chunk in sse_chunks(r):
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            choices = chunk.get("choices")
            if choices and ((choices[0].get("delta") or {}).get("content") or choices[0].get("text")):
                arrivals.append(time.perf_counter())
    end = time.perf_counter()
    return {"ttft": (arrivals[0] if arrivals else end) - t0, "e2e": end - t0, "tokens": tokens,
            "chunks": len(arrivals),
            "tpot": (arrivals[-1] - arrivals[0]) / max(1, tokens - 1) if arrivals else 0.0,
            "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])]}


async def _sent(session, url: str, model: str, item: str | dict, max_tokens: int, extra: dict | None,
                due: float, keep_errors: bool) -> dict:
    """one_request, with how late it left (`lag`, s after `due`) and its wall-clock end; with
    keep_errors a failure is a row with its `error` instead of an exception."""
    sent = time.time()
    try:
        row = await one_request(session, url, model, item, max_tokens, extra)
    except Exception as e:  # noqa: BLE001 - an open-loop run counts the failures
        if not keep_errors:
            raise
        row = {"error": f"{type(e).__name__}: {e}"[:300]}
    return {**row, "lag": sent - due, "end": time.time()}


async def _stream(session, url: str, model: str, items: list, max_tokens: int, extra: dict | None,
                  due: float, keep_errors: bool) -> list[dict]:
    """A closed stream: its requests one after another, each sent when the one before ends."""
    rows = []
    for j, item in enumerate(items):
        rows.append(await _sent(session, url, model, item, max_tokens, extra, due if j == 0 else time.time(),
                                keep_errors))
    return rows


async def run_jobs(session, url: str, model: str, jobs: list[tuple[float, str | dict | list, int]],
                   extra: dict | None, start_at: float, keep_errors: bool = False) -> list[dict]:
    """Each job (offset s, request, max_tokens) sent at wall-clock start_at + offset whether or
    not the earlier ones have finished; a job whose request is a list is a closed stream of
    those requests (`_stream`). The rows in the jobs' order (a stream's in its order)."""
    tasks = []
    for offset, item, max_tokens in jobs:
        delay = start_at + offset - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        send = _stream(session, url, model, item, max_tokens, extra, start_at + offset, keep_errors) \
            if isinstance(item, list) else _sent(session, url, model, item, max_tokens, extra,
                                                  start_at + offset, keep_errors)
        tasks.append(asyncio.create_task(send))
    return [row for done in await asyncio.gather(*tasks) for row in (done if isinstance(done, list) else [done])]


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
            # fast can differ here (the tree at 1024 tokens with a grammar, docs/benchmarks.md 2026-12-03)
            "e2e_max_s": max(r["e2e"] for r in rows)}


# ---- the server's side, from /metrics ---------------------------------------------------------
_SAMPLE = re.compile(r'^(kestrel_[a-z_]+)(?:\{([^}]*)\})? ([0-9.eE+-]+)$')


async def scrape(session, url: str) -> dict[str, float]:
    """The server's /metrics as parse_metrics reads them; {} from a server without them."""
    try:
        async with session.get(url + "/metrics") as r:
            if r.status != 200:
                return {}
            text = await r.text()
    except Exception:  # noqa: BLE001 - a server without Kestrel's metrics
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Kestrel's samples summed over labels but the one that matters: 'name' or
    'name:mode/phase/reason/shape', with '@batch' after the shape where a sample has one."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        sub = re.search(r'(?:mode|phase|reason|shape)="([a-z0-9_]+)"', labels)
        batch = re.search(r'batch="([0-9]+)"', labels)
        key = f"{name}:{sub.group(1)}" if sub else name
        key += f"@{batch.group(1)}" if batch else ""
        out[key] = out.get(key, 0.0) + value
    return out


def server_side(before: dict[str, float], after: dict[str, float], seconds: float) -> dict:
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    steps = sum(d.get(f"kestrel_engine_steps_total:{mode}", 0) for mode in ("extend", "decode", "mixed"))
    if not steps:
        return {}
    per_step = {p: 1000 * d.get(f"kestrel_engine_step_seconds_total:{p}", 0.0) / steps
                for p in ("schedule", "process", "execute", "recv", "compile")}
    pipelined = d.get("kestrel_engine_steps_total:pipelined", 0)
    ttft_n = d.get("kestrel_time_to_first_token_seconds_count", 0)
    accepts = d.get("kestrel_spec_accept_length_count", 0)
    by = lambda metric: {k.split(":", 1)[1]: v for k, v in d.items() if k.startswith(metric + ":") and v}
    return {"steps_s": steps / seconds, "step_ms": per_step,
            # steps that left the captured graphs, by reason (should be none), and the
            # speculative steps per draft shape (draft.adaptive_shapes)
            "eager_steps": by("kestrel_engine_eager_steps_total"),
            "draft_shapes": by("kestrel_engine_draft_shape_steps_total"),
            # the draft policy's accept estimates at the end
            "draft_accept": {k.split(":", 1)[1]: round(v, 2) for k, v in after.items()
                             if k.startswith("kestrel_engine_draft_accept_estimate:")},
            # ... and the step periods it measured, ms, by shape@batch size (draft.measured_periods)
            "draft_period_ms": {k.split(":", 1)[1]: round(1000 * v, 2) for k, v in after.items()
                                if k.startswith("kestrel_engine_draft_step_period_seconds:")},
            # the collector's full passes stop a step loop: their seconds in all
            "gc_s": d.get("kestrel_engine_step_seconds_total:gc", 0.0),
            "extend_steps": d.get("kestrel_engine_steps_total:extend", 0),
            "mixed_steps": d.get("kestrel_engine_steps_total:mixed", 0),
            "accept_mean": d.get("kestrel_spec_accept_length_sum", 0.0) / accepts if accepts else None,
            "wait_ms_per_pipelined_step": 1000 * d.get("kestrel_engine_step_seconds_total:wait", 0.0)
            / pipelined if pipelined else None,
            "gpu_idle_ms_per_pipelined_step": 1000 * d.get("kestrel_engine_step_seconds_total:gpu_idle", 0.0)
            / pipelined if pipelined else None,
            "pipelined_share": pipelined / steps,
            "server_ttft_mean_ms": 1000 * d.get("kestrel_time_to_first_token_seconds_sum", 0.0) / ttft_n
            if ttft_n else None}


# ---- one level ----------------------------------------------------------------------------
def client_session(streams: int):
    import aiohttp
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=streams + 8),
                                 timeout=aiohttp.ClientTimeout(total=1800))


def _client_process(conn, url: str, model: str, jobs: list[tuple[float, str | dict, int]], warm: int,
                    extra: dict | None, keep_errors: bool) -> None:
    """A child: warm its connections with its first `warm` requests, say ready, send its
    jobs from the wall-clock time the parent sends, and send back (rows, end time)."""
    async def run() -> None:
        async with client_session(len(jobs)) as session:
            await asyncio.gather(*(one_request(session, url, model, item[0] if isinstance(item, list) else item, 4, extra)
                                   for _, item, _ in jobs[:warm]))
            conn.send("ready")
            start_at = await asyncio.get_running_loop().run_in_executor(None, conn.recv)
            rows = await run_jobs(session, url, model, jobs, extra, start_at, keep_errors)
            conn.send((rows, time.time()))
    try:
        asyncio.run(run())
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        conn.send(("error", f"{type(e).__name__}: {e}"))


async def run_in_processes(url: str, model: str, shares: list[list[tuple[float, str | dict, int]]],
                           session, extra: dict | None, warm: int | None = None,
                           keep_errors: bool = False) -> tuple[list[dict], float, dict, dict]:
    """One client process per share of jobs, all started at one wall-clock instant, each
    warmed with its first `warm` requests (None: all of them) -> (rows, seconds from the
    start to the last end, /metrics before, /metrics after)."""
    ctx = mp.get_context("spawn")
    pipes, children = [], []
    for share in shares:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_client_process, daemon=True,
                        args=(child, url, model, share, len(share) if warm is None else warm, extra, keep_errors))
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


def stream_questions(questions: list[str], concurrency: int, rounds: int) -> list[list[str]]:
    """Stream i's questions over `rounds` rounds: i, i + c, i + 2c, ... (the list cycled)."""
    return [[questions[(i + r * concurrency) % len(questions)] for r in range(rounds)] for i in range(concurrency)]


async def run_level(url: str, model: str, questions: list[str], concurrency: int,
                    max_tokens: int, c1_prompts: int, streams_per_client: int = 16,
                    extra: dict | None = None, rounds: int = 1, warmup: list | None = None) -> dict:
    """One closed level: `concurrency` streams started together, each sending `rounds`
    requests one after another (so the level holds that many streams busy past the first
    burst's admission and the last answers' tail), or at concurrency 1 the first c1_prompts
    questions one after another. `warmup`: the requests that warm a level of one client
    process (default: its first `concurrency` questions, which a server's prefix cache then
    holds when they are measured)."""
    procs = max(1, math.ceil(concurrency / streams_per_client)) if concurrency > 1 else 1
    streams = stream_questions(questions, concurrency, rounds) if concurrency > 1 else []
    async with client_session(concurrency) as session:
        if procs > 1:
            jobs = [(0.0, qs, max_tokens) for qs in streams]
            per = math.ceil(len(jobs) / procs)
            shares = [jobs[i:i + per] for i in range(0, len(jobs), per)]
            rows, seconds, before, after = await run_in_processes(url, model, shares, session, extra)
        else:
            # Warm-up at the level's batch, as the in-process run does (kernels compiled
            # for these shapes, connections open).
            await asyncio.gather(*(one_request(session, url, model, q, 4, extra)
                                   for q in (questions[:max(1, concurrency)] if warmup is None else warmup)))
            before = await scrape(session, url)
            t0 = time.perf_counter()
            if concurrency == 1:
                rows = [await one_request(session, url, model, q, max_tokens, extra)
                        for q in questions[:c1_prompts]]
            else:
                rows = await run_jobs(session, url, model, [(0.0, qs, max_tokens) for qs in streams], extra,
                                      time.time())
            seconds = time.perf_counter() - t0
            after = await scrape(session, url)
    return {"concurrency": concurrency, "client_processes": procs, "rounds": rounds if concurrency > 1 else 1,
            **summarize(rows, seconds), "busy_tok_s": busy_tok_s(rows, concurrency),
            "server": server_side(before, after, seconds)}


def busy_tok_s(rows: list[dict], concurrency: int) -> float:
    """Tokens/s of `concurrency` streams each always busy at the mean request's speed: a
    level's rate without its tail, where the streams that finished early wait for the
    slowest (with speculation, streams differ in speed by how well their prompts draft)."""
    return concurrency * sum(r["tokens"] for r in rows) / sum(r["e2e"] for r in rows)


def median_run(runs: list[dict]) -> dict:
    """The run with the median tokens/s (the lower middle of an even count), carrying
    every run's tokens/s beside it."""
    ranked = sorted(runs, key=lambda r: r["tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "tok_s_runs": [r["tok_s"] for r in runs]}
