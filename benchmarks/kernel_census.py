"""Kernel census at batch 1 (GPU): how many kernels a decode step or a speculative
iteration launches, and where its GPU time goes, per kernel name.

Plain and speculative (the shipped head, tree K=4 S=5 N=8 unless --shape), each with CUDA
graphs and eagerly. torch.profiler's CUPTI tracing sees the kernels inside graph
replays. One MT-bench prompt, 128 new tokens after a 64-token warm-up generation; counts
are per step (plain) or per speculative iteration, and include bench_engine's own
8-token warm-up (hence the 136/128 factor). Profiling slows the host side, so tokens/s
here are not benchmark figures (benchmarks/gpu_bench.py gives those).

    python -m benchmarks.kernel_census --out OUT [--draft DIR] [--shape tree|chain|K-S-N]

Writes OUT/<variant>.txt (the top 80 kernel names by GPU time) and OUT/summary.json.
"""
from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch

from benchmarks.gpu_bench import ENGINE, bench_engine, spec_shape
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


def main(argv=None):
    from torch.profiler import ProfilerActivity, profile

    from actors.models.loader import default_model_path
    from configs.schema import load_config
    from serve_app.text.tokenizer import apply_chat_template, load_tokenizer
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=None, help="head folder (default: the shipped head)")
    ap.add_argument("--shape", default="tree", help="chain, tree or K-S-N")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = load_tokenizer(default_model_path())
    question = load_questions(Path(DATA), 2)[1]
    prompt = [apply_chat_template(tok, [{"role": "user", "content": question}])]
    base = [*ENGINE, "attention.backend=triton", "scheduler.max_running_requests=64"]
    spec = ["draft.enabled=true", *spec_shape(args.shape)]
    if args.draft:
        spec.append(f"draft.path={args.draft}")
    summary = {}
    for name, overrides in [("plain_graphs", ["draft.enabled=false", "attention.cuda_graphs=true"]),
                            (f"{args.shape}_graphs", [*spec, "attention.cuda_graphs=true"]),
                            ("plain_eager", ["draft.enabled=false", "attention.cuda_graphs=false"]),
                            (f"{args.shape}_eager", [*spec, "attention.cuda_graphs=false"])]:
        cfg = load_config(overrides=base + overrides)
        _, workers = bench_engine(cfg, tok, prompt, 1, 64, None)  # load, capture, compile
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            r, _ = bench_engine(cfg, tok, prompt, 1, MAX_TOKENS, workers)
        scale = (MAX_TOKENS + WARMUP_TOKENS) / MAX_TOKENS
        steps = r["iterations"] * scale if r["iterations"] else MAX_TOKENS + WARMUP_TOKENS
        count, micros = census(prof, steps)
        lines = [f"{name}: tok/s {r['tok_s']:.1f} accept {r['accept']} steps {steps} step_ms {r['step_ms']}",
                 f"kernels/step {sum(count.values()):.1f}  gpu us/step {sum(micros.values()):.1f}"]
        for k in sorted(count, key=lambda k: -micros[k])[:80]:
            lines.append(f"{count[k]:8.2f}/step {micros[k]:9.2f}us/step "
                         f"{micros[k] / count[k]:7.2f}us  {k[:150]}")
        (out / f"{name}.txt").write_text("\n".join(lines))
        print("\n".join(lines[:2]), flush=True)
        summary[name] = {"kernels_per_step": sum(count.values()), "gpu_us_per_step": sum(micros.values()),
                         "tok_s": r["tok_s"], "accept": r["accept"]}
        del workers
        torch.cuda.empty_cache()
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
