"""`kestrel generate` end to end: JSONL in, JSONL + stats out, config errors named."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run(*args, **kw):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "serve_app.cli", *args], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=600, **kw)


def test_generate_jsonl(tmp_path, tiny_model):
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "Hello there"}) + "\n"
                   + json.dumps({"id": "b", "messages": [{"role": "user", "content": "Hi"}]}) + "\n")
    out, stats = tmp_path / "out.jsonl", tmp_path / "stats.json"
    # The tiny random model with SmolLM2's tokenizer and chat template: what is under test
    # is the command's JSONL and stats, and the subprocess would spend 8 s loading SmolLM2.
    p = run("generate", "--input", str(inp), "--output", str(out), "--max-tokens", "6",
            "--ignore-eos", "--stats", str(stats), "--set", f"model.path={tiny_model}",
            "--set", "kv_cache.num_slots=4096",
            "--set", "draft.enabled=true", "--set", "draft.path=random",
            "--set", "draft.topk=1", "--set", "draft.num_steps=2", "--set", "draft.num_draft_tokens=3")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["a", "b"]
    for r in rows:
        assert set(r) == {"id", "text", "token_ids", "finish_reason", "num_prompt_tokens",
                          "num_output_tokens", "accept_lengths"}
        assert r["num_output_tokens"] == len(r["token_ids"]) == 6 and r["finish_reason"] == "length"
        assert sum(r["accept_lengths"]) >= 5 and isinstance(r["text"], str)
    s = json.loads(stats.read_text())
    assert s["requests"] == 2 and s["tokens_per_s"] > 0 and s["mean_accept_length"] >= 1
    assert "generate" in p.stderr  # the progress bar


def main_exits(*args) -> str:
    """`kestrel ARGS` in this process (the command's own main, as the console script and
    `python -m serve_app.cli` call it; test_generate_jsonl runs it as a process): it must
    exit unsuccessfully, and what it exits with is what the process would print to stderr."""
    import pytest

    from serve_app.cli import main
    with pytest.raises(SystemExit) as e:
        main(list(args))
    assert e.value.code not in (None, 0), e.value.code
    return str(e.value.code)


def test_generate_no_spec_and_bad_config(tmp_path, monkeypatch):
    import logging
    # main() would set up logging for a process; here the test session's stays as it is.
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": 1, "prompt": "Hi"}) + "\n")
    out = tmp_path / "out.jsonl"
    err = main_exits("generate", "--input", str(inp), "--output", str(out), "--set", "kv_cache.page_sise=4")
    assert "page_sise" in err and "page_size" in err
    err = main_exits("generate", "--input", str(inp), "--output", str(out), "--set", "attention.backend=nope")
    assert "attention.backend" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    err = main_exits("generate", "--input", str(bad), "--output", str(out))
    assert "bad.jsonl:1" in err


def test_serve_refuses_a_taken_port_with_a_clear_message():
    import socket

    import pytest

    from serve_app.app import check_port_free
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(SystemExit, match=f"cannot serve on 127.0.0.1:{port}.*--port"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again once its holder closed


def test_generate_fetches_a_uri_model_path(tmp_path, tiny_model, monkeypatch):
    """`kestrel generate` with model.path an http:// URL of the model's tarball: fetched
    into model.download_dir (as a Serve replica fetches it: serve_app/engine/model_files.py)
    and generating what the local folder does; a URL that cannot be fetched is named."""
    import functools
    import logging
    import tarfile
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    from serve_app.cli import main
    from serve_app.engine.model_download import cache_folder
    monkeypatch.setattr(logging, "basicConfig", lambda **kw: None)
    www = tmp_path / "www"
    www.mkdir()
    with tarfile.open(www / "tiny.tar.gz", "w:gz") as tar:
        tar.add(tiny_model, arcname="tiny")
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(www))
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/tiny.tar.gz"
    inp = tmp_path / "in.jsonl"
    inp.write_text(json.dumps({"id": "a", "prompt": "Hello there"}) + "\n")
    models = tmp_path / "models"

    def generate(path: str, out: str) -> list[dict]:
        main(["generate", "--input", str(inp), "--output", str(tmp_path / out), "--max-tokens", "5",
              "--ignore-eos", "--no-spec", "--set", f"model.path={path}",
              "--set", f"model.download_dir={models}", "--set", "kv_cache.num_slots=4096"])
        return [json.loads(line) for line in (tmp_path / out).read_text().splitlines()]
    try:
        fetched = generate(url, "uri.jsonl")
        assert (models / cache_folder(url, str(models)).rsplit("/", 1)[1] / "config.json").is_file()
        assert fetched == generate(tiny_model, "local.jsonl")
        assert len(fetched[0]["token_ids"]) == 5
        absent = url.replace("tiny.tar.gz", "absent.tar.gz")
        err = main_exits("generate", "--input", str(inp), "--output", str(tmp_path / "x.jsonl"),
                         "--no-spec", "--set", f"model.path={absent}", "--set", f"model.download_dir={models}")
        assert err == f"kestrel: model.path {absent!r}: the download failed: HTTP 404 File not found"
    finally:
        httpd.shutdown()
        httpd.server_close()
