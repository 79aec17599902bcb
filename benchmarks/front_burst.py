"""A burst of streamed chat requests against the replica's HTTP front end alone: CPU, no model.

    python -m benchmarks.front_burst [--concurrency 128 512] [--repeats 3] [--max-tokens 16]
        [--step-ms 5] [--client aiohttp|openai] [--set KEY=VALUE ...] [--py-spy PATH --out DIR]

What an Engine replica runs for HTTP, in one process: the OpenAI FastAPI app under uvicorn
and the real EngineClient (admission, AddRequest frames, request streams with the real
tokenizer's detokenization). Its front channel leads to a stand-in engine core in a second
process that answers every AddRequest with its first token in the same read, and then one
token per --step-ms until --max-tokens. The engine's time to a first token is then nil, so
whatever a client waits for its first chunk is the front end's: accepting and reading the
request, parsing and validating the body, the chat template and tokenizing, admission,
and writing the chunk back, with the earlier requests' streams sharing the event loop.

The client (this process) opens --concurrency connections first (a short request on each),
then sends the MT-bench first turns all at once, streamed, as benchmarks/http_bench.py does,
and times per request the first chunk of any kind (the role chunk chat sends before the
engine answers: the handler has run) and the first chunk with text (TTFT). It prints p50
and p99 per level and repeat, and the front end's CPU seconds over the burst (with the raw
client, the chunks it wrote: what a chunk costs the front end's one core). With --py-spy, py-spy samples the front end's process during
each level's first burst (raw stacks under --out; `python -m benchmarks.stack_summary`).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import time

from benchmarks.http_bench import _free_port
from benchmarks.offline import DATA, load_questions

MODEL = "SmolLM2-135M-Instruct"
TOKEN = "front-burst"


# ---- the stand-in engine core (its own process) -------------------------------------------
def _core_main(port: int, step_ms: float, ready) -> None:
    asyncio.run(_core(port, step_ms, ready))


async def _core(port: int, step_ms: float, ready) -> None:
    from actors.protocol.messages import (CORE_RECEIVES_FROM_FRONT, AddRequest, FinishRequest, Hello,
                                          Outputs, Ready, RequestOutput, encode, read_message)
    from actors.models.loader import default_model_path
    from serve_app.text.tokenizer import load_tokenizer
    # Whole words, so every token shows text at once (a random id may be half a character).
    words = load_tokenizer(default_model_path()).encode(
        " the quick brown fox jumps over the lazy dog and runs far away", add_special_tokens=False)
    rng = random.Random(0)
    done = asyncio.Event()

    async def serve(reader, writer):
        await read_message(reader, (Hello,))
        writer.write(encode(Ready()))
        running: dict[str, list] = {}  # rid -> [tokens sent, max_tokens, prompt length]
        new: list[str] = []
        woken = asyncio.Event()

        async def steps():
            last = time.monotonic()
            while True:
                if not new:
                    try:
                        await asyncio.wait_for(woken.wait(), max(0.0, last + step_ms / 1000 - time.monotonic()))
                    except asyncio.TimeoutError:
                        pass
                woken.clear()
                now = time.monotonic()
                decode = now - last >= step_ms / 1000
                rids = list(running) if decode else list(new)
                if decode:
                    last = now
                new.clear()
                outs = []
                for rid in rids:
                    r = running[rid]
                    r[0] += 1
                    fin = r[0] >= r[1]
                    outs.append(RequestOutput(rid, [rng.choice(words)], "", fin,
                                              "length" if fin else None, r[2], r[0]))
                    if fin:
                        del running[rid]
                if outs:
                    writer.write(encode(Outputs(outs)))

        stepper = asyncio.create_task(steps())
        try:
            while True:
                m = await read_message(reader, CORE_RECEIVES_FROM_FRONT)
                if isinstance(m, AddRequest):
                    running[m.rid] = [0, m.params.max_tokens, len(m.prompt_ids)]
                    new.append(m.rid)
                    woken.set()  # first tokens go in the next round, with every other arrival read by then
                elif isinstance(m, FinishRequest):
                    running.pop(m.rid, None)
        except (asyncio.IncompleteReadError, ConnectionError):
            stepper.cancel()
            done.set()

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    ready.set()
    async with server:
        await done.wait()


# ---- the front end (its own process) -------------------------------------------------------
def _front_main(port: int, core_port: int, overrides: list[str], ready, gc_ms) -> None:
    asyncio.run(_front(port, core_port, overrides, ready, gc_ms))


async def _front(port: int, core_port: int, overrides: list[str], ready, gc_ms) -> None:
    import threading

    import uvicorn

    from actors.worker import gc_pauses

    from actors.models.loader import default_model_path
    from configs.schema import load_config
    from serve_app.api.openai_server import OpenAIServer, build_api
    from serve_app.engine.engine_client import EngineClient
    from serve_app.text.tokenizer import load_tokenizer
    cfg = load_config(overrides=["device=cpu", "scheduler.max_running_requests=2048",
                                 "scheduler.max_queued_requests=4096", *overrides])
    tok = load_tokenizer(default_model_path())
    engine = await EngineClient.connect(cfg, 1, "127.0.0.1", core_port, TOKEN, tok)
    server = uvicorn.Server(uvicorn.Config(build_api(OpenAIServer(cfg, engine, tok)), host="127.0.0.1",
                                           port=port, log_level="warning", lifespan="off",
                                           backlog=4096))
    gc_pauses.serving("front", cfg.serve.gc_freeze)  # as the replica does once started
    watch = gc_pauses.watch()

    def publish() -> None:  # the collector's pauses, for the client to read between bursts
        while True:
            gc_ms.value = 1000 * watch.seconds
            time.sleep(0.05)

    threading.Thread(target=publish, daemon=True).start()
    ready.set()
    await server.serve()


# ---- the client (this process) -------------------------------------------------------------
def _raw_request(port: int, question: str, max_tokens: int) -> bytes:
    body = json.dumps({"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "messages": [{"role": "user", "content": question}],
                       "stream_options": {"include_usage": True}}).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body


async def _raw_exchange(reader, writer, request: bytes) -> tuple[float, float, int]:
    """One request on an open keep-alive connection, its response read line by line:
    (seconds to the first chunk, to the first chunk with text, chunks)."""
    t0 = time.perf_counter()
    writer.write(request)
    first = text = None
    chunks = 0
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"HTTP {status!r}")
    while True:
        line = await reader.readline()
        if not line:
            raise RuntimeError("the server closed the connection")
        if line.startswith(b"data: "):
            now = time.perf_counter()
            chunks += 1
            first = first or now
            if text is None and b'"content":"' in line and b'"content":""' not in line:
                text = now
        elif line == b"0\r\n":  # the chunked body's end
            await reader.readline()
            return first - t0, text - t0, chunks


async def _aiohttp_request(session, url: str, question: str, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first chunk, seconds to the first chunk with text)."""
    body = {"model": MODEL, "stream": True, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": question}],
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = text = None
    async with session.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:300]}")
        async for line in r.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            now = time.perf_counter()
            first = first or now
            if text is None:
                choices = json.loads(line[6:]).get("choices")
                if choices and choices[0]["delta"].get("content"):
                    text = now
    return first - t0, text - t0


async def _openai_request(client, question: str, max_tokens: int) -> tuple[float, float]:
    t0 = time.perf_counter()
    first = text = None
    stream = await client.chat.completions.create(
        model=MODEL, stream=True, max_tokens=max_tokens, temperature=0,
        messages=[{"role": "user", "content": question}], extra_body={"ignore_eos": True},
        stream_options={"include_usage": True})
    async for chunk in stream:
        now = time.perf_counter()
        first = first or now
        if text is None and chunk.choices and chunk.choices[0].delta.content:
            text = now
    return first - t0, text - t0


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _level(url: str, questions: list[str], c: int, max_tokens: int, client: str,
                 spy: subprocess.Popen | None, front_pid: int) -> dict:
    if client == "raw":
        port = int(url.rsplit(":", 1)[1])
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(c)]
        reqs = [(_raw_request(port, q, 1), _raw_request(port, q, max_tokens)) for q in questions[:c]]
        session = None
        send = lambda i, q, n: _raw_exchange(*conns[i], reqs[i][0 if n == 1 else 1])  # noqa: E731
    elif client == "openai":
        import httpx
        import openai
        http = httpx.AsyncClient(limits=httpx.Limits(max_connections=c + 8, max_keepalive_connections=c + 8),
                                 timeout=600)
        session = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", http_client=http, max_retries=0)
        send = lambda i, q, n: _openai_request(session, q, n)  # noqa: E731
    else:
        import aiohttp
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=c + 8),
                                        timeout=aiohttp.ClientTimeout(total=600))
        send = lambda i, q, n: _aiohttp_request(session, url, q, n)  # noqa: E731
    try:
        await asyncio.gather(*(send(i, q, 1) for i, q in enumerate(questions[:c])))  # c connections open
        await asyncio.sleep(0.5)
        if spy is not None:
            await asyncio.sleep(1.0)  # py-spy attached
        t0, cpu0 = time.perf_counter(), _cpu_seconds(front_pid)
        rows = await asyncio.gather(*(send(i, q, max_tokens) for i, q in enumerate(questions[:c])))
        seconds = time.perf_counter() - t0
        await asyncio.sleep(0.2)  # the front end's last writes and cleanup
        front_cpu = _cpu_seconds(front_pid) - cpu0
    finally:
        if client == "raw":
            for _, w in conns:
                w.close()
        else:
            await session.close()
    first = [r[0] for r in rows]
    ttft = [r[1] for r in rows]
    chunks = sum(r[2] for r in rows) if client == "raw" else None
    return {"concurrency": c, "seconds": seconds, "front_cpu_s": front_cpu, "chunks": chunks,
            "first_chunk_p50_ms": 1000 * _pct(first, 0.5), "first_chunk_p99_ms": 1000 * _pct(first, 0.99),
            "ttft_p50_ms": 1000 * _pct(ttft, 0.5), "ttft_p99_ms": 1000 * _pct(ttft, 0.99),
            "ttft_mean_ms": 1000 * statistics.mean(ttft)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--step-ms", type=float, default=5.0, help="the stand-in core's decode step")
    ap.add_argument("--client", choices=["raw", "aiohttp", "openai"], default="raw",
                    help="raw: pre-built HTTP/1.1 requests on open connections, the cheapest client "
                         "(one client process shares the cores with the server)")
    ap.add_argument("--set", action="append", default=[], help="config override for the front end")
    ap.add_argument("--py-spy", default=None, help="py-spy binary: sample the front end during each first burst")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)

    base = load_questions(DATA, 1000)
    questions = [base[i % len(base)] for i in range(max(args.concurrency))]
    ctx = mp.get_context("spawn")
    core_port, port = _free_port(), _free_port()
    core_ready, front_ready = ctx.Event(), ctx.Event()
    core = ctx.Process(target=_core_main, args=(core_port, args.step_ms, core_ready), daemon=True)
    core.start()
    core_ready.wait(60)
    gc_ms = ctx.Value("d", 0.0, lock=False)
    front = ctx.Process(target=_front_main, args=(port, core_port, args.set, front_ready, gc_ms), daemon=True)
    front.start()
    front_ready.wait(120)
    time.sleep(1.0)  # uvicorn binds
    url = f"http://127.0.0.1:{port}"
    levels = []
    try:
        for c in args.concurrency:
            for rep in range(args.repeats):
                spy = None
                if args.py_spy and rep == 0:
                    path = os.path.join(args.out, f"front_burst_spy_c{c}.txt")
                    spy = subprocess.Popen([args.py_spy, "record", "-p", str(front.pid), "-r", "200",
                                            "-d", "6", "-f", "raw", "-o", path, "--nonblocking"],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                gc0 = gc_ms.value
                row = asyncio.run(_level(url, questions, c, args.max_tokens, args.client, spy, front.pid))
                time.sleep(0.2)
                row["front_gc_ms"] = gc_ms.value - gc0  # warm-up and burst
                if spy is not None:
                    spy.wait()
                levels.append(row)
                print(f"c={c} run {rep + 1}: first chunk p50 {row['first_chunk_p50_ms']:.0f} ms, "
                      f"p99 {row['first_chunk_p99_ms']:.0f} ms; TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                      f"p99 {row['ttft_p99_ms']:.0f} ms, mean {row['ttft_mean_ms']:.0f} ms; "
                      f"burst {row['seconds']:.2f} s; front GC {row['front_gc_ms']:.0f} ms; front CPU "
                      f"{row['front_cpu_s']:.2f} s" + (f" for {row['chunks']} chunks" if row['chunks'] else ""),
                      flush=True)
    finally:
        front.kill()
        core.kill()
    for c in args.concurrency:
        runs = [r for r in levels if r["concurrency"] == c]
        print(f"c={c}: TTFT p50 median {statistics.median(r['ttft_p50_ms'] for r in runs):.0f} ms, "
              f"p99 median {statistics.median(r['ttft_p99_ms'] for r in runs):.0f} ms "
              f"over {len(runs)} runs")
    with open(os.path.join(args.out, "front_burst.json"), "w") as f:
        json.dump({"args": vars(args), "levels": levels}, f, indent=1)


if __name__ == "__main__":
    main()
