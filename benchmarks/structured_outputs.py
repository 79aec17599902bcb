"""Structured outputs at scale, in process: json_object and json_schema requests (varied
schemas, sampled at temperature 1) through the engine, every finished output parsed and
validated against its schema; and the cost, tokens/s with and without the constraint.

    python -m benchmarks.structured_outputs [--config configs/h200.yaml] [--set K=V ...]
        [--requests 200] [--batch 64] [--max-tokens 160] [--no-baseline]
        [--kinds json_object json_schema] [--out DIR]

Exit status 1 if any finished output is invalid. Prints progress per batch.
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
    args = ap.parse_args(argv)
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
