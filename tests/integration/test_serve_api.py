"""The Serve app end to end: real Ray + Serve on CPU, real SmolLM2 (fp32), real HTTP and
the official `openai` client. All tests share the session server of conftest.py."""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
from kestrel_testing import mt_bench_first_turns
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]
MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}  # extension field: fixed lengths make counts exact


mt_bench = mt_bench_first_turns


def assert_error_body(r: httpx.Response, status: int | tuple[int, ...]) -> dict:
    statuses = status if isinstance(status, tuple) else (status,)
    assert r.status_code in statuses, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert set(err) >= {"message", "type", "param", "code"}
    return err


# ---------------------------------------------------------------------------- basics


def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(server.base_url + "/health", timeout=30)
    assert r.status_code == 200
    r = httpx.get(server.base_url + "/metrics", timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "kestrel_kv_cache_usage_ratio" in r.text
    assert "kestrel_num_requests_running" in r.text


def test_serving_processes_run_at_the_configured_niceness(server):
    """Ray starts workers at nice 15 unless told otherwise (serve.ray_worker_niceness):
    the replica, its engine core and the rank actor must run at the configured value."""
    import pathlib
    titles = ("ray::RankActor", "ray::EngineCoreActor", "ray::ServeReplica:kestrel:EngineDeployment")
    seen = set()
    for proc in pathlib.Path("/proc").glob("[0-9]*"):
        try:
            title = (proc / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace").strip()
            stat = (proc / "stat").read_text()
        except OSError:  # the process ended while we looked
            continue
        if title in titles:
            # The nice value is the 19th field of /proc/<pid>/stat; the name, the 2nd, is
            # parenthesized and may hold spaces.
            assert int(stat.rsplit(")", 1)[1].split()[16]) == server.cfg.serve.ray_worker_niceness, title
            seen.add(title)
    assert seen == set(titles)


def test_serving_processes_freeze_their_heap(server):
    """serve.gc_freeze: the replica, its engine core and each rank freeze what start-up
    left alive, so the collector's full passes do not walk it while streams wait; the
    steps report the passes that remain as their `gc` phase."""
    st = server.engine().gc_stats.remote().result(timeout_s=30)
    # A started rank holds some 300,000 tracked objects (torch, the model, Ray).
    assert st["ranks"][0]["frozen"] > 100_000, st
    assert st["core"]["frozen"] > 10_000 and st["replica"]["frozen"] > 10_000, st
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    assert 'kestrel_engine_step_seconds_total{' in text and 'phase="gc"' in text


def test_ranks_hold_the_grammar_vocabulary_from_start_up(server, tokenizer):
    """The replica sends xgrammar's view of the tokenizer to each rank while starting, so
    the first request with a grammar does not build it in a step that every stream of
    the rank waits for (1.4-2 s on the H200 with xgrammar's import, now at start-up too)."""
    import ray
    replica = server.engine().stats.remote().result(timeout_s=30)["replica"]
    rank = ray.get_actor(f"kestrel-{replica}-rank0", namespace="kestrel")
    assert ray.get(rank.grammar_vocab_size.remote(), timeout=30) >= len(tokenizer)


def test_chat_usage_and_stream_equals_non_stream(client, tokenizer):
    from serve_app.text.tokenizer import apply_chat_template
    messages = [{"role": "user", "content": "Name three colours."}]
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                          extra_body=IGNORE_EOS, **GREEDY)
    choice = resp.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant" and choice.message.content
    assert resp.usage.prompt_tokens == len(apply_chat_template(tokenizer, messages))
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert resp.id.startswith("chatcmpl-") and resp.model == MODEL

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body=IGNORE_EOS, **GREEDY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_cached_prompt_tokens_in_usage(client, tokenizer):
    """usage.prompt_tokens_details.cached_tokens: what the prefix cache held of a prompt sent
    before (of a new one at most the chat template's shared start), in streamed usage too."""
    from serve_app.text.tokenizer import apply_chat_template
    messages = [{"role": "user", "content": "Cached tokens: a prompt long enough to fill " * 6}]
    n = len(apply_chat_template(tokenizer, messages))
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **GREEDY)
    before = first.usage.prompt_tokens_details.cached_tokens
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert before < n // 2 and n - 16 < cached < n, (n, before, cached)  # the last is computed
    stream = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    assert stream[-1].usage.prompt_tokens_details.cached_tokens == cached


def test_completion_usage_and_stream_equals_non_stream(client, tokenizer):
    prompt = "The three primary colours are"
    resp = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10,
                                     extra_body=IGNORE_EOS, **GREEDY)
    assert resp.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert resp.usage.completion_tokens == 10
    assert resp.choices[0].finish_reason == "length"
    text = resp.choices[0].text
    assert text

    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, stream=True,
                                       extra_body=IGNORE_EOS, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk

    # A token-id prompt is the same request.
    resp_ids = client.completions.create(model=MODEL, prompt=tokenizer.encode(prompt),
                                         max_tokens=10, extra_body=IGNORE_EOS, **GREEDY)
    assert resp_ids.choices[0].text == text


def test_stop_strings(client):
    messages = [{"role": "user", "content": "Write one sentence about the sea."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          extra_body=IGNORE_EOS, **GREEDY).choices[0].message.content
    words = full.split()
    assert len(words) >= 6, full
    stop = words[3]
    expected = full[:full.index(stop)]

    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                          stop=[stop, "never-appears"], **GREEDY)
    assert resp.choices[0].message.content == expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 24

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                            stop=stop, stream=True, **GREEDY)
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n_choices_seeded(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, temperature=1.0,
              seed=1234, extra_body=IGNORE_EOS)
    a = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert a.usage.completion_tokens == 24
    b = client.completions.create(**kw)
    texts_a = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    texts_b = [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert texts_a == texts_b  # seeded: reproducible
    assert len(set(texts_a)) > 1  # seed, seed+1, seed+2: the samples differ

    chunks = list(client.completions.create(stream=True, **kw))
    streamed = {i: "" for i in range(3)}
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert [streamed[i] for i in range(3)] == texts_a


# ---------------------------------------------------------------------------- exactness


def test_concurrent_streams_equal_in_process_engine(server, tokenizer, fp32_worker):
    """12 concurrent streamed greedy chats through HTTP produce exactly what the in-process
    LLMEngine produces for the same prompts (same tokenizer, template and detokenizer)."""
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template
    server.wait_idle()
    questions = mt_bench(12)
    max_tokens = 16

    async def one(client, q):
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=max_tokens,
            stream=True, stream_options={"include_usage": True}, **GREEDY)
        text, usage, finish = "", None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
        return text, usage.completion_tokens, finish

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=180)
        async with client:
            return await asyncio.gather(*(one(client, q) for q in questions))

    t0 = time.monotonic()
    served = asyncio.run(run_all())
    elapsed = time.monotonic() - t0

    engine = LLMEngine(server.cfg, tokenizer=tokenizer, workers=[fp32_worker])
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    reqs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens))
    expected = [(r.text, len(r.output_ids), r.finish_reason) for r in reqs]
    mismatches = [i for i, (s, e) in enumerate(zip(served, expected)) if s != e]
    assert not mismatches, [(served[i], expected[i]) for i in mismatches]
    print(f"12 concurrent streams in {elapsed:.1f}s")


def test_penalized_streams_equal_the_plain_in_process_engine(server, tokenizer, fp32_worker):
    """Penalties and a bias through HTTP (the served preset speculates) give, greedy, the
    tokens the plain in-process engine gives with the same processing."""
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template
    server.wait_idle()
    questions = mt_bench(4)
    pen = {"presence_penalty": 0.8, "frequency_penalty": 0.4, "logit_bias": {"30": -100}}
    vllm = {"repetition_penalty": 1.3, "min_tokens": 20, **IGNORE_EOS}

    async def run_all():
        client = openai.AsyncOpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=180)
        async with client:
            return await asyncio.gather(*(client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": q}], max_tokens=24,
                extra_body=vllm, **pen, **GREEDY) for q in questions))

    served = [r.choices[0].message.content for r in asyncio.run(run_all())]
    engine = LLMEngine(server.cfg, tokenizer=tokenizer, workers=[fp32_worker])
    prompts = [apply_chat_template(tokenizer, [{"role": "user", "content": q}]) for q in questions]
    params = SamplingParams(max_tokens=24, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.4,
                            logit_bias={30: -100.0}, repetition_penalty=1.3, min_tokens=20)
    expected = [r.text for r in engine.generate(prompts, params)]
    assert served == expected  # (that the processing changes answers: the unit tests)


def test_logprobs_over_http_equal_the_plain_in_process_engine(server, tokenizer, fp32_worker):
    """Chat logprobs through HTTP (the served preset speculates: accepted tokens' logprobs
    come from their tree nodes) equal the plain in-process engine's, token for token."""
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template
    server.wait_idle()
    q = mt_bench(1)[0]
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=180)
    resp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": q}],
                                          max_tokens=16, logprobs=True, top_logprobs=3,
                                          extra_body=IGNORE_EOS, **GREEDY)
    content = resp.choices[0].logprobs.content
    engine = LLMEngine(server.cfg, tokenizer=tokenizer, workers=[fp32_worker])
    prompt = apply_chat_template(tokenizer, [{"role": "user", "content": q}])
    ref = engine.generate([prompt], SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3))[0]
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ref.output_ids]
    for c, (lp, ids, lps) in zip(content, ref.token_logprobs):
        assert abs(c.logprob - lp) < 1e-4
        assert [t.token for t in c.top_logprobs] == [tokenizer.decode([i]) for i in ids]
        assert all(abs(t.logprob - v) < 1e-4 for t, v in zip(c.top_logprobs, lps))


def test_echo_and_prompt_logprobs_over_http(server, tokenizer, fp32_worker):
    """Completions' echo (the prompt first in the text and in the logprobs, its first token
    without one) and vLLM's prompt_logprobs, streamed and not, with the official client:
    the values equal the plain in-process engine's, and a second request finds the same
    prompt in the prefix cache yet still gets every prompt logprob."""
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    server.wait_idle()
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = tokenizer.encode(prompt)
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=180)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=4, logprobs=2, echo=True,
              extra_body={**IGNORE_EOS, "prompt_logprobs": 1}, **GREEDY)
    full = client.completions.create(**kw).choices[0]
    engine = LLMEngine(server.cfg, tokenizer=tokenizer, workers=[fp32_worker])
    ref = engine.generate([ids], SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2,
                                                prompt_logprobs=2))[0]
    assert full.text == prompt + tokenizer.decode(ref.output_ids)
    lp = full.logprobs
    assert len(lp.tokens) == len(ids) + 4 and lp.tokens[:len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = [e[0] for e in ref.prompt_logprobs] + [e[0] for e in ref.token_logprobs]
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1:], want)), (lp.token_logprobs, want)
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset[len(ids)] == len(prompt)  # the completion's first token, after the prompt
    plp = full.model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for t, entry, (v, top_ids, _, rank) in zip(ids[1:], plp[1:], ref.prompt_logprobs):
        assert abs(entry[str(t)]["logprob"] - v) < 1e-4 and entry[str(t)]["rank"] == rank
        assert str(top_ids[0]) in entry and entry[str(top_ids[0])]["rank"] == 1
    # Streamed: the prompt comes first, with its logprobs; the whole equals the above.
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw) if c.choices]
    assert chunks[0].text == prompt
    assert "".join(c.text for c in chunks) == full.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and all(abs(a - b) < 1e-4 for a, b in zip(streamed[1:], lp.token_logprobs[1:]))
    assert chunks[0].model_extra["prompt_logprobs"] == plp
    # Bad values are 400s that name the field; chat does not serve prompt_logprobs.
    for bad in ({"prompt_logprobs": 21}, {"prompt_logprobs": True}):
        with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=bad)
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=1, extra_body={"prompt_logprobs": 1})


def test_bad_words_over_http_equal_the_plain_in_process_engine(server, tokenizer, fp32_worker):
    """vLLM's bad_words through the served (speculating) app: a word of the free answer is
    gone from the answer, which equals the plain in-process engine's with the same token
    sequences (the word with and without a leading space), streamed and not."""
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    server.wait_idle()
    prompt = "List the days of the week: Monday, Tuesday,"
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=180)
    kw = dict(model=MODEL, prompt=prompt, max_tokens=16, **GREEDY)
    free = client.completions.create(extra_body=IGNORE_EOS, **kw).choices[0].text
    word = next(w for w in free.replace(",", " ").split() if len(w) > 3)
    got = client.completions.create(extra_body={**IGNORE_EOS, "bad_words": [word]}, **kw).choices[0].text
    assert word in free and word not in got, (free, got)
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in (word, " " + word)]
    engine = LLMEngine(server.cfg, tokenizer=tokenizer, workers=[fp32_worker])
    ref = engine.generate([tokenizer.encode(prompt)],
                          SamplingParams(max_tokens=16, ignore_eos=True, bad_words=seqs))[0]
    assert got == tokenizer.decode(ref.output_ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        stream=True, extra_body={**IGNORE_EOS, "bad_words": [word]}, **kw) if c.choices)
    assert streamed == got
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1,
                                  extra_body={"bad_words": ["word " * 40]})


# ---------------------------------------------------------------------------- robustness


def test_client_disconnect_frees_kv(server):
    server.wait_idle()
    baseline = server.kv_stats()
    body = {"model": MODEL, "prompt": "Tell me a very long story about a lighthouse.",
            "max_tokens": 400, "stream": True, "ignore_eos": True, **GREEDY}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", server.v1 + "/completions", json=body) as r:
            assert r.status_code == 200
            # Keep a reference to the iterator: a dropped httpx iterator closes the
            # connection, which would be the disconnect already.
            lines = r.iter_lines()
            seen = 0
            for line in lines:
                seen += line.startswith("data: {")
                if seen >= 3:
                    break
            assert server.num_running() == 1
            held = server.kv_stats()
            assert held[0]["free"] < baseline[0]["free"]
        # Leaving the block closes the connection mid-stream.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.num_running() == 0 and server.kv_stats() == baseline:
            break
        time.sleep(0.1)
    assert server.num_running() == 0
    assert server.kv_stats() == baseline
    print(f"KV back to baseline {10 - (deadline - time.monotonic()):.2f}s after the disconnect")


BAD_REQUESTS = [
    # (name, path, body (dict -> JSON, bytes -> raw), status, param)
    ("missing messages", "/chat/completions", {"model": MODEL}, 400, "messages"),
    ("missing prompt", "/completions", {"model": MODEL, "max_tokens": 4}, 400, "prompt"),
    ("messages wrong type", "/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("max_tokens wrong type", "/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens -1", "/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("temperature 10", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "temperature": 10}, 400, "temperature"),
    ("top_p 0", "/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("n too large", "/completions", {"prompt": "x", "n": 1000}, 400, "n"),
    # 21 sequences, beyond the test server's 16 running + 4 queued: no wait would admit it.
    ("prompts x n beyond the engine", "/completions", {"prompt": ["x"] * 3, "n": 7}, 400, "n"),
    ("bad role", "/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("unknown model", "/chat/completions",
     {"model": "gpt-17", "messages": [{"role": "user", "content": "hi"}]}, 404, "model"),
    ("1 MB of garbage", "/chat/completions", b"\x00\xffgarbage{" * (1 << 17), 400, None),
    ("not an object", "/completions", b"[1, 2, 3]", 400, None),
    ("empty body", "/completions", b"", 400, None),
    ("prompt too long", "/completions", {"prompt": [1] * 3000, "max_tokens": 1}, 400, "prompt"),
    ("token id outside vocab", "/completions", {"prompt": [10 ** 9], "max_tokens": 1}, 400, "prompt"),
    ("top_logprobs without logprobs", "/chat/completions",
     {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, 400, "top_logprobs"),
]


def test_bad_requests_get_openai_errors_and_server_keeps_serving(server, client):
    with httpx.Client(base_url=server.v1, timeout=60) as http:
        for name, path, body, status, param in BAD_REQUESTS:
            if isinstance(body, bytes):
                r = http.post(path, content=body, headers={"content-type": "application/json"})
            else:
                r = http.post(path, json=body)
            err = assert_error_body(r, status)
            if param is not None:
                assert err["param"] == param, (name, err)
        assert_error_body(http.get("/no/such/route"), 404)
        assert_error_body(http.get("/chat/completions"), 405)
        r = http.post("/completions", json={"prompt": "1 MB prompt " * 90000, "max_tokens": 1})
        assert_error_body(r, 400)

    # The official client sees the matching exception classes.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                       max_tokens=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    # And it still serves.
    resp = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, **GREEDY)
    assert resp.choices[0].text
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200


def test_backpressure_burst_gets_503_and_accepted_requests_finish(server):
    """max_queued_requests=4 and max_running_requests=16: a burst of 40 fills the replica;
    the overflow is answered 503 (OpenAI body, Retry-After) and the rest complete."""
    server.wait_idle()
    # The burst is all in within tens of ms; 8 tokens keep the first 16 busy for seconds.
    n, max_tokens = 40, 8

    async def burst():
        limits = httpx.Limits(max_connections=n)
        async with httpx.AsyncClient(base_url=server.v1, timeout=180, limits=limits) as http:
            return await asyncio.gather(*(
                http.post("/completions", json={"model": MODEL, "prompt": f"Count to {i}:",
                                                "max_tokens": max_tokens, "ignore_eos": True,
                                                **GREEDY})
                for i in range(n)))

    t0 = time.monotonic()
    responses = asyncio.run(burst())
    elapsed = time.monotonic() - t0
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code != 200]
    for r in rejected:
        err = assert_error_body(r, 503)
        assert err["type"] == "overloaded_error"
        assert r.headers.get("retry-after") == str(server.cfg.serve.retry_after_s)
    for r in ok:
        assert r.json()["usage"]["completion_tokens"] == max_tokens
    assert rejected, "the burst never overflowed the queue"
    assert len(ok) >= server.cfg.scheduler.max_running_requests
    print(f"burst of {n}: {len(ok)} served, {len(rejected)} rejected in {elapsed:.1f}s")
    server.wait_idle()
    r = httpx.post(server.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200


def test_metrics_after_traffic(server):
    text = httpx.get(server.base_url + "/metrics", timeout=30).text
    for name in ("kestrel_requests_total", "kestrel_time_to_first_token_seconds_count",
                 "kestrel_inter_token_latency_seconds_count", "kestrel_e2e_request_latency_seconds_count",
                 "kestrel_generation_tokens_total", "kestrel_prompt_tokens_total",
                 "kestrel_num_requests_waiting", "kestrel_kv_cache_usage_ratio"):
        assert name in text, name
    assert 'endpoint="/v1/completions"' in text and 'status="200"' in text

    def value(prefix: str) -> float:
        line = next(line for line in text.splitlines() if line.startswith(prefix))
        return float(line.rsplit(" ", 1)[1])
    assert value("kestrel_generation_tokens_total") > 0
    assert value("kestrel_num_requests_running") == 0


# ---------------------------------------------------------------------------- structured outputs

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 20},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150}}}


def test_structured_outputs_over_http(server):
    """response_format (json_schema, json_object) on chat, vLLM's structured_outputs and
    guided_* on completions; streamed equals not; n > 1 sampled; every finished output
    valid; bad constraints are 400s naming the field."""
    import json

    import jsonschema
    server.wait_idle()
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=180)
    msgs = [{"role": "user", "content": "Invent a person. Reply with JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    kw = dict(model=MODEL, messages=msgs, max_tokens=48, response_format=fmt)
    whole = client.chat.completions.create(**kw, **GREEDY).choices[0]
    assert whole.finish_reason == "stop", whole
    jsonschema.validate(json.loads(whole.message.content), PERSON)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        stream=True, **kw, **GREEDY) if c.choices)
    assert streamed == whole.message.content
    sampled = client.chat.completions.create(**kw, n=2, temperature=1.0, seed=5).choices
    for c in sampled:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.message.content), PERSON)
    assert any(c.finish_reason == "stop" for c in sampled)
    # Greedy, the model's object runs past 48 tokens too: 16 show the grammar's start.
    obj = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, **GREEDY,
                                         response_format={"type": "json_object"}).choices[0]
    assert obj.message.content.lstrip().startswith("{"), obj
    assert obj.finish_reason != "stop" or isinstance(json.loads(obj.message.content), dict)

    def completion(extra, **more):
        return client.completions.create(model=MODEL, prompt="The answer is", max_tokens=16,
                                         extra_body=extra, **GREEDY, **more).choices[0]
    assert completion({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}).text in {"yes", "no", "maybe"}
    assert completion({"guided_choice": ["red", "blue"]}).text in {"red", "blue"}
    digits = completion({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{2}"}})
    assert digits.finish_reason == "stop" and len(digits.text) == 6 and digits.text[3] == "-", digits
    age = completion({"guided_json": {"type": "integer", "minimum": 1, "maximum": 99}})
    assert age.finish_reason != "stop" or 1 <= json.loads(age.text) <= 99

    for extra, param in [({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
            ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
            ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
            ({"guided_grammar": "root ::= "}, "guided_grammar")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body=extra)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.BadRequestError, match="at most one output constraint"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, extra_body={
            "guided_regex": "a", "structured_outputs": {"choice": ["b"]}})


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 30}}}}}


def test_tool_calls_over_http(server):
    """tool_choice required and named through the real model: the answer is a call of the
    tool with arguments valid for its schema, streamed and not (streamed: the call whole in
    one delta, then finish_reason tool_calls); a history with the call and its result is
    served; bad tool_choice values are 400s."""
    import json

    import jsonschema
    server.wait_idle()
    client = openai.OpenAI(base_url=server.v1, api_key="x", max_retries=0, timeout=180)
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    params = WEATHER_TOOL["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        kw = dict(model=MODEL, messages=msgs, max_tokens=48, tools=[WEATHER_TOOL], tool_choice=choice, **GREEDY)
        got = client.chat.completions.create(**kw).choices[0]
        assert got.finish_reason == "tool_calls", got
        call = got.message.tool_calls[0]
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), params)
        if choice != "required":
            continue  # streamed once: the two share the stream's code
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
        deltas = [tc for c in chunks for tc in (c.delta.tool_calls or [])]
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
            (0, "get_weather", call.function.arguments)]
        assert chunks[-1].finish_reason == "tool_calls"
    history = [*msgs, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"}]
    answer = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4,
                                            tools=[WEATHER_TOOL], **GREEDY).choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    for bad in ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": [WEATHER_TOOL]},
                {"tool_choice": "required"},
                {"tool_choice": "required", "tools": [WEATHER_TOOL], "response_format": {"type": "json_object"}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, **bad)
