"""A Serve replica whose model.path is a URI: it fetches the model's tarball over HTTP into
model.download_dir before it starts its actors, and serves it (through the session's
HAProxy); a URL it cannot fetch fails the replica with the URL and the reason, and the
deploy fails instead of waiting."""
from __future__ import annotations

import functools
import tarfile
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP = "kestrel-uri"


@pytest.fixture(scope="module")
def model_url(tiny_model, tmp_path_factory):
    """The tiny model as tiny.tar.gz at http://127.0.0.1:PORT/, and the paths asked for."""
    www = tmp_path_factory.mktemp("www")
    with tarfile.open(www / "tiny.tar.gz", "w:gz") as tar:
        tar.add(tiny_model, arcname="tiny")
    asked: list[str] = []

    class Handler(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            asked.append(self.path)
            super().do_GET()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(www)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", asked
    httpd.shutdown()
    httpd.server_close()


def overrides(url: str, download_dir) -> list[str]:
    return ["device=cpu", "draft.enabled=false", f"model.path={url}", f"model.download_dir={download_dir}",
            "kv_cache.num_slots=4096", "cpu_threads=1"]


@pytest.mark.long  # the fetch itself: tests/unit/test_model_download.py and test_cli.py in make test
def test_a_replica_fetches_a_uri_model_path_and_serves_it(server, model_url, tmp_path):
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    from serve_app.engine.model_download import cache_folder
    base, asked = model_url
    url = f"{base}/tiny.tar.gz"
    serve.run(build_app(load_config(overrides=overrides(url, tmp_path))), name=APP, route_prefix="/uri")
    try:
        r = httpx.post(server.base_url + "/uri/v1/completions", timeout=120,
                       json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert (tmp_path / cache_folder(url, str(tmp_path)).rsplit("/", 1)[1] / "config.json").is_file()
        assert asked.count("/tiny.tar.gz") == 1
    finally:
        serve.delete(APP)


@pytest.mark.long  # Serve tries the replica 3 times; tests/unit/test_model_download.py checks the messages
def test_a_replica_that_cannot_fetch_its_model_fails_naming_the_uri(server, model_url, tmp_path):
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    url = f"{model_url[0]}/absent.tar.gz"
    try:
        with pytest.raises(RuntimeError, match=f"Deploying application {APP}-bad failed"):
            serve.run(build_app(load_config(overrides=overrides(url, tmp_path))), name=f"{APP}-bad",
                      route_prefix="/uri-bad")
        msg = serve.status().applications[f"{APP}-bad"].deployments["EngineDeployment"].message
        assert "ModelFilesMissing: node " in msg, msg[-2000:]
        assert f"model.path {url!r}: the download failed: HTTP 404" in msg, msg[-2000:]
    finally:
        serve.delete(f"{APP}-bad")
