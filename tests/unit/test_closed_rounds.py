"""Closed levels with rounds (http_bench --rounds): c streams, each sending its requests one
after another, against a real HTTP server that streams a few chunks per request and records
when each request came and went. The client runs in this process and, split over client
processes, as the H200 runs use it."""
import asyncio
import json
import threading
import time

import pytest
from aiohttp import web

from benchmarks.http_client import run_level, stream_questions


class Recorder:
    """A streamed chat endpoint: one chunk per max_tokens, 20 ms apart; logs (question, start,
    end) of each measured request, the questions of the 4-token warm-ups, and the most
    requests in flight at once."""

    def __init__(self):
        self.log, self.warmed, self.inflight, self.most = [], [], 0, 0
        self.lock = threading.Lock()

    async def chat(self, request):
        body = await request.json()
        q = body["messages"][-1]["content"]
        with self.lock:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        start = time.monotonic()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for _ in range(n):
            await asyncio.sleep(0.02)
            await resp.write(b"data: " + json.dumps({"choices": [{"delta": {"content": "x"}}]}).encode() + b"\n\n")
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n}}).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        with self.lock:
            self.inflight -= 1
            if n > 4:  # not a warm-up request
                self.log.append((q, start, time.monotonic()))
            else:
                self.warmed.append(q)
        return resp


@pytest.fixture
def server():
    rec = Recorder()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", rec.chat)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", rec
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    loop.close()


def test_stream_questions_take_the_next_c_prompts_each_round():
    qs = [f"q{i}" for i in range(10)]
    assert stream_questions(qs, 3, 3) == [["q0", "q3", "q6"], ["q1", "q4", "q7"], ["q2", "q5", "q8"]]
    assert stream_questions(qs, 4, 3)[3] == ["q3", "q7", "q1"]  # past the list: round it


@pytest.mark.parametrize("streams_per_client", [16, 2])  # one client process; two, as c > 16 runs
def test_each_stream_sends_its_rounds_one_after_another(server, streams_per_client):
    url, rec = server
    qs = [f"q{i}" for i in range(12)]
    lv = asyncio.run(run_level(url, "m", qs, concurrency=4, max_tokens=6, c1_prompts=1,
                               streams_per_client=streams_per_client, rounds=3))
    assert lv["requests"] == 12 and lv["tokens"] == 72 and lv["rounds"] == 3
    assert lv["client_processes"] == (1 if streams_per_client == 16 else 2)
    assert sorted(q for q, _, _ in rec.log) == sorted(qs)
    assert rec.most <= 4  # never more than the level's streams at once
    by_q = {q: (s, e) for q, s, e in rec.log}
    for stream in stream_questions(qs, 4, 3):  # a stream's next request only after its last ended
        for a, b in zip(stream, stream[1:]):
            assert by_q[b][0] >= by_q[a][1] - 1e-3
    # the level lasts the three rounds: about 3 x 6 x 20 ms, not one round's 120 ms
    assert lv["seconds"] >= 3 * 6 * 0.02


def test_one_round_is_the_burst_it_was(server):
    url, rec = server
    lv = asyncio.run(run_level(url, "m", [f"q{i}" for i in range(8)], concurrency=8, max_tokens=6, c1_prompts=1))
    assert lv["requests"] == 8 and lv["rounds"] == 1 and rec.most == 8


def test_a_level_warmed_with_requests_of_its_own_measures_all_of_its_prompts_cold(server):
    """By default a one-stream level warms up with its first prompt, which a prefix cache
    then serves at once when it is measured (http_bench's long prompts, docs/benchmarks.md);
    `warmup` sends others."""
    url, rec = server
    asyncio.run(run_level(url, "m", ["q0", "q1"], concurrency=1, max_tokens=6, c1_prompts=2))
    assert rec.warmed == ["q0"]
    rec.warmed.clear()
    lv = asyncio.run(run_level(url, "m", ["q0", "q1"], concurrency=1, max_tokens=6, c1_prompts=2,
                               warmup=["w"]))
    assert rec.warmed == ["w"] and lv["requests"] == 2
