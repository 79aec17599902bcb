"""The OpenAI-compatible HTTP front end, served by every Engine replica itself.

`OpenAIServer` holds the logic (validate, tokenize, chat template, fan out `n`, stream
SSE, map errors to OpenAI bodies; vLLM's /tokenize and /detokenize) and calls the replica's EngineClient in the same
process and event loop: a request's tokens reach its HTTP response without a Ray hop. `build_api` puts it behind FastAPI routes. Every error a client can cause becomes a
4xx with an OpenAI error body, and no request, however malformed, can take the server
down.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from configs.schema import KestrelConfig
from serve_app.api.admission_pacer import AdmissionPacer
from serve_app.api.client_disconnect import ClientDisconnected, unless_disconnected
from serve_app.engine.engine_client import EngineError, EngineUnavailable, QueueFull, RequestRejected
from serve_app.api.errors import KestrelAPIError, error_body, validation_error_body
from serve_app.text.grammar import compiler_for
from serve_app.api.logprobs_format import LogprobFormatter
from serve_app.api.metrics import RequestTracker, ServerMetrics
from serve_app.api.openai_protocol import (SSE_DONE, ChatCompletionChoice, ChatCompletionMessage,
                                       ChatCompletionRequest, ChatCompletionResponse,
                                       CompletionChoice, CompletionRequest, CompletionResponse,
                                       ModelCard, ModelList, StreamChunks, UsageInfo, make_id,
                                       sse_event)
from serve_app.api.openapi_document import install_openapi, responses
from actors.sampling.output_counts import MAX_BAD_WORD_TOKENS
from serve_app.engine.request import RequestOutput
from serve_app.api.request_body import read_json_object
from serve_app.engine.request_stream import StreamFailed
from serve_app.engine.scheduler import PromptRejected, check_prompt, output_room
from serve_app.api.tokenize_protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                         TokenizePromptRequest, TokenizeResponse,
                                         tokenize_request_model)
from serve_app.text.prompt_encoder import PromptEncoder
from serve_app.text.tokenizer import render_chat_template
from serve_app.api.tools import ToolOutput, template_messages

log = logging.getLogger("kestrel.http")

HEALTH_TIMEOUT_S = 10.0
_ENDPOINTS = {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize",
              "/health", "/metrics"}
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_END = object()


def usage_of(choices: list["_Choice"], prompt_tokens: int) -> UsageInfo:
    """A request's usage: its prompts once, every choice's outputs; the cached prompt
    tokens of each prompt as its first choice met them (the n choices of a prompt share
    it, and the later ones find the first one's pages)."""
    first = {}
    for c in choices:
        first.setdefault(id(c.prompt_ids), c.cached)
    return UsageInfo.of(prompt_tokens, sum(c.tokens for c in choices), sum(first.values()))


class _Choice:
    """One generation of a request: what to run, and what came back."""

    __slots__ = ("index", "prompt_ids", "params", "rid", "text", "finish_reason", "tokens",
                 "cached", "tracker", "lp_ids", "lp_entries", "chars", "echo", "prompt_lps")

    def __init__(self, index: int, prompt_ids: list[int], params: dict[str, Any], rid: str,
                 tracker: RequestTracker):
        self.index = index
        self.prompt_ids = prompt_ids
        self.params = params
        self.rid = rid
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.tokens = 0
        self.cached = 0
        self.tracker = tracker
        self.lp_ids: list[int] = []  # the listed tokens and their logprob entries, when asked
        self.lp_entries: list = []
        self.chars = 0  # text length before the latest output (completions' text_offset)
        self.echo: str | None = None  # completions' echo: the prompt's text, put first
        self.prompt_lps: list | None = None  # the engine's prompt logprob entries, when asked

    def add(self, out: RequestOutput) -> None:
        if self.text:  # the text before this output, kept up as it grows
            self.chars += len(self.text[-1])
        self.text.append(out.new_text)
        self.tokens = out.num_output_tokens
        self.cached = out.cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_lps = out.prompt_logprobs
        if out.logprobs is not None:
            self.lp_ids += out.new_token_ids[:len(out.logprobs)]
            self.lp_entries += out.logprobs
        self.tracker.on_tokens(len(out.new_token_ids), out.accept_lengths)
        if out.finished:
            self.finish_reason = out.finish_reason
            self.tracker.finish(out.finish_reason, len(self.prompt_ids))


class OpenAIServer:
    def __init__(self, cfg: KestrelConfig, engine: Any, tokenizer: Any):
        self.cfg = cfg
        self.engine = engine  # the replica's EngineClient (or a test double)
        self.tokenizer = tokenizer
        self.encoder = PromptEncoder(tokenizer)
        self.logprob_format = LogprobFormatter(tokenizer)
        self.model_name = cfg.model.name
        self.max_model_len = cfg.model.max_model_len
        self.vocab_size = len(tokenizer)
        # A template with its own tool format gets the tools; for one without, Kestrel
        # writes them into the system message (serve_app/api/tools.py).
        self.template_renders_tools = "tools" in (getattr(tokenizer, "chat_template", None) or "")
        # Digests, not the keys: compare_digest then always compares 32 bytes, so the time
        # taken says nothing about a key's length either.
        self.key_digests = [_digest(k) for k in cfg.serve.api_keys]
        self.max_request_bytes = cfg.serve.max_request_bytes
        self.metrics_need_key = cfg.serve.metrics_require_api_key
        self.metrics = ServerMetrics(self.model_name)
        self.pacer = AdmissionPacer(cfg.serve.admission_slice_ms / 1000.0,
                                    cfg.serve.admission_defer_ms / 1000.0)

    # ---- request checks --------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if not self.key_digests:
            return
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise KestrelAPIError.unauthorized("Missing API key: send 'Authorization: Bearer <key>'")
        # compare_digest against every key, no early exit: the time taken says nothing
        # about which key, or how much of one, matched.
        digest = _digest(key.strip())
        ok = False
        for k in self.key_digests:
            ok |= hmac.compare_digest(digest, k)
        if not ok:
            raise KestrelAPIError.unauthorized("Invalid API key")

    async def parse(self, request: Request, model: type) -> Any:
        return self.validate(await self.read_json(request), model)

    async def read_json(self, request: Request) -> dict[str, Any]:
        return await read_json_object(request, self.max_request_bytes)

    def validate(self, data: dict[str, Any], model: type) -> Any:
        try:
            body = model.model_validate(data)
        except ValidationError as e:
            status, err = validation_error_body(e)
            raise KestrelAPIError(status, err["error"]["message"], param=err["error"]["param"]) from None
        if body.model is not None and body.model != self.model_name:
            raise KestrelAPIError.model_not_found(body.model)
        return body

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return await self.encoder.encode(text, add_special_tokens)

    async def chat_prompt(self, body: ChatCompletionRequest | TokenizeChatRequest) -> list[int]:
        """The messages through the model's chat template, as token ids."""
        messages = [m.for_template() for m in body.messages]
        kw = dict(add_generation_prompt=body.add_generation_prompt,
                  continue_final_message=body.continue_final_message)
        tools = body.tool_dicts()
        if self.template_renders_tools:
            if tools:
                kw["tools"] = tools
        elif tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
            messages = template_messages(messages, tools)
        try:
            text = render_chat_template(self.tokenizer, messages, **kw)
        # A template may reject a conversation (e.g. role order: TemplateError), and
        # transformers a continue_final_message it cannot honour (ValueError); anything
        # else is a bug, whose message is no answer for a client.
        except (TemplateError, ValueError) as e:
            raise KestrelAPIError.bad_request(f"The chat template rejected the messages: {e}",
                                              param="messages") from None
        return await self.encoder.encode(text, False)

    def check_vocab(self, ids: list[int], param: str) -> None:
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise KestrelAPIError.bad_request(
                f"Token id {bad} is outside the vocabulary (0..{self.vocab_size - 1})", param=param)

    def check_prompt(self, ids: list[int], param: str) -> None:
        try:
            check_prompt(ids, self.max_model_len)
        except PromptRejected as e:
            if not e.num_tokens:
                raise KestrelAPIError.bad_request("The prompt is empty", param=param) from None
            raise KestrelAPIError.bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {e.num_tokens} tokens (at most {e.limit} leave room for one generated token)",
                param=param) from None
        self.check_vocab(ids, param)

    async def compiled_grammar(self, body: Any) -> str | None:
        """The request's output constraint compiled (serve_app/text/grammar.py), in a thread:
        a new JSON schema takes tens of ms, a cached one nothing."""
        spec = body.grammar_spec()
        if spec is None:
            return None
        try:
            return await asyncio.to_thread(compiler_for(self.tokenizer).compile, spec,
                                           body.json_whitespace(self.cfg.processing.json_whitespace))
        except RuntimeError as e:  # parsed, yet the compiler refused it
            raise KestrelAPIError.bad_request(f"The output constraint does not compile: {e}") from None

    def make_choices(self, body: Any, prompts: list[list[int]], request_id: str, arrival: float,
                     grammar: str | None = None) -> list[_Choice]:
        """n choices per prompt, indexed prompt-major as OpenAI does; seeded requests get
        seed, seed+1, ... so the n samples differ but stay reproducible."""
        choices = []
        bad_words = self.bad_word_ids(body.bad_words or [])
        for p, ids in enumerate(prompts):
            params = body.to_sampling_params(output_room(len(ids), self.max_model_len))
            params["bad_words"] = bad_words
            params["grammar"] = grammar
            self.check_vocab(list(params["logit_bias"]), "logit_bias")
            if params["min_tokens"] > params["max_tokens"]:
                raise KestrelAPIError.bad_request(
                    f"min_tokens ({params['min_tokens']}) exceeds max_tokens ({params['max_tokens']})",
                    param="min_tokens")
            n = params.pop("n")
            for i in range(n):
                sp = dict(params)
                index = p * n + i
                if sp["seed"] is not None:
                    sp["seed"] = sp["seed"] + i
                choices.append(_Choice(index, ids, sp, f"{request_id}-{index}",
                                       self.metrics.tracker(arrival)))
        return choices

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """vLLM's bad_words as token sequences: each word with and without a leading space,
        so it is banned at the start of the text and inside it."""
        out: list[list[int]] = []
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = self.tokenizer.encode(text, add_special_tokens=False) if w.strip() else []
                if len(ids) > MAX_BAD_WORD_TOKENS:
                    raise KestrelAPIError.bad_request(
                        f"a bad_words entry ({w[:40]!r}) is {len(ids)} tokens; at most {MAX_BAD_WORD_TOKENS}",
                        param="bad_words")
                if ids and ids not in out:
                    out.append(ids)
        return out

    def api_error(self, exc: BaseException) -> KestrelAPIError:
        """Any failure on the way to the engine as the error a client should see."""
        if isinstance(exc, KestrelAPIError):
            return exc
        if isinstance(exc, QueueFull):
            return KestrelAPIError.overloaded(self.cfg.serve.queue_full_status,
                                              self.cfg.serve.retry_after_s)
        if isinstance(exc, RequestRejected):
            return KestrelAPIError.bad_request(exc.message)
        if isinstance(exc, (EngineUnavailable, StreamFailed)):
            return KestrelAPIError(503, str(getattr(exc, "message", exc)) or "The engine is unavailable",
                                   headers={"Retry-After": str(self.cfg.serve.retry_after_s)})
        if isinstance(exc, EngineError):
            return KestrelAPIError.internal(exc.message)
        log.error("request failed: %r", exc, exc_info=exc)
        return KestrelAPIError.internal()

    # ---- talking to the engine ---------------------------------------------------------
    def start(self, choices: list[_Choice]) -> list[Any]:
        """Admit every choice, so admission errors (queue full, bad params) are answered
        with a status, not mid-stream; on an error the ones admitted are cancelled."""
        most = self.cfg.scheduler.held_per_rank * self.cfg.parallel.dp_size
        if len(choices) > most:  # never admitted, however long the client waits: not a 503
            raise KestrelAPIError.bad_request(
                f"this request asks for {len(choices)} sequences (prompts times n); an engine "
                f"replica runs and queues at most {most} at once", param="n")
        streams: list[Any] = []
        try:
            for c in choices:
                streams.append(self.engine.add_request(c.prompt_ids, c.params, c.rid))
        except Exception as e:
            for st in streams:
                st.cancel()
            raise self.api_error(e) from None
        return streams

    async def outputs(self, streams: list[Any]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(position in streams, output) from all streams as they arrive. Leaving early
        (client gone, error) cancels the unfinished streams, which aborts them."""
        try:
            pacer = self.pacer
            if len(streams) == 1:  # the common case, without a task per stream
                async for out in streams[0]:
                    yield 0, out
                    if pacer.backlog and not out.finished:  # new requests first; its tokens pile up
                        await pacer.pause()
                return
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, stream: Any) -> None:
                try:
                    async for out in stream:
                        queue.put_nowait((i, out))
                        if pacer.backlog and not out.finished:
                            await pacer.pause()
                    queue.put_nowait((i, _END))
                except BaseException as e:  # noqa: BLE001 - handed to the consumer
                    queue.put_nowait((i, e))
                    if isinstance(e, asyncio.CancelledError):
                        raise

            tasks = [asyncio.create_task(pump(i, st)) for i, st in enumerate(streams)]
            try:
                remaining = len(streams)
                while remaining:
                    i, item = await queue.get()
                    if item is _END:
                        remaining -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield i, item
            finally:
                for t in tasks:
                    t.cancel()
        except (EngineError, StreamFailed) as e:
            raise self.api_error(e) from None
        finally:
            for st in streams:
                st.cancel()  # a no-op for the finished ones

    # ---- endpoints --------------------------------------------------------------------
    async def chat(self, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_auth(request)
        data = await self.read_json(request)  # a slow upload is no admission work
        async with self.pacer.admission():
            body: ChatCompletionRequest = self.validate(data, ChatCompletionRequest)
            ids = await self.chat_prompt(body)
            self.check_prompt(ids, "messages")
            request_id = make_id("chatcmpl")
            choices = self.make_choices(body, [ids], request_id, arrival,
                                        await self.compiled_grammar(body))
            tools, tool_choice = body.tool_dicts(), body.tool_choice_value()
            streams = self.start(choices)
        usage_prompt = len(ids)
        if body.stream:
            chunks = StreamChunks("chat", request_id, self.model_name)
            return self.sse(self.stream(chunks, choices, streams, usage_prompt,
                                        body.include_usage_in_stream, tools=(tools, tool_choice)))
        await self.collect(request, choices, streams)
        answers = []
        for c in choices:
            out = ToolOutput(tools, tool_choice)
            content, calls = out.last("".join(c.text), c.finish_reason)
            answers.append(ChatCompletionChoice(
                index=c.index, finish_reason=out.finish_reason(c.finish_reason),
                message=ChatCompletionMessage(content=content or (None if calls else ""),
                                              tool_calls=[t.to_openai() for t in calls] or None),
                logprobs=self.choice_logprobs("chat", c)))
        return JSONResponse(ChatCompletionResponse(
            id=request_id, model=self.model_name, choices=answers,
            usage=usage_of(choices, usage_prompt)).model_dump())

    async def completions(self, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_auth(request)
        data = await self.read_json(request)  # a slow upload is no admission work
        async with self.pacer.admission():
            body: CompletionRequest = self.validate(data, CompletionRequest)
            prompts: list[list[int]] = []
            for i, p in enumerate(body.prompts()):
                ids = (await self.encode(p, body.add_special_tokens) if isinstance(p, str) else list(p))
                self.check_prompt(ids, "prompt" if len(body.prompts()) == 1 else f"prompt.{i}")
                prompts.append(ids)
            request_id = make_id("cmpl")
            choices = self.make_choices(body, prompts, request_id, arrival,
                                        await self.compiled_grammar(body))
            if body.echo:
                texts = [p if isinstance(p, str) else self.tokenizer.decode(ids)
                         for p, ids in zip(body.prompts(), prompts)]
                n = len(choices) // len(prompts)
                for c in choices:
                    c.echo = texts[c.index // n]
            streams = self.start(choices)
        usage_prompt = sum(len(p) for p in prompts)
        if body.stream:
            chunks = StreamChunks("completion", request_id, self.model_name)
            return self.sse(self.stream(chunks, choices, streams, usage_prompt,
                                        body.include_usage_in_stream, body.prompt_logprobs))
        await self.collect(request, choices, streams)
        return JSONResponse(CompletionResponse(
            id=request_id, model=self.model_name,
            choices=[CompletionChoice(index=c.index, text=(c.echo or "") + "".join(c.text),
                                      finish_reason=c.finish_reason,
                                      logprobs=self.choice_logprobs("completion", c),
                                      prompt_logprobs=self.prompt_logprobs(c, body.prompt_logprobs))
                     for c in choices],
            usage=usage_of(choices, usage_prompt)).model_dump())

    def choice_logprobs(self, kind: str, c: _Choice):
        """A whole choice's logprobs for the response, or None when not asked."""
        if c.params.get("logprobs") is None:
            return None
        lp = self.logprob_format.of(kind, c.lp_ids, c.lp_entries, len(c.echo or ""))
        return lp if c.echo is None else self.join_echo(c, lp)

    def join_echo(self, c: _Choice, lp: Any) -> Any:
        """The echoed prompt's logprobs before the completion's."""
        head = self.logprob_format.echoed_prompt(c.prompt_ids, c.prompt_lps or [])
        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            getattr(head, name).extend(getattr(lp, name))
        return head

    def prompt_logprobs(self, c: _Choice, asked: int | None):
        if asked is None or c.prompt_lps is None:
            return None
        return self.logprob_format.prompt_logprobs(c.prompt_ids, c.prompt_lps, asked)

    async def collect(self, request: Request, choices: list[_Choice], streams: list[Any]) -> None:
        """Every output into its choice, until the last; a client that hangs up first
        aborts them all (ClientDisconnected)."""
        async def gather() -> None:
            async for i, out in self.outputs(streams):
                choices[i].add(out)
        try:
            await unless_disconnected(request, gather())
        except ClientDisconnected:
            for st in streams:  # `outputs` may not have started
                st.cancel()
            raise

    @staticmethod
    def sse(events: AsyncIterator[str]) -> StreamingResponse:
        return StreamingResponse(events, media_type="text/event-stream", headers=_SSE_HEADERS)

    async def stream(self, chunks: StreamChunks, choices: list[_Choice], streams: list[Any],
                     usage_prompt: int, include_usage: bool,
                     prompt_logprobs: int | None = None,
                     tools: tuple[Any, Any] = (None, None)) -> AsyncIterator[str]:
        """The SSE body: a chunk per batch of text each choice's stream hands over. With
        echo, a choice's first chunk is its prompt (with its logprobs and, as vLLM sends
        them, its prompt_logprobs), sent when the engine's first output brings them. With
        tools, a choice's text goes through its ToolOutput: content as it is known to be
        content, each tool call whole once it is."""
        views = [ToolOutput(*tools) for _ in choices]
        called = [0] * len(choices)  # tool calls sent per choice (their delta index)
        try:
            for c in choices:
                first = chunks.first(c.index)
                if first is not None:
                    yield first
            async for i, out in self.outputs(streams):
                c = choices[i]
                c.add(out)
                offset = c.chars + len(c.echo or "")
                if out.prompt_logprobs is not None and (c.echo is not None or prompt_logprobs is not None):
                    lp = None
                    if c.echo is not None and c.params.get("logprobs") is not None:
                        lp = self.logprob_format.echoed_prompt(c.prompt_ids, out.prompt_logprobs)
                    yield chunks.delta(c.index, c.echo or "", None, lp,
                                       self.prompt_logprobs(c, prompt_logprobs))
                elif c.echo is not None and len(c.text) == 1:  # no logprobs asked: the prompt now
                    yield chunks.delta(c.index, c.echo, None)
                if out.new_text or out.finished:
                    lp = None
                    if out.logprobs is not None:
                        ids = out.new_token_ids[:len(out.logprobs)]
                        lp = self.logprob_format.of(chunks.kind, ids, out.logprobs, offset)
                    view = views[i]
                    if view.mode == "none":
                        yield chunks.delta(c.index, out.new_text, out.finish_reason if out.finished else None, lp)
                        continue
                    text, calls = (view.last(out.new_text, out.finish_reason) if out.finished
                                   else view.feed(out.new_text))
                    if text or lp is not None:
                        yield chunks.delta(c.index, text, None, lp)
                    if calls:
                        yield chunks.tool_calls(c.index, [t.to_openai(called[i] + k) for k, t in enumerate(calls)])
                        called[i] += len(calls)
                    if out.finished:
                        yield chunks.delta(c.index, "", view.finish_reason(out.finish_reason))
            if include_usage:
                yield chunks.usage(usage_of(choices, usage_prompt))
            yield SSE_DONE
        except KestrelAPIError as e:  # the status line is gone: report in-band, as OpenAI does
            yield sse_event(e.body())
            yield SSE_DONE
        finally:
            for st in streams:  # a client that hung up: abort now, not when this is collected
                st.cancel()

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: a text prompt, or the prompt chat would build from messages."""
        self.check_auth(request)
        data = await self.read_json(request)
        body = self.validate(data, tokenize_request_model(data))
        if isinstance(body, TokenizeChatRequest):
            ids = await self.chat_prompt(body)
        else:
            ids = await self.encode(body.prompt, body.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=self.max_model_len,
                                             tokens=ids, token_strs=strs).model_dump())

    async def detokenize(self, request: Request) -> Response:
        self.check_auth(request)
        body: DetokenizeRequest = await self.parse(request, DetokenizeRequest)
        self.check_vocab(body.tokens, "tokens")
        return JSONResponse(DetokenizeResponse(prompt=self.tokenizer.decode(body.tokens)).model_dump())

    def models(self, request: Request) -> Response:
        self.check_auth(request)
        card = ModelCard(id=self.model_name, max_model_len=self.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    async def health(self) -> Response:
        try:
            await asyncio.wait_for(self.engine.check_health(), HEALTH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
            log.warning("health check failed: %r", e)
            return JSONResponse(error_body(503, "The engine is not healthy"), status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics_text(self, request: Request) -> Response:
        if self.metrics_need_key:
            self.check_auth(request)
        try:
            self.metrics.update_engine(await self.engine.stats())
        except Exception as e:  # noqa: BLE001 - still serve the request metrics
            log.warning("could not read engine stats: %r", e)
        data, content_type = self.metrics.render()
        return Response(data, media_type=content_type)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


class _RequestCounter:
    """Pure ASGI middleware counting responses by endpoint and status (a BaseHTTPMiddleware
    would buffer streams and hide client disconnects from the handlers)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = None

        async def send_status(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            path = scope.get("path", "")
            # 499: the client went away before a status was sent (nginx's convention).
            self.metrics.request_done(path if path in _ENDPOINTS else "other", status or 499)


def build_api(server: OpenAIServer) -> FastAPI:
    app = FastAPI(title="Kestrel", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_middleware(_RequestCounter, metrics=server.metrics)

    @app.exception_handler(KestrelAPIError)
    async def _api_error(_: Request, e: KestrelAPIError):
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), status_code=e.status_code,
                            headers=getattr(e, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError):
        return JSONResponse(error_body(400, f"Invalid request: {e.errors()}"), status_code=400)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, e: ClientDisconnected):
        return Response(status_code=499)  # nginx's "client closed request": nobody reads it

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception):
        err = server.api_error(e)
        return JSONResponse(err.body(), status_code=err.status, headers=err.headers)

    @app.post("/v1/chat/completions", responses=responses(ChatCompletionResponse, stream=True))
    async def chat(request: Request):
        return await server.chat(request)

    @app.post("/v1/completions", responses=responses(CompletionResponse, stream=True))
    async def completions(request: Request):
        return await server.completions(request)

    @app.post("/tokenize", responses=responses(TokenizeResponse))
    async def tokenize(request: Request):
        return await server.tokenize(request)

    @app.post("/detokenize", responses=responses(DetokenizeResponse))
    async def detokenize(request: Request):
        return await server.detokenize(request)

    @app.get("/v1/models", responses=responses(ModelList))
    async def models(request: Request):
        return server.models(request)

    @app.get("/health", responses=responses())
    async def health():
        return await server.health()

    @app.get("/metrics", response_class=PlainTextResponse, responses=responses(text=True))
    async def metrics(request: Request):
        return await server.metrics_text(request)

    keyed = {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/v1/models"}
    if server.metrics_need_key:
        keyed.add("/metrics")
    install_openapi(app, bodies={
        "/v1/chat/completions": ChatCompletionRequest,
        "/v1/completions": CompletionRequest,
        "/tokenize": TokenizePromptRequest | TokenizeChatRequest,
        "/detokenize": DetokenizeRequest,
    }, keyed_paths=keyed if server.key_digests else set())
    return app
