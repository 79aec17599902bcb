"""Offline benchmark: Kestrel's in-process engine against Hugging Face transformers.

Same prompts (MT-bench first turns, chat template), greedy, same max tokens, measured
side by side in one run at each batch size. Prints a markdown table.

    kestrel bench offline [--batch-sizes 1 8] [--max-tokens 64] [--num-prompts 8]
        [--dtype auto] [--spec-set draft.topk=1 ...] [--repeats R] [--skip-hf]

With --repeats R, plain and speculative runs alternate R times at each batch size and
the medians are reported, with the median of the R per-pair ratios: on a shared machine
one pair alone can be off by 20%.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

DATA = Path(__file__).resolve().parent / "data" / "mt_bench_questions.jsonl"  # MT-bench, Apache-2.0


def load_questions(path: Path, n: int) -> list[str]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["turns"][0] for r in rows[:n]]


def run_kestrel(cfg, tokenizer, prompts, batch, max_tokens, workers=None):
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    eng = LLMEngine(cfg, tokenizer=tokenizer, workers=workers)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    eng.generate([prompts[0]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    tokens, accepts, t0 = 0, [], time.perf_counter()
    for i in range(0, len(prompts), batch):
        for r in eng.generate(prompts[i:i + batch], params):
            tokens += len(r.output_ids)
            accepts += r.accept_lengths
    dt = time.perf_counter() - t0
    return tokens / dt, (sum(accepts) / len(accepts) if accepts else None), eng.workers


def run_hf(model, tokenizer, prompts, batch, max_tokens):
    tokens, t0 = 0, time.perf_counter()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        L = max(len(p) for p in chunk)
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk])
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        tokens += (out.shape[1] - L) * len(chunk)
    return tokens / (time.perf_counter() - t0)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="kestrel bench offline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", nargs="?", default="offline", choices=["offline"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--set", action="append", default=[], help="config override for Kestrel")
    ap.add_argument("--spec-set", action="append", default=None,
                    help="also run speculative with these draft overrides (e.g. draft.path=DIR)")
    ap.add_argument("--repeats", type=int, default=1, help="alternate plain and spec runs this many times")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--data", default=str(DATA))
    args = ap.parse_args(argv)

    from actors.models.loader import default_model_path
    from configs.schema import load_config
    from serve_app.text.tokenizer import apply_chat_template, load_tokenizer

    path = default_model_path()
    base = [f"model.dtype={args.dtype}", "kv_cache.num_slots=16384"] + args.set
    cfg = load_config(overrides=base + ["draft.enabled=false"])  # the plain column
    tok = load_tokenizer(path)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}])
               for q in load_questions(Path(args.data), args.num_prompts)]
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM
        from actors.worker.rank_worker import resolve_dtype
        dt = resolve_dtype(args.dtype, cfg.resolved_device())
        hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                                  gguf_file=os.path.basename(path),
                                                  dtype=dt).eval().to(cfg.resolved_device())
    rows = []
    workers = spec_workers = None
    scfg = None if args.spec_set is None else load_config(
        overrides=base + ["draft.enabled=true"] + args.spec_set)
    for b in args.batch_sizes:
        plain_runs, spec_runs, ratios, acc = [], [], [], None
        for _ in range(args.repeats):
            ours, _, workers = run_kestrel(cfg, tok, prompts, b, args.max_tokens, workers)
            plain_runs.append(ours)
            print(f"batch {b}: kestrel {ours:.1f} tok/s", file=sys.stderr, flush=True)
            if scfg is not None:
                spec, acc, spec_workers = run_kestrel(scfg, tok, prompts, b, args.max_tokens, spec_workers)
                spec_runs.append(spec)
                ratios.append(spec / ours)
                print(f"batch {b}: kestrel spec {spec:.1f} tok/s (accept {acc:.2f})", file=sys.stderr, flush=True)
        row = {"batch": b, "kestrel": statistics.median(plain_runs)}
        if spec_runs:
            row.update(spec=statistics.median(spec_runs), accept=acc, ratio=statistics.median(ratios),
                       ratios=ratios)
        if hf is not None:
            row["hf"] = run_hf(hf, tok, prompts, b, args.max_tokens)
            print(f"batch {b}: transformers {row['hf']:.1f} tok/s", file=sys.stderr, flush=True)
        rows.append(row)
    dev = cfg.resolved_device()
    print(f"\nmachine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, "
          f"device {dev}, torch {torch.__version__}, dtype {workers[0].dtype}, "
          f"{args.num_prompts} prompts x {args.max_tokens} tokens, greedy\n")
    head = "| batch | kestrel tok/s |" + (" spec tok/s | accept | spec/plain (median of pairs) |" if args.spec_set is not None else "") \
        + (" transformers tok/s | kestrel/transformers |" if hf is not None else "")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for r in rows:
        line = f"| {r['batch']} | {r['kestrel']:.1f} |"
        if "spec" in r:
            line += f" {r['spec']:.1f} | {r['accept']:.2f} | {r['ratio']:.2f} |"
        if "hf" in r:
            line += f" {r['hf']:.1f} | {r['kestrel'] / r['hf']:.2f} |"
        print(line)
    for r in rows:
        if len(r.get("ratios", [])) > 1:
            print(f"batch {r['batch']} spec/plain per pair: " + " ".join(f"{x:.2f}" for x in r["ratios"]))


if __name__ == "__main__":
    main()
