"""/tokenize and /detokenize as vLLM serves them, over raw HTTP (ASGI, scripted engine):
the same prompt ids the generation endpoints build, the API key, the 400s."""
from __future__ import annotations

import pytest
from fake_engine import BosTokenizer, FakeEngine, Recorder, request

from configs.schema import load_config
from serve_app.api.openai_server import OpenAIServer, build_api
from serve_app.text.tokenizer import apply_chat_template

MODEL = "SmolLM2-135M-Instruct"
MSGS = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def make_app(tokenizer, *overrides):
    cfg = load_config(overrides=["device=cpu", *overrides])
    recorder = Recorder()
    return build_api(OpenAIServer(cfg, FakeEngine(recorder), tokenizer)), cfg, recorder


@pytest.fixture
def app(tokenizer):
    return make_app(tokenizer)[0]


def post(app, path, body, **kw):
    return request(app, "POST", path, json=body, **kw)


def test_tokenize_prompt(app, tokenizer):
    text = "Hello world, this is Kestrel."
    r = post(app, "/tokenize", {"model": MODEL, "prompt": text})
    assert r.status_code == 200, r.text
    ids = tokenizer.encode(text)
    assert r.json() == {"count": len(ids), "max_model_len": load_config(
        overrides=["device=cpu"]).model.max_model_len, "tokens": ids}
    r = post(app, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert r.json()["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    assert post(app, "/tokenize", {"prompt": ""}).json()["count"] == 0


def test_tokenize_prompt_add_special_tokens(tokenizer):
    bos = BosTokenizer(tokenizer)
    app = make_app(bos)[0]
    plain = tokenizer.encode("Hi", add_special_tokens=False)
    assert post(app, "/tokenize", {"prompt": "Hi"}).json()["tokens"] == [bos.BOS, *plain]
    r = post(app, "/tokenize", {"prompt": "Hi", "add_special_tokens": False})
    assert r.json()["tokens"] == plain


def test_tokenize_messages_is_the_chat_prompt(tokenizer):
    app, _, recorder = make_app(tokenizer)
    r = post(app, "/tokenize", {"model": MODEL, "messages": MSGS})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == apply_chat_template(tokenizer, MSGS)
    assert r.json()["count"] == len(r.json()["tokens"])
    assert post(app, "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2}).status_code == 200
    assert recorder.requests[0][0] == r.json()["tokens"]  # what chat sends to the engine

    turn = [*MSGS, {"role": "assistant", "content": "Hel"}]
    no_prompt = post(app, "/tokenize", {"messages": turn, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == apply_chat_template(tokenizer, turn, add_generation_prompt=False)
    cont = post(app, "/tokenize", {"messages": turn, "add_generation_prompt": False,
                                   "continue_final_message": True}).json()
    assert tokenizer.decode(cont["tokens"]).endswith("Hel")
    assert cont["tokens"] != no_prompt["tokens"]


def test_detokenize(app, tokenizer):
    ids = tokenizer.encode("Hello world")
    r = post(app, "/detokenize", {"model": MODEL, "tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": "Hello world"}
    assert post(app, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("tokens", [[1, 49152], [10 ** 9], [-1]])  # SmolLM2: ids 0..49151
def test_detokenize_out_of_vocab_is_400(app, tokens):
    r = post(app, "/detokenize", {"tokens": tokens})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "tokens" and "vocabulary" in err["message"]


@pytest.mark.parametrize("path,body,status,param", [
    ("/tokenize", {"prompt": "x", "foo": 1}, 400, "foo"),
    ("/tokenize", {"messages": MSGS, "max_tokens": 3}, 400, "max_tokens"),
    ("/tokenize", {"messages": MSGS, "chat_template": "{{ x }}"}, 400, "chat_template"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages.0.content"),
    ("/tokenize", {"messages": MSGS, "continue_final_message": True}, 400, "continue_final_message"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": "gpt-9", "prompt": "x"}, 404, "model"),
    ("/detokenize", {"tokens": [1], "foo": 1}, 400, "foo"),
    ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"model": "gpt-9", "tokens": [1]}, 404, "model"),
])
def test_bad_bodies(app, path, body, status, param):
    r = post(app, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_not_json_and_wrong_method(app):
    r = request(app, "POST", "/tokenize", content=b"{", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert request(app, "GET", "/tokenize").status_code == 405
    assert request(app, "GET", "/detokenize").status_code == 405


def test_api_key_and_metrics(tokenizer):
    app = make_app(tokenizer, "serve.api_keys=[k1]")[0]
    for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})]:
        r = post(app, path, body)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert post(app, path, body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert post(app, path, body, headers={"Authorization": "Bearer k1"}).status_code == 200
    text = request(app, "GET", "/metrics").text
    for path in ("/tokenize", "/detokenize"):
        for status in (200, 401):
            assert f'endpoint="{path}",model="{MODEL}",status="{status}"' in text
