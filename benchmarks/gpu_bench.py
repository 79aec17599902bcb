"""GPU benchmark, one command on the GPU machine:

    python -m benchmarks.gpu_bench [--batch-sizes 1 8 32 64] [--max-tokens 256]
        [--backends torch_native triton flashinfer] [--draft PATH|random] [--out DIR]

SmolLM2-135M bf16, MT-bench first turns, greedy, ignore EOS. For each backend: plain and
speculative (chain and tree), eager and with CUDA graphs (backends that can be
captured); the shipped head unless --draft says otherwise; and Hugging
Face transformers `generate` on the same prompts in the same run as the peer. Reports
tokens/s, per-step wall times, mean accept length and ratios as a markdown table, and
the raw figures as JSON under --out.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.offline import DATA, load_questions

# The engine every GPU benchmark measures (kernel_census.py too): bf16, a KV pool far larger
# than any batch here needs, contexts up to 2048.
ENGINE = ["device=cuda", "model.dtype=bfloat16", "kv_cache.num_slots=200000", "model.max_model_len=2048"]
CHAIN = ["draft.topk=1", "draft.num_steps=3", "draft.num_draft_tokens=4"]
TREE = ["draft.topk=4", "draft.num_steps=5", "draft.num_draft_tokens=8"]


def spec_shape(name: str) -> list[str]:
    """'chain', 'tree', or 'K-S-N' (top-k, draft steps, draft tokens) -> config overrides."""
    if name in ("chain", "tree"):
        return CHAIN if name == "chain" else TREE
    try:
        k, s, n = (int(x) for x in name.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"spec shape {name!r}: use chain, tree or K-S-N, e.g. 8-6-16")
    return [f"draft.topk={k}", f"draft.num_steps={s}", f"draft.num_draft_tokens={n}"]


def bench_engine(cfg, tok, prompts, batch, max_tokens, workers=None, measure=contextlib.nullcontext):
    """One engine over `workers` (built when None): an 8-token warm-up generation of the
    prompts, then the timed one, inside `measure()` (a profiler, for instance)."""
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    eng = LLMEngine(cfg, tokenizer=tok, workers=workers)
    eng.generate(prompts[:batch], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
    torch.cuda.synchronize()
    step_times: dict[str, list[float]] = {}
    real_execute = eng.workers[0].execute

    def timed(plan):
        out = real_execute(plan)
        for k, v in out.timings.items():
            step_times.setdefault(k, []).append(v)
        return out
    eng.workers[0].execute = timed
    with measure():
        t0 = time.perf_counter()
        reqs = eng.generate(prompts[:batch], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        dt = time.perf_counter() - t0
    eng.workers[0].execute = real_execute
    toks = sum(len(r.output_ids) for r in reqs)
    acc = [a for r in reqs for a in r.accept_lengths]
    return {"tok_s": toks / dt, "seconds": dt,
            "accept": sum(acc) / len(acc) if acc else None, "iterations": len(acc),
            "accepted": sum(acc),
            "step_ms": {k: 1000 * sum(v) / len(v) for k, v in step_times.items()},
            "outputs": [r.output_ids for r in reqs]}, eng.workers


def bench_one_at_a_time(cfg, tok, prompts, max_tokens, workers=None):
    """Batch 1 over several prompts, one after another: one prompt's accept length says
    little about a head. Tokens/s over all of them; accept = mean over all iterations."""
    toks = secs = iters = accepted = 0
    step_ms: dict[str, list[float]] = {}
    for p in prompts:
        r, workers = bench_engine(cfg, tok, [p], 1, max_tokens, workers)
        toks, secs = toks + sum(len(o) for o in r["outputs"]), secs + r["seconds"]
        iters, accepted = iters + r["iterations"], accepted + r["accepted"]
        for k, v in r["step_ms"].items():
            step_ms.setdefault(k, []).append(v)
    return {"tok_s": toks / secs, "seconds": secs, "accept": accepted / iters if iters else None,
            "step_ms": {k: sum(v) / len(v) for k, v in step_ms.items()},
            "prompts": len(prompts), "outputs": None}, workers


def bench_hf(path, tok, prompts, batch, max_tokens):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.bfloat16).cuda().eval()
    chunk = prompts[:batch]
    L = max(len(p) for p in chunk)
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in chunk]).cuda()
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in chunk]).cuda()
    kw = dict(attention_mask=mask, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
              do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        model.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"tok_s": (out.shape[1] - L) * len(chunk) / dt, "seconds": dt}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--backends", nargs="+", default=["torch_native", "triton", "flashinfer"])
    ap.add_argument("--draft", default=None, help="head folder or 'random' (default: the shipped head)")
    ap.add_argument("--spec-shapes", nargs="*", default=["chain", "tree"],
                    help="chain, tree or K-S-N (top-k, steps, draft tokens); none: plain only")
    ap.add_argument("--spec-batch-sizes", type=int, nargs="+", default=None,
                    help="batch sizes for the speculative variant (default: --batch-sizes)")
    ap.add_argument("--modes", nargs="+", choices=["eager", "graphs"], default=["eager", "graphs"])
    ap.add_argument("--set", action="append", default=[], help="config override for every variant")
    ap.add_argument("--b1-prompts", type=int, default=1,
                    help="batch 1 runs this many prompts one after another (default 1)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args(argv)
    for sh in args.spec_shapes:
        try:
            spec_shape(sh)
        except argparse.ArgumentTypeError as e:
            ap.error(str(e))

    from actors.models.loader import default_model_path
    from configs.schema import load_config
    from serve_app.text.tokenizer import apply_chat_template, load_tokenizer
    path = default_model_path()
    tok = load_tokenizer(path)
    n = max(*args.batch_sizes, args.b1_prompts)
    qs = load_questions(Path(DATA), 80)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": qs[i % len(qs)]}]) for i in range(n)]
    base = [*ENGINE, "profile_steps=true", f"scheduler.max_running_requests={max(64, n)}", *args.set]
    draft = [f"draft.path={args.draft}"] if args.draft else []
    results = []
    for backend in args.backends:
        modes = [("eager", "attention.cuda_graphs=false")]
        if backend != "torch_native":
            modes.append(("graphs", "attention.cuda_graphs=true"))
        modes = [(m, g) for m, g in modes if m in args.modes]
        variants = [(f"plain {m}", [g, "draft.enabled=false"]) for m, g in modes]
        variants += [(f"spec {sh} {m}", [g, "draft.enabled=true", *draft, *spec_shape(sh)])
                     for sh in args.spec_shapes for m, g in modes]
        for name, ov in variants:
            try:
                cfg = load_config(overrides=base + [f"attention.backend={backend}"] + ov)
            except Exception as e:
                print(f"{backend} {name}: skipped ({e})", file=sys.stderr)
                continue
            workers = None
            sizes = args.batch_sizes
            if name.startswith("spec") and args.spec_batch_sizes:
                sizes = args.spec_batch_sizes
            for b in sizes:
                try:
                    if b == 1 and args.b1_prompts > 1:
                        r, workers = bench_one_at_a_time(cfg, tok, prompts[:args.b1_prompts],
                                                         args.max_tokens, workers)
                    else:
                        r, workers = bench_engine(cfg, tok, prompts, b, args.max_tokens, workers)
                except Exception as e:  # one broken variant must not lose the others' figures
                    print(f"{backend} {name} batch {b}: FAILED {type(e).__name__}: {e}", file=sys.stderr)
                    break
                r.update(backend=backend, variant=name, batch=b)
                results.append(r)
                print(f"{backend:12s} {name:14s} batch {b:3d}: {r['tok_s']:8.1f} tok/s  "
                      f"steps {r['step_ms']}  accept {r['accept']}", file=sys.stderr, flush=True)
            del workers
            torch.cuda.empty_cache()
    if not args.skip_hf:
        for b in args.batch_sizes:
            r = bench_hf(path, tok, prompts, b, args.max_tokens)
            r.update(backend="transformers", variant="generate", batch=b)
            results.append(r)
            print(f"transformers batch {b}: {r['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    # greedy agreement between variants (bf16: report, not assert)
    ref = {r["batch"]: r["outputs"] for r in results if r.get("variant") == "plain eager"
           and r["backend"] == args.backends[0]}
    for r in results:
        if r.get("outputs") and r["batch"] in ref and ref[r["batch"]]:
            same = sum(a == b for x, y in zip(r["outputs"], ref[r["batch"]]) for a, b in zip(x, y))
            total = sum(len(x) for x in ref[r["batch"]])
            r["token_agreement"] = same / total if total else None
    Path(args.out).mkdir(parents=True, exist_ok=True)
    with open(Path(args.out) / "gpu_bench.json", "w") as f:
        json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in results], f, indent=1)
    hf = {r["batch"]: r["tok_s"] for r in results if r["backend"] == "transformers"}
    plain = {(r["backend"], r["variant"].split()[-1], r["batch"]): r["tok_s"] for r in results
             if r["variant"].startswith("plain")}
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.max_tokens} new tokens, greedy\n")
    print("| backend | variant | batch | tok/s | vs plain (same mode) | vs transformers | accept | step ms | agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        pe = plain.get((r["backend"], r["variant"].split()[-1], r["batch"]))
        print(f"| {r['backend']} | {r['variant']} | {r['batch']} | {r['tok_s']:.1f} | "
              f"{r['tok_s'] / pe:.2f} | " if pe else f"| {r['backend']} | {r['variant']} | {r['batch']} | {r['tok_s']:.1f} | - | ",
              end="")
        h = hf.get(r["batch"])
        steps = ", ".join(f"{k} {v:.2f}" for k, v in r.get("step_ms", {}).items())
        acc = f"{r['accept']:.2f}" if r.get("accept") else "-"
        agree = f"{r['token_agreement']:.3f}" if r.get("token_agreement") is not None else "-"
        print(f"{r['tok_s'] / h:.2f} | " if h else "- | ", end="")
        print(f"{acc} | {steps} | {agree} |")


if __name__ == "__main__":
    main()
