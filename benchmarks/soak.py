"""Soak: N streams for M minutes of mixed traffic, and an account of every request.

    python -m benchmarks.soak --config configs/h200.yaml --streams 64 --minutes 10 --structured [--out DIR]
    python -m benchmarks.soak --tiny-model --streams 8 --minutes 1       # CPU
    python -m benchmarks.soak --url http://host:8000 --streams 16 --minutes 5

Starts `kestrel serve` (as benchmarks/http_bench.py does) unless --url names a server. Each
of --streams workers sends one request after another until the time is up, drawn from a
fixed mix (seeded): streamed chat with random lengths and sampling settings (greedy,
temperature/top_p/seed, penalties, logprobs, n=2), non-streamed completions, streams the
client abandons after a few chunks, and bad requests. Every request ends as exactly one of:

- completed: a 200 whose choices all finished with a reason and whose usage arrived;
- stopped: the client hung up on purpose;
- rejected: a bad request answered 4xx with an OpenAI error body (as it must be);
- busy: 503/429 with Retry-After (backpressure, not a failure);
- failed: anything else the server said: a 5xx, an error event mid-stream, a bad request
  that was not answered with a 4xx error body;
- lost: accepted, then no end (the stream closed without a finish reason, or the client's
  timeout passed): must be 0.

It reports those counts, TTFT and inter-token gaps (p50/p99), tokens/s, the resident memory
of the server's processes over time (on this host: the replica, the engine core, the rank
actors) and the KV usage and running count from /metrics before and after (which must come
back to where they started). The exit status is 1 when anything was failed or lost, or the
KV cache did not return to its start.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.http_client import pct, sse_chunks

MODEL = "SmolLM2-135M-Instruct"
PROCESS_TITLES = ("ray::ServeReplica:kestrel:EngineDeployment", "ray::EngineCoreActor", "ray::RankActor")
PROMPTS = ["Write a haiku about the sea.", "Explain how a bicycle stays upright.",
           "List five prime numbers and say why they are prime.", "Tell me a short story about a fox.",
           "What is the capital of France? Answer in one word.", "Describe the water cycle."]


def bad_requests(vocab_size: int) -> list[tuple[str, str, object]]:
    """(route, what is wrong, body): each must be answered 4xx with an error body."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    return [
        ("/v1/chat/completions", "negative max_tokens", {**chat, "max_tokens": -1}),
        ("/v1/chat/completions", "temperature out of range", {**chat, "temperature": 5}),
        ("/v1/chat/completions", "no messages", {**chat, "messages": []}),
        ("/v1/chat/completions", "unknown field", {**chat, "frobnicate": 1}),
        ("/v1/chat/completions", "top_logprobs over 20", {**chat, "logprobs": True, "top_logprobs": 50}),
        ("/v1/chat/completions", "unknown model", {**chat, "model": "no-such-model"}),
        ("/v1/chat/completions", "unknown role", {**chat, "messages": [{"role": "wizard", "content": "x"}]}),
        ("/v1/chat/completions", "not JSON", b"{this is not json"),
        ("/v1/completions", "token id out of the vocabulary",
         {"model": MODEL, "prompt": [1, 2, vocab_size + 5], "max_tokens": 4}),
        ("/v1/completions", "n of 10000", {"model": MODEL, "prompt": "x", "max_tokens": 4, "n": 10000}),
    ]


def sampling_mix(rng: random.Random, structured: bool = False) -> dict:
    """One request's sampling settings, as clients send them; `structured` adds json_schema
    and required-tool chats (grammar rows) to the draw."""
    kinds = ["greedy", "greedy", "sampled", "penalized", "logprobs", "n2"]
    kind = rng.choice(kinds + ["json", "tool"] if structured else kinds)
    if kind == "greedy":
        return {"temperature": 0}
    if kind == "sampled":
        return {"temperature": 0.8, "top_p": 0.9, "seed": rng.randrange(1 << 30)}
    if kind == "penalized":
        return {"temperature": 0, "presence_penalty": 0.5, "frequency_penalty": 0.3}
    if kind == "logprobs":
        return {"temperature": 0, "logprobs": True, "top_logprobs": 3}
    if kind == "json":  # a grammar row (masked, also under speculation)
        return {"temperature": 0.8, "seed": rng.randrange(1 << 30), "response_format": {
            "type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA}}}
    if kind == "tool":
        return {"temperature": 0, "tools": [WEATHER_TOOL], "tool_choice": "required"}
    return {"temperature": 0.7, "n": 2, "seed": rng.randrange(1 << 30)}


CHAT_ONLY = ("logprobs", "top_logprobs", "response_format", "tools", "tool_choice")
ANSWER_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
                 "properties": {"answer": {"type": "string", "maxLength": 40}, "sure": {"type": "boolean"}}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}


class Account:
    """Outcomes and timings of every request of the run."""

    def __init__(self):
        self.outcomes: dict[str, int] = {k: 0 for k in
                                         ("completed", "stopped", "rejected", "busy", "failed", "lost")}
        self.examples: dict[str, list[str]] = {"failed": [], "lost": []}
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.tokens = 0

    def add(self, outcome: str, detail: str = "") -> None:
        self.outcomes[outcome] += 1
        if outcome in self.examples and len(self.examples[outcome]) < 10:
            self.examples[outcome].append(detail[:300])


async def _stream_chat(session, url: str, rng: random.Random, max_tokens: int, acct: Account,
                       abandon_after: int | None, timeout_s: float, structured: bool) -> None:
    import aiohttp
    body = {"model": MODEL, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": rng.randint(1, max_tokens), "stream": True,
            "stream_options": {"include_usage": True}, **sampling_mix(rng, structured)}
    n = body.get("n", 1)
    t0 = time.perf_counter()
    last = None
    finished: set[int] = set()
    usage = None
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status in (429, 503):
                acct.add("busy")
                return
            if r.status != 200:
                acct.add("failed", f"stream: HTTP {r.status}: {(await r.text())[:200]}")
                return
            chunks = 0
            async for chunk in sse_chunks(r):
                if "error" in chunk:
                    acct.add("failed", f"stream error event: {chunk['error']}")
                    return
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for ch in chunk.get("choices", []):
                    if ch.get("finish_reason"):
                        finished.add(ch["index"])
                    if (ch.get("delta") or {}).get("content"):
                        now = time.perf_counter()
                        if last is None:
                            acct.ttft.append(now - t0)
                        else:
                            acct.gaps.append(now - last)
                        last = now
                chunks += 1
                if abandon_after is not None and chunks >= abandon_after:
                    acct.add("stopped")
                    return  # leaving the block closes the connection mid-stream
    except asyncio.TimeoutError:
        acct.add("lost", f"stream: no end within {timeout_s:.0f}s")
        return
    except aiohttp.ClientError as e:
        acct.add("failed", f"stream: {type(e).__name__}: {e}")
        return
    if len(finished) == n and usage is not None:
        acct.tokens += usage["completion_tokens"]
        acct.add("completed")
    else:
        acct.add("lost", f"stream ended with {len(finished)}/{n} choices finished, usage {usage}")


async def _complete(session, url: str, rng: random.Random, max_tokens: int, acct: Account,
                    timeout_s: float, structured: bool) -> None:
    import aiohttp
    body = {"model": MODEL, "prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, max_tokens),
            **{k: v for k, v in sampling_mix(rng, structured).items() if k not in CHAT_ONLY}}
    try:
        async with session.post(url + "/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            if r.status in (429, 503):
                acct.add("busy")
                return
            data = await r.json(content_type=None)
    except asyncio.TimeoutError:
        acct.add("lost", f"completion: no answer within {timeout_s:.0f}s")
        return
    except (aiohttp.ClientError, ValueError) as e:
        acct.add("failed", f"completion: {type(e).__name__}: {e}")
        return
    if r.status == 200 and all(c.get("finish_reason") for c in data["choices"]) and data.get("usage"):
        acct.tokens += data["usage"]["completion_tokens"]
        acct.add("completed")
    else:
        acct.add("failed", f"completion: HTTP {r.status}: {json.dumps(data)[:200]}")


async def _bad(session, url: str, rng: random.Random, bad: list, acct: Account) -> None:
    import aiohttp
    route, what, body = rng.choice(bad)
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    try:
        async with session.post(url + route, timeout=aiohttp.ClientTimeout(total=60), **kw) as r:
            text = await r.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        acct.add("failed", f"bad request ({what}): {type(e).__name__}: {e}")
        return
    try:
        err = json.loads(text).get("error") or {}
    except ValueError:
        err = {}
    if 400 <= r.status < 500 and err.get("message") and "Traceback" not in text:
        acct.add("rejected")
    else:
        acct.add("failed", f"bad request ({what}) got HTTP {r.status}: {text[:200]}")


async def _worker(url: str, seed: int, deadline: float, max_tokens: int, bad: list, acct: Account,
                  timeout_s: float, structured: bool) -> None:
    import aiohttp
    rng = random.Random(seed)
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            kind = rng.choices(["stream", "complete", "abandon", "bad"], weights=[60, 15, 15, 10])[0]
            if kind == "stream":
                await _stream_chat(session, url, rng, max_tokens, acct, None, timeout_s, structured)
            elif kind == "abandon":
                await _stream_chat(session, url, rng, max_tokens, acct, rng.randint(1, 8), timeout_s, structured)
            elif kind == "complete":
                await _complete(session, url, rng, max_tokens, acct, timeout_s, structured)
            else:
                await _bad(session, url, rng, bad, acct)


# ---- the server's side -----------------------------------------------------------------------
def server_rss_mb() -> dict[str, float]:
    """Resident memory (MB) of the server's processes on this host, summed by title."""
    out: dict[str, float] = {}
    page = os.sysconf("SC_PAGE_SIZE")
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
            if title not in PROCESS_TITLES:
                continue
            rss = int((proc / "statm").read_text().split()[1]) * page / 2**20
        except (OSError, ValueError, IndexError):
            continue
        out[title] = out.get(title, 0.0) + rss
    return out


async def engine_gauges(url: str) -> dict[str, float]:
    """KV usage (max over ranks), running and waiting requests, from /metrics."""
    import aiohttp
    out = {"kv_usage": 0.0, "running": 0.0, "waiting": 0.0}
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=30)) as r:
            text = await r.text()
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("kestrel_kv_cache_usage_ratio"):
            out["kv_usage"] = max(out["kv_usage"], float(value))
        elif name.startswith("kestrel_num_requests_running"):
            out["running"] += float(value)
        elif name.startswith("kestrel_num_requests_waiting"):
            out["waiting"] += float(value)
    return out


async def settle(url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The gauges once no request runs or waits (abandoned streams end a step later)."""
    deadline = time.monotonic() + timeout_s
    while True:
        g = await engine_gauges(url)
        if (g["running"] == 0 and g["waiting"] == 0) or time.monotonic() > deadline:
            return g
        await asyncio.sleep(0.5)


async def soak(url: str, streams: int, seconds: float, max_tokens: int = 256, seed: int = 0,
               vocab_size: int = 49152, request_timeout_s: float = 300.0,
               rss_every_s: float = 5.0, structured: bool = False) -> dict:
    """Run the mix against `url`; returns the report (see the module doc)."""
    before = await settle(url)
    acct = Account()
    bad = bad_requests(vocab_size)
    rss: list[tuple[float, dict[str, float]]] = []
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def sample_rss() -> None:
        while True:
            rss.append((time.monotonic() - t0, server_rss_mb()))
            await asyncio.sleep(rss_every_s)

    sampler = asyncio.create_task(sample_rss())
    try:
        await asyncio.gather(*(_worker(url, seed * 1000 + i, deadline, max_tokens, bad, acct,
                                       request_timeout_s, structured) for i in range(streams)))
    finally:
        sampler.cancel()
    wall = time.monotonic() - t0
    rss.append((wall, server_rss_mb()))
    after = await settle(url)
    titles = sorted({t for _, r in rss for t in r})
    # From the first sample, and from the first one past a quarter of the run (warm-up:
    # allocator pools, first shapes): growth that keeps going shows in the second.
    warm = next((r for t, r in rss if t >= wall / 4), rss[-1][1])
    growth = {t: round(rss[-1][1].get(t, 0.0) - rss[0][1].get(t, 0.0), 1) for t in titles}
    growth_warm = {t: round(rss[-1][1].get(t, 0.0) - warm.get(t, 0.0), 1) for t in titles}
    return {"streams": streams, "seconds": wall, "requests": sum(acct.outcomes.values()),
            **acct.outcomes, "examples": acct.examples, "tokens": acct.tokens,
            "tok_s": acct.tokens / wall,
            "ttft_p50_ms": 1000 * pct(acct.ttft, 0.5), "ttft_p99_ms": 1000 * pct(acct.ttft, 0.99),
            "itl_p50_ms": 1000 * pct(acct.gaps, 0.5), "itl_p99_ms": 1000 * pct(acct.gaps, 0.99),
            "gauges_before": before, "gauges_after": after,
            "kv_returned": abs(after["kv_usage"] - before["kv_usage"]) < 1e-9
            and after["running"] == 0 and after["waiting"] == 0,
            "rss_mb": [(round(t, 1), {k: round(v, 1) for k, v in r.items()}) for t, r in rss],
            "rss_growth_mb": growth, "rss_growth_after_first_quarter_mb": growth_warm}


def healthy(report: dict) -> bool:
    return report["failed"] == 0 and report["lost"] == 0 and report["kv_returned"]


def main(argv=None) -> None:
    from benchmarks.http_bench import TINY, make_tiny_model, start_server, stop_server, wait_ready
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--url", default=None, help="a running server (else kestrel serve is started)")
    ap.add_argument("--tiny-model", action="store_true", help="a random 1-layer model on the CPU")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--structured", action="store_true",
                    help="json_schema and required-tool chats in the mix (grammar rows)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    overrides = list(args.set)
    if args.tiny_model:
        overrides = TINY + [f"model.path={make_tiny_model(tempfile.mkdtemp(prefix='kestrel-tiny-'))}"] + overrides
    proc, url = None, args.url
    if url is None:
        proc, url, log = start_server(args.config, overrides)
        print(f"kestrel serve on {url} (log: {log}) ...", file=sys.stderr, flush=True)
    try:
        asyncio.run(wait_ready(url, proc))
        print(f"soak: {args.streams} streams for {args.minutes:g} min ...", file=sys.stderr, flush=True)
        report = asyncio.run(soak(url, args.streams, 60 * args.minutes, args.max_tokens, args.seed,
                                  structured=args.structured))
    finally:
        if proc is not None:
            stop_server(proc)
    report.update(config=args.config, overrides=args.set, url=args.url)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1))
    keys = ("requests", "completed", "stopped", "rejected", "busy", "failed", "lost")
    print("| " + " | ".join(keys) + " | tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | KV back | "
          "RSS growth MB (all run; after the first quarter) |")
    print("|" + "---|" * (len(keys) + 5))
    print("| " + " | ".join(str(report[k]) for k in keys) +
          f" | {report['tok_s']:.0f} | {report['ttft_p50_ms']:.0f} / {report['ttft_p99_ms']:.0f} | "
          f"{report['itl_p50_ms']:.1f} / {report['itl_p99_ms']:.1f} | {report['kv_returned']} | "
          f"{report['rss_growth_mb']}; {report['rss_growth_after_first_quarter_mb']} |")
    for k in ("failed", "lost"):
        for ex in report["examples"][k]:
            print(f"{k}: {ex}", file=sys.stderr)
    sys.exit(0 if healthy(report) else 1)


if __name__ == "__main__":
    main()
