"""Structured outputs at scale, in process: json_object and json_schema requests (varied
schemas, sampled at temperature 1) through the engine, every finished output parsed and
validated against its schema; and the cost, tokens/s with and without the constraint.

    python -m benchmarks.structured_outputs [--config configs/h200.yaml] [--set K=V ...]
        [--requests 200] [--batch 64] [--max-tokens 160] [--no-baseline]
        [--kinds json_object json_schema] [--out DIR]

Exit status 1 if any finished output is invalid. Prints progress per batch.

With --http, what a client gets: `kestrel serve` started with the config, and the official
`openai` client sending --requests chat requests per kind (json_schema: a person with
name, age and tags; json_object) at temperature 1 (seed i for request i), --concurrency at
once, first with any whitespace between JSON tokens and then compact (the per-request
structured_outputs.disable_any_whitespace, false then true: the two grammars of
processing.json_whitespace). Per kind and whitespace: the share that stop by themselves
(finish_reason "stop") and parse (and validate, for json_schema), and the mean answer
length in tokens (usage.completion_tokens).

    python -m benchmarks.structured_outputs --http [--requests 100] [--max-tokens 300]
        [--concurrency 16] [--config ...] [--set K=V ...] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jsonschema

from configs.schema import load_config
from serve_app.text.grammar import compiler_for
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams
from serve_app.text.tokenizer import apply_chat_template

SCHEMAS = [
    ("a person", {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                  "properties": {"name": {"type": "string", "maxLength": 30},
                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}}}),
    ("a city", {"type": "object", "additionalProperties": False,
                "required": ["city", "country", "population"],
                "properties": {"city": {"type": "string", "maxLength": 30},
                               "country": {"type": "string", "maxLength": 30},
                               "population": {"type": "integer", "minimum": 0}}}),
    ("a todo list", {"type": "object", "additionalProperties": False, "required": ["items"],
                     "properties": {"items": {"type": "array", "maxItems": 3,
                                              "items": {"type": "string", "maxLength": 24}}}}),
    ("a yes/no verdict with a reason", {
        "type": "object", "additionalProperties": False, "required": ["verdict", "reason"],
        "properties": {"verdict": {"enum": ["yes", "no"]},
                       "reason": {"type": "string", "maxLength": 40}}}),
    ("a point", {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                 "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}),
    ("a book", {"type": "object", "additionalProperties": False, "required": ["title", "year", "tags"],
                "properties": {"title": {"type": "string", "maxLength": 30},
                               "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
                               "tags": {"type": "array", "maxItems": 2,
                                        "items": {"type": "string", "maxLength": 12}}}}),
    ("a flag", {"type": "object", "additionalProperties": False, "required": ["ok"],
                "properties": {"ok": {"type": "boolean"}}}),
    ("a nested order", {"type": "object", "additionalProperties": False, "required": ["id", "customer"],
                        "properties": {"id": {"type": "integer", "minimum": 1},
                                       "customer": {"type": "object", "additionalProperties": False,
                                                    "required": ["name"],
                                                    "properties": {"name": {"type": "string", "maxLength": 20}}}}}),
]


def requests(kind: str, n: int, tok, compiler) -> list[tuple[list[int], str, dict | None]]:
    """(prompt ids, compiled grammar, schema or None for any object) per request."""
    out = []
    for i in range(n):
        what, schema = SCHEMAS[i % len(SCHEMAS)]
        msgs = [{"role": "user", "content": f"Describe {what} as JSON. Variation {i}."}]
        spec = ("json_schema", json.dumps(schema)) if kind == "json_schema" else ("json_object", "")
        out.append((apply_chat_template(tok, msgs), compiler.compile(spec),
                    schema if kind == "json_schema" else None))
    return out


def run(engine, reqs, batch: int, max_tokens: int, constrained: bool, seed: int) -> dict:
    done, valid, invalid, truncated, tokens = 0, 0, [], 0, 0
    t0 = time.perf_counter()
    for start in range(0, len(reqs), batch):
        chunk = reqs[start:start + batch]
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + start + i,
                                 grammar=g if constrained else None) for i, (_, g, _) in enumerate(chunk)]
        outs = engine.generate([p for p, _, _ in chunk], params)
        for (_, _, schema), r in zip(chunk, outs):
            tokens += len(r.output_ids)
            done += 1
            if not constrained:
                continue
            if r.finish_reason != "stop":
                truncated += 1
                continue
            try:
                value = json.loads(r.text)
                if schema is None:
                    assert isinstance(value, dict), "not an object"
                else:
                    jsonschema.validate(value, schema)
                valid += 1
            except (ValueError, AssertionError, jsonschema.ValidationError) as e:
                invalid.append((r.text, str(e)[:200]))
        print(f"  {done}/{len(reqs)} requests, {tokens} tokens, {time.perf_counter() - t0:.1f}s", flush=True)
    secs = time.perf_counter() - t0
    return {"requests": done, "tokens": tokens, "seconds": round(secs, 2),
            "tok_per_s": round(tokens / secs, 1), "valid": valid, "invalid": len(invalid),
            "truncated": truncated, "invalid_examples": invalid[:5]}


# The person of issue 35, as a new user writes it: no bounds but the types.
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "tags": {"type": "array", "items": {"type": "string"}}}}
HTTP_KINDS = {  # kind: (user message, chat keyword arguments)
    "json_schema": ("Invent a person. Reply with JSON: their name, age and tags.",
                    {"response_format": {"type": "json_schema", "json_schema": {
                        "name": "person", "schema": PERSON, "strict": True}}}),
    "json_object": ("Describe a person as a JSON object.", {"response_format": {"type": "json_object"}}),
}


def http_answer(client, model: str, kind: str, whitespace: str, seed: int, max_tokens: int) -> dict:
    """One chat request: whether it stopped by itself, whether its answer is what was
    asked for (parses; validates for json_schema), and its length in tokens."""
    text, kw = HTTP_KINDS[kind]
    r = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
        temperature=1.0, seed=seed, **kw,
        extra_body={"structured_outputs": {"disable_any_whitespace": whitespace == "compact"}})
    c = r.choices[0]
    try:
        value = json.loads(c.message.content)
        if kind == "json_schema":
            jsonschema.validate(value, PERSON)
        valid = isinstance(value, dict)
    except (ValueError, jsonschema.ValidationError):
        valid = False
    return {"stop": c.finish_reason == "stop", "valid": valid, "tokens": r.usage.completion_tokens,
            "text": c.message.content}


def over_http(args) -> dict:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from benchmarks.http_bench import start_server, stop_server, wait_ready
    proc, url, log = start_server(args.config, args.set)
    print(f"kestrel serve on {url} (log: {log}) ...", flush=True)
    report = {"config": args.config, "overrides": args.set, "requests": args.requests,
              "max_tokens": args.max_tokens, "concurrency": args.concurrency}
    try:
        asyncio.run(wait_ready(url, proc))
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=1800)
        model = client.models.list().data[0].id
        for kind in HTTP_KINDS:
            for whitespace in ("any", "compact"):
                t0 = time.perf_counter()
                with ThreadPoolExecutor(args.concurrency) as pool:
                    answers = list(pool.map(lambda i: http_answer(
                        client, model, kind, whitespace, i, args.max_tokens), range(args.requests)))
                n = len(answers)
                ok = sum(a["stop"] and a["valid"] for a in answers)
                r = report[f"{kind}/{whitespace}"] = {
                    "stopped_and_valid": ok, "share": round(ok / n, 3),
                    "stopped": sum(a["stop"] for a in answers),
                    "mean_tokens": round(sum(a["tokens"] for a in answers) / n, 1),
                    "seconds": round(time.perf_counter() - t0, 1),
                    "examples": [a["text"][:200] for a in answers[:3]]}
                print(f"{kind}, {whitespace} whitespace: {ok}/{n} stop and are valid, "
                      f"{r['stopped']} stop, mean {r['mean_tokens']} tokens ({r['seconds']} s)", flush=True)
    finally:
        stop_server(proc)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--no-baseline", action="store_true", help="skip the unconstrained runs")
    ap.add_argument("--kinds", nargs="+", default=["json_object", "json_schema"],
                    choices=["json_object", "json_schema"])
    ap.add_argument("--out")
    ap.add_argument("--http", action="store_true", help="the official client against kestrel serve")
    ap.add_argument("--concurrency", type=int, default=16, help="--http: requests at once")
    args = ap.parse_args(argv)
    if args.http:
        report = over_http(args)
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "structured_outputs_http.json").write_text(json.dumps(report, indent=1))
        return 0
    cfg = load_config(args.config, overrides=args.set)
    engine = LLMEngine(cfg)
    tok = engine.tokenizer
    compiler = compiler_for(tok)
    report = {"config": args.config, "overrides": args.set, "speculation": cfg.draft.enabled}
    bad = 0
    for kind in args.kinds:
        reqs = requests(kind, args.requests, tok, compiler)
        print(f"{kind}: {args.requests} requests, constrained", flush=True)
        report[kind] = run(engine, reqs, args.batch, args.max_tokens, True, seed=1)
        if not args.no_baseline:
            print(f"{kind}: {args.requests} requests, unconstrained (the cost baseline)", flush=True)
            report[kind + "_unconstrained"] = run(engine, reqs, args.batch, args.max_tokens, False, seed=1)
        r = report[kind]
        bad += r["invalid"]
        free = report.get(kind + "_unconstrained", {}).get("tok_per_s", "-")
        print(f"{kind}: {r['valid']} valid, {r['invalid']} invalid, {r['truncated']} cut at max_tokens; "
              f"{r['tok_per_s']} tok/s constrained, {free} free")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "structured_outputs.json").write_text(json.dumps(report, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
