"""A URI model.path fetched into model.download_dir: the tiny model as a tarball over a real
HTTP server (python's http.server, in a thread) and from file:// URIs; two fetches at once
download once; a cut or failed download leaves nothing a later load could take; a URI that
cannot be fetched fails with an error that names it and says why."""
from __future__ import annotations

import filecmp
import logging
import os
import tarfile
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from serve_app.engine import model_download
from serve_app.engine.model_download import ModelDownloadError, cache_folder, fetch_model


class ModelServer:
    """Serves the files of a folder at /MODE/NAME. MODE: whole; truncated (Content-Length
    says all, half is sent, the connection closes); cut (no Content-Length, half, close);
    stall (half, then nothing until released); gate (half, then the rest once `gate` is
    set). Counts the GETs per path."""

    def __init__(self, folder: str):
        self.folder, self.gets = folder, Counter()
        self.gate, self.release = threading.Event(), threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                outer.gets[self.path] += 1
                mode, _, name = self.path.lstrip("/").partition("/")
                path = os.path.join(outer.folder, name)
                if not os.path.isfile(path):
                    self.send_error(404)
                    return
                data = open(path, "rb").read()
                half = len(data) // 2
                self.send_response(200)
                if mode != "cut":
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data if mode == "whole" else data[:half])
                self.wfile.flush()
                if mode == "stall":
                    outer.release.wait()
                elif mode == "gate":
                    outer.gate.wait()
                    self.wfile.write(data[half:])

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, mode: str, name: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/{mode}/{name}"

    def close(self) -> None:
        self.release.set()
        self.gate.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """The tiny model as tiny.tar.gz (its folder inside, as `tar -C parent` makes it) and
    flat.tar (its files at the top), a fake .gguf, and a tarball without a model."""
    folder = tmp_path_factory.mktemp("served")
    with tarfile.open(folder / "tiny.tar.gz", "w:gz") as tar:
        tar.add(tiny_model, arcname="tiny")
    with tarfile.open(folder / "flat.tar", "w") as tar:
        for name in sorted(os.listdir(tiny_model)):
            tar.add(os.path.join(tiny_model, name), arcname=name)
    (folder / "small.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
    (folder / "notes.txt").write_text("not a model")
    with tarfile.open(folder / "nomodel.tar.gz", "w:gz") as tar:
        tar.add(folder / "notes.txt", arcname="notes.txt")
    server = ModelServer(str(folder))
    yield server
    server.close()


def same_files(a: str, b: str) -> bool:
    cmp = filecmp.dircmp(a, b)
    return (not cmp.left_only and not cmp.right_only
            and filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)[0] == sorted(cmp.common_files))


def leftovers(download_dir) -> list[str]:
    """What a fetch left in download_dir besides its (empty) lock files."""
    return sorted(n for n in os.listdir(download_dir) if not n.endswith(".lock"))


def test_http_tarball_is_fetched_once_into_the_cache(served, tiny_model, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="kestrel.download")
    url = served.url("whole", "tiny.tar.gz")
    path = fetch_model(url, str(tmp_path))
    assert path == cache_folder(url, str(tmp_path)) and os.path.isfile(os.path.join(path, "config.json"))
    assert same_files(tiny_model, path)
    assert fetch_model(url, str(tmp_path)) == path
    assert served.gets["/whole/tiny.tar.gz"] == 1  # the second found the copy
    assert leftovers(tmp_path) == [os.path.basename(path)]
    # An archive of the folder's files (no folder inside) gives the same model.
    flat = fetch_model(served.url("whole", "flat.tar"), str(tmp_path))
    assert flat != path and same_files(tiny_model, flat)
    text = caplog.text
    assert f"{url}: fetching" in text and f"{url}: fetched" in text and "MiB/s" in text


def test_progress_names_bytes_of_the_total_and_the_rate(served, tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(model_download, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(model_download, "CHUNK_BYTES", 4096)
    caplog.set_level(logging.INFO, logger="kestrel.download")
    fetch_model(served.url("whole", "tiny.tar.gz"), str(tmp_path))
    lines = [r.getMessage() for r in caplog.records if "%)" in r.getMessage()]
    assert lines and all(" MiB of " in m and m.endswith("MiB/s") for m in lines), lines[:3]
    assert "(100%)" in lines[-1]


def test_http_gguf_is_one_file(served, tmp_path):
    path = fetch_model(served.url("whole", "small.gguf"), str(tmp_path))
    assert os.path.basename(path) == "small.gguf"
    assert open(path, "rb").read() == open(os.path.join(served.folder, "small.gguf"), "rb").read()


def test_file_uris_folder_and_tarball(served, tiny_model, tmp_path):
    folder = fetch_model(f"file://{tiny_model}", str(tmp_path))
    assert folder != tiny_model and same_files(tiny_model, folder)
    tarball = fetch_model(f"file://{served.folder}/tiny.tar.gz", str(tmp_path))
    assert tarball not in (folder, tiny_model) and same_files(tiny_model, tarball)
    gguf = fetch_model(f"file://{served.folder}/small.gguf", str(tmp_path))
    assert gguf.endswith("small.gguf") and os.path.isfile(gguf)


def test_two_fetches_at_once_download_once(served, tmp_path, caplog):
    """Two replicas of a node: the second waits on the lock while the first is half way
    through, then takes the first one's copy."""
    caplog.set_level(logging.INFO, logger="kestrel.download")
    url = served.url("gate", "tiny.tar.gz")
    waiting = threading.Event()

    class Waiting(logging.Handler):
        def emit(self, record):
            if "waiting for it" in record.getMessage():
                waiting.set()
    handler = Waiting()
    logging.getLogger("kestrel.download").addHandler(handler)
    results: dict[str, str | BaseException] = {}

    def fetch(name):
        try:
            results[name] = fetch_model(url, str(tmp_path))
        except BaseException as e:  # to the assertion below
            results[name] = e
    try:
        first = threading.Thread(target=fetch, args=("first",))
        first.start()
        while served.gets["/gate/tiny.tar.gz"] == 0 and first.is_alive():
            first.join(0.05)
        second = threading.Thread(target=fetch, args=("second",))
        second.start()
        for _ in range(2400):  # until the second waits on the lock (it logs so first)
            if waiting.wait(0.05):
                break
            assert served.gets["/gate/tiny.tar.gz"] == 1 and second.is_alive(), \
                ("the second fetch did not wait for the first", served.gets, results)
        assert waiting.is_set()
        served.gate.set()
        first.join(120)
        second.join(120)
    finally:
        served.gate.set()
        logging.getLogger("kestrel.download").removeHandler(handler)
    assert isinstance(results["first"], str), results
    assert results["first"] == results["second"]
    assert served.gets["/gate/tiny.tar.gz"] == 1


def test_a_cut_download_leaves_nothing_in_the_cache(served, tmp_path):
    url = served.url("truncated", "tiny.tar.gz")
    size = os.path.getsize(os.path.join(served.folder, "tiny.tar.gz"))
    with pytest.raises(ModelDownloadError) as e:
        fetch_model(url, str(tmp_path))
    assert str(e.value) == (f"model.path {url!r}: the download failed: the transfer ended after "
                            f"{size // 2} of {size} bytes")
    assert leftovers(tmp_path) == []
    # Without a Content-Length the archive itself shows the cut.
    url = served.url("cut", "tiny.tar.gz")
    with pytest.raises(ModelDownloadError, match="the archive is cut short or not a tar archive"):
        fetch_model(url, str(tmp_path))
    assert leftovers(tmp_path) == []
    # A .gguf cut short is never taken for a model.
    with pytest.raises(ModelDownloadError, match="transfer ended after"):
        fetch_model(served.url("truncated", "small.gguf"), str(tmp_path))
    assert leftovers(tmp_path) == []


def test_a_killed_fetchs_partial_folder_is_removed_by_the_next(served, tmp_path):
    url = served.url("whole", "small.gguf")
    key = os.path.basename(cache_folder(url, str(tmp_path)))
    partial = tmp_path / f".{key}.partial-killed"
    partial.mkdir()
    (partial / "small.gguf").write_bytes(b"GGUF half")
    path = fetch_model(url, str(tmp_path))
    assert not partial.exists() and leftovers(tmp_path) == [key]
    assert os.path.getsize(path) == os.path.getsize(os.path.join(served.folder, "small.gguf"))


def test_uris_that_cannot_be_fetched_are_named_with_the_reason(served, tmp_path):
    cases = {
        served.url("whole", "absent.tar.gz"): "the download failed: HTTP 404",
        "http://127.0.0.1:9/model.tar.gz": "the download failed: Connection refused",
        f"file://{tmp_path}/absent.gguf": f"the download failed: No such file or directory: {tmp_path}/absent.gguf",
        served.url("whole", "nomodel.tar.gz"): "what it holds is not a model: no config.json and no .gguf file",
        f"file://{served.folder}/notes.txt": "names neither a folder nor a .tar.gz, .tgz, .tar or .gguf file",
    }
    cache = tmp_path / "cache"
    for uri, reason in cases.items():
        with pytest.raises(ModelDownloadError) as e:
            fetch_model(uri, str(cache))
        assert str(e.value).startswith(f"model.path {uri!r}: ") and reason in str(e.value), str(e.value)
    assert leftovers(cache) == []


def test_a_stalled_server_fails_the_fetch(served, tmp_path):
    url = served.url("stall", "tiny.tar.gz")
    with pytest.raises(ModelDownloadError, match=r"the download failed: no data for 0.5 s"):
        fetch_model(url, str(tmp_path), stall_timeout_s=0.5)
    assert leftovers(tmp_path) == []


def test_download_dir_that_cannot_be_written_is_named(served, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ModelDownloadError, match="cannot write model.download_dir"):
        fetch_model(served.url("whole", "small.gguf"), str(blocker / "models"))


def test_uris_no_node_could_fetch_are_refused_when_the_config_is_read():
    import importlib.util

    from configs.schema import ConfigError, load_config
    refused = {"ftp://host/m.tar.gz": "the scheme 'ftp' is not one Kestrel downloads",
               "https://host/models/qwen": "must name a .tar.gz, .tgz, .tar of the model folder or a .gguf",
               "file://otherhost/models/m": "a file:// URI names a path of the node itself"}
    if importlib.util.find_spec("pyarrow") is None:
        refused["s3://bucket/models/qwen"] = "s3:// is read through pyarrow, which is not installed: `pip install pyarrow`"
    for uri, reason in refused.items():
        with pytest.raises(ConfigError, match="model.path") as e:
            load_config(overrides=[f"model.path={uri}"])
        assert reason in str(e.value), str(e.value)
    cfg = load_config(overrides=["model.path=https://host/m.tar.gz?X-Signature=1", "model.download_dir=/data/models"])
    assert cfg.model.path == "https://host/m.tar.gz?X-Signature=1" and cfg.model.download_dir == "/data/models"
    assert load_config().model.download_dir == "~/.cache/kestrel/models"


def test_the_pyarrow_source_reads_folders_and_archives(served, tiny_model, tmp_path, monkeypatch):
    """s3:// and gs:// are read through pyarrow's file systems (where pyarrow is installed);
    its local file system stands for them here: the same listing and reading."""
    pytest.importorskip("pyarrow.fs")
    monkeypatch.setattr(model_download, "_LocalSource",
                        lambda path: model_download._ArrowSource(f"file://{path}"))
    assert same_files(tiny_model, fetch_model(f"file://{tiny_model}", str(tmp_path)))
    assert same_files(tiny_model, fetch_model(f"file://{served.folder}/tiny.tar.gz", str(tmp_path)))
    absent = f"file://{tmp_path}/absent"
    with pytest.raises(ModelDownloadError, match=f"the download failed: no such object or folder: {tmp_path}/absent"):
        fetch_model(absent, str(tmp_path / "cache"))
    from configs.schema import load_config
    assert load_config(overrides=["model.path=s3://bucket/models/qwen/"]).model.path == "s3://bucket/models/qwen/"
