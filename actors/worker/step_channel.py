"""The step channel, RankActor side: plans in, step outputs out, over one TCP connection.

A Ray actor call per step cost about 1 ms round trip on the H200 host (a Ray Compiled
Graph 0.25-0.4 ms, this channel 0.17-0.19 ms on the development machine:
benchmarks/channel_bench.py), and its deserialization and bookkeeping ran on the actor's
thread between GPU steps. Here the engine core writes each plan to a socket as soon as
it is scheduled (step N+1 while N runs), and the actor's channel thread launches it on
the device behind step N before N has finished (RankWorker.launch: nothing in a plain or
greedy speculative step waits for the device; a step with grammar rows waits for N's
tokens only where it makes its masks, with its forward queued: actors/sampling/grammar_rows.py),
so the GPU goes from one step to the next without waiting for the host to read N's
tokens, send them, and read and prepare N+1. Each output goes back as one small
frame as soon as the device has produced it. A dead actor closes the connection, which
the engine sees at once.

Frames and messages: actors/protocol/messages.py. The first frame on a connection must be
the engine's Hello with the secret this actor returned through Ray's own authenticated
channel; nothing is unpickled before it matched. The socket binds to loopback when the
engine runs on the same node (the placement group's STRICT_PACK makes that the normal
case).
"""
from __future__ import annotations

import hmac
import logging
import secrets
import select
import socket
import threading
import time
import traceback
from collections import deque
from typing import Any, Callable, Protocol

from actors.protocol.messages import (HEADER, RANK_RECEIVES, Hello, Ready, StepFailed,
                                      WireError, body_length, decode, encode)
from actors.protocol.step_plan import StepOutput, StepPlan
from configs.schema import MAX_STEPS_IN_FLIGHT

log = logging.getLogger("kestrel.step_channel")

# Steps launched and not yet answered: as many as the engine keeps in flight.
MAX_LAUNCHED = MAX_STEPS_IN_FLIGHT
POLL_S = 0.0001  # while one step runs and no plan is there, how often to look at both


def _read_exact(conn: socket.socket, n: int) -> bytes | None:
    """n bytes, or None when the peer closed the connection."""
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


class StepRunner(Protocol):
    """What runs the plans (RankWorker): `launch` queues a step without waiting for the
    device, `finish` waits for its output; steps finish in launch order."""

    def launch(self, plan: StepPlan) -> Any: ...

    def finish(self, launched: Any) -> StepOutput: ...


class _Finished:
    def __init__(self, out: StepOutput):
        self.out = out

    def ready(self) -> bool:
        return True


class RunEach:
    """A plain `execute(plan) -> StepOutput` as a StepRunner whose steps finish as they are
    launched (tests, the control-plane benchmark)."""

    def __init__(self, execute: Callable[[StepPlan], StepOutput]):
        self.execute = execute

    def launch(self, plan: StepPlan) -> _Finished:
        return _Finished(self.execute(plan))

    def finish(self, launched: _Finished) -> StepOutput:
        return launched.out


class StepServer:
    """Serves one engine connection at a time: launches its plans in order on `runner`
    (a StepRunner, or a plain execute callable) and answers each with its output.

    Each output's `timings` gains `wait` (seconds the channel sat idle, with nothing
    launched, before the plan arrived: the device waited on the control plane, or had no
    work) and `recv` (reading and unpickling it)."""

    def __init__(self, runner: StepRunner | Callable[[StepPlan], StepOutput], host: str = "127.0.0.1",
                 on_start: Callable[[], None] | None = None):
        self.runner = runner if hasattr(runner, "launch") else RunEach(runner)
        self.on_start = on_start  # run once on the channel thread (e.g. bind the CUDA device)
        self.token = secrets.token_hex(16)
        self.sock = socket.create_server((host, 0))
        self.address = (host, self.sock.getsockname()[1])
        self.steps = 0
        self.serving = False  # an engine is connected (its queued steps may still run)
        self.closed = False
        self.thread = threading.Thread(target=self._serve, name="kestrel-step-channel", daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Accept no more engines and end the thread (after the connected engine, if any,
        has closed its channel). A rank's process ends it by ending; a process that starts
        many servers (tests) closes each, since a live thread that ran torch ops keeps the
        process's own torch ops on one core."""
        self.closed = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() below
        except OSError:
            pass
        self.sock.close()
        if not self.serving:
            self.thread.join(timeout=10)

    def _serve(self) -> None:
        try:
            if self.on_start is not None:
                self.on_start()
        except BaseException:
            # Refuse the engine's connection rather than leave it waiting for a hello.
            log.exception("step channel: could not start; closing it")
            self.sock.close()
            raise
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self.closed:
                    return
                raise
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.serving = True
            try:
                self._run(conn)
            except OSError as e:
                log.warning("step channel to %s closed: %s", peer, e)
            finally:
                conn.close()
                self.serving = False

    def _hello(self, conn: socket.socket) -> bool:
        header = _read_exact(conn, HEADER.size)
        if header is None:
            return False
        expected = encode(Hello(self.token))
        if body_length(header) != len(expected) - HEADER.size:
            return False
        body = _read_exact(conn, len(expected) - HEADER.size)
        return body is not None and hmac.compare_digest(body, expected[HEADER.size:])

    def _run(self, conn: socket.socket) -> None:
        try:
            hello = self._hello(conn)
        except WireError as e:
            log.warning("step channel: a connection was refused: %s", e)
            return
        if not hello:
            log.warning("step channel: a connection without the actor's token was refused")
            return
        conn.sendall(encode(Ready()))
        launched: deque = deque()  # (launched step, plan, timings), oldest first

        def answer_ready() -> None:
            """What the device has finished goes back at once, oldest first."""
            while launched and launched[0][0].ready():
                self._answer(conn, *launched.popleft())

        # A launch that waits for the steps before it (grammar masks) answers them there.
        hook = getattr(self.runner, "on_steps_back", None)
        if hook is not None:
            hook(answer_ready)
        try:
            while True:
                answer_ready()
                if len(launched) >= MAX_LAUNCHED:
                    self._answer(conn, *launched.popleft())  # waits for the device
                    continue
                if launched and not select.select([conn], [], [], POLL_S)[0]:
                    continue  # a step runs and no plan is there yet: look again
                plan, timings = self._read_plan(conn, idle=not launched)
                if plan is None:
                    return  # the engine closed the channel
                try:
                    step = self.runner.launch(plan)
                except Exception as e:
                    while launched:  # the earlier steps' outputs first: the engine pairs in order
                        self._answer(conn, *launched.popleft())
                    self._fail(conn, plan, e)
                    continue
                launched.append((step, plan, timings))
        finally:
            if hook is not None:
                hook(None)
            for step, _, _ in launched:  # steps still on the device end before the channel does
                try:
                    self.runner.finish(step)
                except Exception:
                    pass

    def _read_plan(self, conn: socket.socket, idle: bool) -> tuple[StepPlan | None, dict]:
        t0 = time.perf_counter()
        header = _read_exact(conn, HEADER.size)
        if header is None:
            return None, {}
        t1 = time.perf_counter()
        body = _read_exact(conn, body_length(header))
        if body is None:
            return None, {}
        plan = decode(body, RANK_RECEIVES)
        return plan, {"wait": t1 - t0 if idle else 0.0, "recv": time.perf_counter() - t1}

    def _answer(self, conn: socket.socket, step: Any, plan: StepPlan, timings: dict) -> None:
        try:
            out = self.runner.finish(step)
        except Exception as e:
            self._fail(conn, plan, e)
            return
        out.timings.update(timings)
        self.steps += 1
        conn.sendall(encode(out))

    def _fail(self, conn: socket.socket, plan: StepPlan, e: Exception) -> None:
        """The engine fails this rank's requests with the message."""
        log.exception("step %s failed", getattr(plan, "step_id", "?"), exc_info=e)
        conn.sendall(encode(StepFailed(str(e) or "an error without a message",
                                       "".join(traceback.format_exception(e, limit=8)))))
