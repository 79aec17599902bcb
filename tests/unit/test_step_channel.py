"""The step channel and the Serve engine without Serve: an EngineCore drives a real
RankWorker through a real socket (StepServer's thread, RankChannel's asyncio end), an
EngineClient talks to the core over the front channel, and together they must produce
what the in-process engine produces; request streams detokenize and cut stop strings as
the in-process scheduler does; a failing or vanished rank, or a vanished core, fails the
requests with its message, fast."""
from __future__ import annotations

import asyncio
import socket
import time

import pytest

from actors.protocol.messages import HEADER, WIRE_VERSION, Hello, Ready, encode
from actors.protocol.step_plan import StepOutput, StepPlan
from actors.worker.step_channel import StepServer
from configs.schema import load_config
from kestrel_testing import LocalEngine
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.rank_channel import RankChannel, RankFailed
from serve_app.engine.request import SamplingParams
from serve_app.engine.request_stream import StreamFailed

pytestmark = pytest.mark.timeout(300)


def _cfg(*extra):
    return load_config(overrides=["model.dtype=float32", "kv_cache.num_slots=8192", "device=cpu",
                                  "scheduler.max_running_requests=16", "draft.enabled=false", *extra])


async def _engine(cfg, worker, tokenizer, execute=None) -> LocalEngine:
    return await LocalEngine.start(cfg, worker.info(), execute or worker, tokenizer)


async def _collect(stream):
    outs = [out async for out in stream]
    return [t for o in outs for t in o.new_token_ids], "".join(o.new_text for o in outs), outs[-1]


def test_engine_core_over_the_channels_equals_the_in_process_engine(fp32_worker, tokenizer, chat_prompts):
    cfg = _cfg()
    params = [dict(max_tokens=16, ignore_eos=True), dict(max_tokens=16, stop=["you w", "xyz"]),
              dict(max_tokens=14, temperature=0.8, seed=7), dict(max_tokens=12)]
    prompts = chat_prompts[:4]

    async def run():
        eng = await _engine(cfg, fp32_worker, tokenizer)
        streams = [eng.client.add_request(p, sp, f"r{i}") for i, (p, sp) in enumerate(zip(prompts, params))]
        results = await asyncio.gather(*(_collect(s) for s in streams))
        for _ in range(100):  # the last plan in flight comes back and is processed
            stats = await eng.client.stats()
            served = eng.server.steps
            if stats["steps"]["extend"] + stats["steps"]["decode"] == served:
                break
            await asyncio.sleep(0.02)
        assert eng.client.num_requests() == 0 and not eng.client.streams
        await eng.stop()
        return results, stats, served

    results, stats, served = asyncio.run(run())
    ref = LLMEngine(cfg, tokenizer=tokenizer, workers=[fp32_worker])
    want = ref.generate(prompts, [SamplingParams(**sp) for sp in params])
    for (ids, text, last), req in zip(results, want):
        assert ids == req.output_ids, req.rid
        assert text == req.text and last.finish_reason == req.finish_reason
        assert last.num_output_tokens == len(req.output_ids)
    assert results[1][2].finish_reason == "stop"  # cut by a stop string in the stream
    assert served == stats["steps"]["extend"] + stats["steps"]["decode"] > 0
    # Most steps were sent while another was in flight (not the first, nor the first
    # decode after the prefill).
    assert stats["steps"]["pipelined"] >= served // 2


def test_kv_is_free_again_after_requests_and_a_cancel(fp32_worker, tokenizer, chat_prompts):
    cfg = _cfg("kv_cache.prefix_caching=false")

    async def run():
        eng = await _engine(cfg, fp32_worker, tokenizer)
        free0 = (await eng.client.kv_stats())[0]["free"]
        keep = eng.client.add_request(chat_prompts[0], dict(max_tokens=8), "keep")
        gone = eng.client.add_request(chat_prompts[1], dict(max_tokens=500, ignore_eos=True), "gone")
        await gone.__anext__()  # a first output, then the consumer goes away
        gone.cancel()
        await _collect(keep)
        for _ in range(50):
            if (await eng.client.stats())["running"] == 0:
                break
            await asyncio.sleep(0.02)
        free1 = (await eng.client.kv_stats())[0]["free"]
        await eng.stop()
        return free0, free1

    free0, free1 = asyncio.run(run())
    assert free1 == free0


def test_a_failing_step_fails_the_rank_with_its_message(fp32_worker, tokenizer, chat_prompts):
    cfg = _cfg()
    calls = []

    def execute(plan):
        calls.append(plan.mode)
        if plan.mode == "decode":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return fp32_worker.execute(plan)

    async def run():
        eng = await _engine(cfg, fp32_worker, tokenizer, execute)
        stream = eng.client.add_request(chat_prompts[0], dict(max_tokens=8), "a")
        with pytest.raises(StreamFailed, match="illegal memory access") as failed:
            await _collect(stream)
        # Clients see this message: the actor's traceback and exception class stay in logs.
        assert "Traceback" not in str(failed.value) and "RuntimeError" not in str(failed.value)
        with pytest.raises(RuntimeError, match="rank 0 failed"):
            await eng.client.check_health()
        await eng.stop()

    asyncio.run(run())
    assert "decode" in calls


def test_a_vanished_core_fails_the_streams_at_once(fp32_worker, tokenizer, chat_prompts):
    async def run():
        eng = await _engine(_cfg(), fp32_worker, tokenizer)
        stream = eng.client.add_request(chat_prompts[0], dict(max_tokens=400, ignore_eos=True), "a")
        await stream.__anext__()
        eng.core.writer.transport.abort()  # the core's process dies: its sockets close
        t0 = time.monotonic()
        with pytest.raises(StreamFailed, match="engine core closed its channel"):
            await _collect(stream)
        assert time.monotonic() - t0 < 5
        with pytest.raises(Exception, match="engine core"):
            eng.client.add_request(chat_prompts[0], dict(max_tokens=4), "b")
        await eng.stop()

    asyncio.run(run())


def test_a_vanished_actor_is_seen_at_once():
    """An actor process that dies closes its sockets: the engine's next recv fails at once
    with the rank's number, however long the running step would have taken."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))

    def actor_that_dies():
        conn, _ = listener.accept()
        conn.recv(1 << 16)  # the hello
        conn.sendall(encode(Ready()))
        conn.recv(1 << 16)  # a plan arrives; the process dies before answering
        conn.close()

    threading.Thread(target=actor_that_dies, daemon=True).start()

    async def run():
        channel = await RankChannel.connect(*listener.getsockname(), "token", 3)
        channel.send(StepPlan(1, "decode", [1]))
        with pytest.raises(RankFailed, match="rank 3 closed its step channel"):
            await asyncio.wait_for(channel.recv(), 5)

    asyncio.run(run())


def _refused_before_any_unpickling(server: StepServer, hello: bytes) -> None:
    """`hello`, then a frame that would run code when unpickled: the server closes the
    connection without an answer, and nothing ran."""
    unpickled = []

    class Bomb:
        def __reduce__(self):
            return (unpickled.append, ("ran",))

    with socket.create_connection(server.address) as s:
        s.settimeout(5)
        try:  # one write: the reset may come as soon as the wrong hello is read
            s.sendall(hello + encode(Bomb()))
            answer = s.recv(HEADER.size)
        except ConnectionResetError:  # closed with our frames unread
            answer = b""
        assert answer == b""  # closed without an answer
    assert unpickled == []


def test_a_connection_without_the_token_is_refused_before_any_unpickling():
    server = StepServer(lambda plan: StepOutput(plan.step_id, [[7] for _ in plan.rows]))
    _refused_before_any_unpickling(server, encode(Hello("not-the-token")))

    async def honest():  # the actor still serves the engine that has the token
        channel = await RankChannel.connect(*server.address, server.token, 0)
        channel.send(StepPlan(1, "decode", [1, 2]))
        return (await asyncio.wait_for(channel.recv(), 5)).tokens

    assert asyncio.run(honest()) == [[7], [7]]
    server.close()


def test_a_peer_of_another_wire_version_is_refused_before_any_unpickling():
    """Even with the right token: an engine built from other code must not be served."""
    server = StepServer(lambda plan: StepOutput(plan.step_id, [[7] for _ in plan.rows]))
    hello = encode(Hello(server.token))
    _refused_before_any_unpickling(server, HEADER.pack(WIRE_VERSION + 1, len(hello) - HEADER.size)
                                   + hello[HEADER.size:])
    server.close()


class QueueingDevice:
    """A stand-in for a GPU's stream (the CPU runs every step to the end at launch): a
    launched step runs for `step_s` once the steps before it have run; `ready` says whether
    it has, `finish` waits for it. The real device: tests/gpu/test_step_channel_gpu.py."""

    def __init__(self, step_s: float):
        self.step_s, self.free_at = step_s, 0.0
        self.launches: list[tuple[int, float, float]] = []  # (step, launched at, previous end)
        self.finished: list[int] = []

    def launch(self, plan):
        now = time.monotonic()
        previous_end, self.free_at = self.free_at, max(now, self.free_at) + self.step_s
        self.launches.append((plan.step_id, now, previous_end))
        return plan, self.free_at

    def ready(self, launched) -> bool:
        return time.monotonic() >= launched[1]

    def finish(self, launched):
        plan, end = launched
        time.sleep(max(0.0, end - time.monotonic()))
        self.finished.append(plan.step_id)
        return StepOutput(plan.step_id, [[plan.step_id] for _ in plan.rows])


def test_the_next_step_is_launched_behind_the_running_one():
    device = QueueingDevice(step_s=0.05)

    class Runner:  # launched steps answer `ready()` themselves, as LaunchedStep does
        def launch(self, plan):
            launched = device.launch(plan)
            return type("Launched", (), {"ready": lambda _: device.ready(launched), "item": launched})()

        def finish(self, launched):
            return device.finish(launched.item)

    server = StepServer(Runner())
    modes = ["decode"] * 4 + ["extend"] + ["decode"] * 3

    async def engine():  # as EngineCore: two plans in flight, the next sent after each answer
        channel = await RankChannel.connect(*server.address, server.token, 0)
        sent, outs = 0, []
        for _ in range(2):
            sent += 1
            channel.send(StepPlan(sent, modes[sent - 1], [sent]))
        while len(outs) < len(modes):
            outs.append(await asyncio.wait_for(channel.recv(), 5))
            if sent < len(modes):
                sent += 1
                channel.send(StepPlan(sent, modes[sent - 1], [sent]))
        channel.close()
        return outs

    outs = asyncio.run(engine())
    server.close()
    assert [o.step_id for o in outs] == list(range(1, 9)) and [o.tokens for o in outs] == [[[i]] for i in range(1, 9)]
    launched_at = {step: (at, prev_end) for step, at, prev_end in device.launches}
    # Each step after the first was on the device before the one ahead of it had ended
    # (a prefill too: no plan waits for the tokens before it on the channel).
    queued = [s for s in range(2, 9) if launched_at[s][0] < launched_at[s][1]]
    assert len(queued) >= 6, device.launches
    assert device.finished == list(range(1, 9))
