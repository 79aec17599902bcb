"""Kernel census (GPU): how many kernels a decode step or a speculative iteration
launches, and where its GPU time goes, per kernel name.

Plain and speculative (the shipped head, tree K=4 S=5 N=8 unless --shape), each with CUDA
graphs and eagerly (--variants picks). --config runs another model (a 7B shape's preset
builds random weights), --batch more streams, --prompt-words a longer context. torch.profiler's CUPTI tracing sees the kernels inside graph
replays. One MT-bench prompt, 128 new tokens after a 64-token warm-up generation; counts
are per step (plain) or per speculative iteration, and include bench_engine's own
8-token warm-up (hence the 136/128 factor; with --decode-only the profile starts after the
warm-up, whose prompts the prefix cache then holds: decode steps alone). Profiling slows the host side, so tokens/s
here are not benchmark figures (benchmarks/gpu_bench.py gives those).

    python -m benchmarks.kernel_census --out OUT [--draft DIR] [--shape tree|chain|K-S-N]
    python -m benchmarks.kernel_census --out OUT --config configs/h200-7b.yaml \
        --variants plain_graphs --batch 1 64 --prompt-words 750 [--decode-only] [--set k=v ...]

Writes OUT/<variant>.txt (the top 80 kernel names by GPU time) and OUT/summary.json.
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from benchmarks.gpu_bench import ENGINE, bench_engine, spec_shape
from benchmarks.http_bench import long_prompt
from benchmarks.offline import DATA, load_questions

MAX_TOKENS = 128
WARMUP_TOKENS = 8  # bench_engine's own warm-up generation, inside the profiled call


def census(prof, steps: float) -> tuple[collections.Counter, collections.Counter]:
    """Kernel launches and GPU microseconds per step, by kernel name."""
    count, micros = collections.Counter(), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            count[e.name] += 1 / steps
            micros[e.name] += e.device_time_total / steps
    return count, micros


VARIANTS = ("plain_graphs", "spec_graphs", "plain_eager", "spec_eager")


def main(argv=None):
    from torch.profiler import ProfilerActivity, profile

    from actors.models.loader import default_model_path
    from configs.schema import load_config
    from serve_app.text.tokenizer import apply_chat_template, load_tokenizer
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="head folder (default: the shipped head)")
    ap.add_argument("--shape", default="tree", help="chain, tree or K-S-N")
    ap.add_argument("--config", default=None, help="a preset (default: SmolLM2 on the GPU)")
    ap.add_argument("--set", action="append", default=[], help="config override for every variant")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    ap.add_argument("--batch", type=int, nargs="+", default=[1], help="streams decoding together")
    ap.add_argument("--prompt-words", type=int, default=0, help="pad each prompt to about this many words")
    ap.add_argument("--decode-only", action="store_true",
                    help="profile the timed generation alone, after the warm-up has put its prompts "
                         "in the prefix cache: decode steps without the prefill chunks")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.config:
        base = list(args.set)
        model_path = load_config(args.config, overrides=base).model.path
    else:
        base = [*ENGINE, "attention.backend=triton", "scheduler.max_running_requests=64", *args.set]
        model_path = default_model_path()
    tok = load_tokenizer(model_path)
    questions = load_questions(Path(DATA), max(args.batch) + 1)[1:]
    if args.prompt_words:
        questions = [long_prompt(questions, i, args.prompt_words) for i in range(len(questions))]
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in questions]
    spec = ["draft.enabled=true", *spec_shape(args.shape)]
    if args.draft:
        spec.append(f"draft.path={args.draft}")
    overrides = {"plain_graphs": ["draft.enabled=false", "attention.cuda_graphs=true"],
                 "spec_graphs": [*spec, "attention.cuda_graphs=true"],
                 "plain_eager": ["draft.enabled=false", "attention.cuda_graphs=false"],
                 "spec_eager": [*spec, "attention.cuda_graphs=false"]}
    summary = {}
    for variant in args.variants:
        cfg = load_config(args.config, overrides=base + overrides[variant])
        if args.decode_only and not cfg.kv_cache.prefix_caching:
            ap.error("--decode-only needs kv_cache.prefix_caching: the warm-up's prompts must be "
                     "cached for the profiled generation to skip their prefill")
        workers = None
        for batch in args.batch:
            name = variant.replace("spec", args.shape) + (f"_b{batch}" if args.batch != [1] else "")
            _, workers = bench_engine(cfg, tok, prompts, batch, 64, workers)  # load, capture, compile
            prof = profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])
            if args.decode_only:
                r, _ = bench_engine(cfg, tok, prompts, batch, MAX_TOKENS, workers, measure=lambda: prof)
            else:
                with prof:
                    r, _ = bench_engine(cfg, tok, prompts, batch, MAX_TOKENS, workers)
            scale = 1 if args.decode_only else (MAX_TOKENS + WARMUP_TOKENS) / MAX_TOKENS
            iterations = r["iterations"] / batch  # accept lengths are per request
            steps = iterations * scale if iterations else MAX_TOKENS + WARMUP_TOKENS
            count, micros = census(prof, steps)
            lines = [f"{name}: tok/s {r['tok_s']:.1f} accept {r['accept']} steps {steps} step_ms {r['step_ms']}",
                     f"kernels/step {sum(count.values()):.1f}  gpu us/step {sum(micros.values()):.1f}"]
            for k in sorted(count, key=lambda k: -micros[k])[:80]:
                lines.append(f"{count[k]:8.2f}/step {micros[k]:9.2f}us/step "
                             f"{micros[k] / count[k]:7.2f}us  {k[:150]}")
            (out / f"{name}.txt").write_text("\n".join(lines))
            print("\n".join(lines[:2]), flush=True)
            summary[name] = {"kernels_per_step": sum(count.values()), "gpu_us_per_step": sum(micros.values()),
                             "tok_s": r["tok_s"], "accept": r["accept"], "step_ms": r["step_ms"]}
        del workers
        torch.cuda.empty_cache()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
