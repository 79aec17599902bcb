"""Kestrel's default config against llama.cpp on the same GGUF, the same prompts, one run.

    python -m benchmarks.cpu_vs_llamacpp [--num-prompts 8] [--max-tokens 64] [--repeats 2]
        [--batch-sizes 1 8 32] [--threads 2] [--llama-cpp-path DIR] [--set KEY=VALUE ...]
        [--baseline-set model.cpu_weights=float ...] [--json out.json]

Batch 1: Kestrel's in-process engine (configs/default.yaml plus --set) and llama.cpp
(llama-cpp-python, `pip install '.[bench-llamacpp]'`, or built elsewhere and named with
--llama-cpp-path) generate the first --max-tokens greedy tokens (EOS ignored) of each
prompt, one prompt at a time, alternating per round, so a shared machine's load falls on
both; tok/s counts output tokens over wall time, prefill included. It prints both, their
ratio per round and the median, and how many of each prompt's first tokens agree.
Batch > 1 (llama-cpp-python serves one sequence at a time): Kestrel's default against
Kestrel with --baseline-set (by default the float weights of before model.cpu_weights),
alternating the same way, one batch of that many prompts.
Prompts: MT-bench first turns with the chat template, token ids shared by both.
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

from benchmarks.offline import DATA, load_questions


def import_llama_cpp(extra_path: str | None):
    """llama_cpp, from the environment or from `extra_path` (a pip --target folder, put
    last on sys.path so its own copies of numpy and friends do not shadow ours)."""
    if extra_path:
        sys.path.append(extra_path)
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama-cpp-python is not importable: pip install '.[bench-llamacpp]' "
                         "or pass --llama-cpp-path") from None
    return llama_cpp


class LlamaCpp:
    def __init__(self, llama_cpp, path: str, threads: int, n_ctx: int):
        self.llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads,
                                   n_ctx=n_ctx, n_batch=512, verbose=False)
        self.version = llama_cpp.__version__

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Greedy ids, EOS ignored (llama.cpp's own greedy sampler: temp 0)."""
        self.llm.reset()  # no prefix reuse across prompts: each pays its prefill
        out = []
        for tok in self.llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            out.append(int(tok))
            if len(out) == max_tokens:
                break
        return out


def run_llamacpp(ll: LlamaCpp, prompts, max_tokens) -> tuple[float, list[list[int]]]:
    t0, outs = time.perf_counter(), []
    for p in prompts:
        outs.append(ll.generate(p, max_tokens))
    return sum(map(len, outs)) / (time.perf_counter() - t0), outs


def run_kestrel(engine, prompts, batch, max_tokens) -> tuple[float, list[list[int]], float]:
    from serve_app.engine.request import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0, outs, accepts = time.perf_counter(), [], []
    for i in range(0, len(prompts), batch):
        for r in engine.generate(prompts[i:i + batch], params):
            outs.append(list(r.output_ids))
            accepts += r.accept_lengths
    dt = time.perf_counter() - t0
    return sum(map(len, outs)) / dt, outs, (sum(accepts) / len(accepts) if accepts else 0.0)


def agreement(ours: list[list[int]], theirs: list[list[int]], n: int) -> dict:
    """Per prompt, how many of the first n tokens agree before the first difference."""
    prefix = []
    for a, b in zip(ours, theirs):
        k = 0
        while k < min(n, len(a), len(b)) and a[k] == b[k]:
            k += 1
        prefix.append(k)
    return {"exact_prompts": sum(k == n for k in prefix) / len(prefix),
            "matching_prefix": sum(prefix) / (n * len(prefix)), "prefix_lengths": prefix}


def make_engine(overrides: list[str], tokenizer):
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    t0 = time.perf_counter()
    eng = LLMEngine(load_config(overrides=overrides), tokenizer=tokenizer)
    eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    return eng, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_vs_llamacpp", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    ap.add_argument("--llama-cpp-path", default=None)
    ap.add_argument("--set", action="append", default=[], help="config override for Kestrel")
    ap.add_argument("--baseline-set", action="append", default=None,
                    help="the batch > 1 baseline's overrides (default: model.cpu_weights=float)")
    ap.add_argument("--data", default=str(DATA))
    ap.add_argument("--json", default=None, help="write every figure here")
    args = ap.parse_args(argv)

    from actors.models.loader import default_model_path
    from serve_app.text.tokenizer import apply_chat_template, load_tokenizer

    path = default_model_path()
    tok = load_tokenizer(path)
    most = max([args.num_prompts] + args.batch_sizes)
    prompts = [apply_chat_template(tok, [{"role": "user", "content": q}])
               for q in load_questions(Path(args.data), most)]
    engine, load_s = make_engine(args.set, tok)
    w = engine.workers[0]
    report: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} cpus", "torch": torch.__version__,
                    "gguf": os.path.basename(path), "kestrel_set": args.set,
                    "kestrel_threads": torch.get_num_threads(), "cpu_weights": w.cpu_weights,
                    "max_tokens": args.max_tokens, "kestrel_load_s": round(load_s, 1), "rows": []}
    print(f"Kestrel: default config {args.set or ''}, cpu_weights {w.cpu_weights}, dtype {w.dtype}, "
          f"{torch.get_num_threads()} threads, loaded and warm in {load_s:.1f}s", file=sys.stderr)

    if 1 in args.batch_sizes:
        ll = LlamaCpp(import_llama_cpp(args.llama_cpp_path), path, args.threads,
                      n_ctx=max(map(len, prompts)) + args.max_tokens + 16)
        report["llama_cpp"] = ll.version
        ll.generate(prompts[0], 4)  # warm-up
        batch1 = prompts[:args.num_prompts]
        ours, theirs, ratios, agree = [], [], [], None
        for rnd in range(args.repeats):
            k, k_out, acc = run_kestrel(engine, batch1, 1, args.max_tokens)
            l, l_out = run_llamacpp(ll, batch1, args.max_tokens)
            ours.append(k), theirs.append(l), ratios.append(k / l)
            agree = agreement(k_out, l_out, args.max_tokens)
            print(f"round {rnd}: kestrel {k:.1f} tok/s (accept {acc:.2f}), llama.cpp {l:.1f} tok/s, "
                  f"ratio {k / l:.2f}", file=sys.stderr, flush=True)
        report["rows"].append({"batch": 1, "kestrel": ours, "llama_cpp": theirs, "ratios": ratios,
                               "ratio_median": statistics.median(ratios), "agreement": agree})
        del ll

    base_engine = None
    for b in [b for b in args.batch_sizes if b > 1]:
        if base_engine is None:
            base_engine, _ = make_engine(args.set + (args.baseline_set or ["model.cpu_weights=float"]), tok)
        ours, theirs, ratios = [], [], []
        for rnd in range(args.repeats):
            k, _, _ = run_kestrel(engine, prompts[:b], b, args.max_tokens)
            base, _, _ = run_kestrel(base_engine, prompts[:b], b, args.max_tokens)
            ours.append(k), theirs.append(base), ratios.append(k / base)
            print(f"batch {b} round {rnd}: kestrel {k:.1f} tok/s, baseline {base:.1f} tok/s, "
                  f"ratio {k / base:.2f}", file=sys.stderr, flush=True)
        report["rows"].append({"batch": b, "kestrel": ours, "baseline": theirs, "ratios": ratios,
                               "ratio_median": statistics.median(ratios),
                               "baseline_set": args.baseline_set or ["model.cpu_weights=float"]})

    print(f"\n{report['machine']}, torch {report['torch']}, llama-cpp-python "
          f"{report.get('llama_cpp', '-')} ({args.threads} threads), {report['gguf']}, "
          f"greedy, {args.max_tokens} tokens, {args.repeats} alternating rounds\n")
    print("| batch | kestrel tok/s | other | other tok/s | kestrel/other (median of rounds) | rounds |")
    print("|---|---|---|---|---|---|")
    for r in report["rows"]:
        other = "llama.cpp" if r["batch"] == 1 else "kestrel " + " ".join(r["baseline_set"])
        theirs = r.get("llama_cpp", r.get("baseline"))
        print(f"| {r['batch']} | {statistics.median(r['kestrel']):.1f} | {other} | "
              f"{statistics.median(theirs):.1f} | {r['ratio_median']:.2f} | "
              f"{' '.join(f'{x:.2f}' for x in r['ratios'])} |")
    for r in report["rows"]:
        if "agreement" in r:
            a = r["agreement"]
            print(f"\ngreedy agreement with llama.cpp over the first {args.max_tokens} tokens: "
                  f"{a['exact_prompts']:.0%} of prompts identical, {a['matching_prefix']:.0%} of "
                  f"tokens before the first difference (per prompt: {a['prefix_lengths']})")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
