"""What a sampling feature costs, in-process on the GPU machine:

    python -m benchmarks.feature_cost [--config configs/h200.yaml] [--batch-sizes 1 64]
        [--max-tokens 256] [--out DIR]

MT-bench first turns with the chat template, greedy, `ignore_eos`, at each batch size:
tokens/s plain and speculative (the preset's tree), without any feature, then with each:
the penalties and a logit bias, 5 logprobs per token, and a grammar (a regex that allows
nearly any text, so acceptance stays comparable and the figure is the masking's own cost).
Features that change the logits take the per-phase speculative path instead of the
one-graph greedy iteration. Prints a markdown table; JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.offline import DATA, load_questions

FEATURES = {
    "none": {},
    "penalties": dict(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1,
                      logit_bias={13: -2.0}),
    "logprobs": dict(logprobs=5),
    "grammar": ("regex", r"[^\x00]*"),  # compiled for the engine's tokenizer in run()
}


def run(config: str, overrides: list[str], prompts_text: list[str], batches: list[int],
        max_tokens: int) -> dict:
    from configs.schema import load_config
    from serve_app.grammar import compiler_for
    from serve_app.llm_engine import LLMEngine
    from serve_app.request import SamplingParams
    from serve_app.tokenizer import apply_chat_template
    eng = LLMEngine(load_config(config, overrides))
    prompts = [apply_chat_template(eng.tokenizer, [{"role": "user", "content": q}]) for q in prompts_text]
    out = {}
    for feature, extra in FEATURES.items():
        if isinstance(extra, tuple):
            extra = dict(grammar=compiler_for(eng.tokenizer).compile(extra))
        for b in batches:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)
            eng.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True, **extra))  # warm-up
            t0 = time.perf_counter()
            reqs = eng.generate(batch, params)
            secs = time.perf_counter() - t0
            out[f"{feature}/{b}"] = sum(len(r.output_ids) for r in reqs) / secs
            print(f"{overrides or 'preset'} {feature} batch {b}: {out[f'{feature}/{b}']:.0f} tok/s",
                  file=sys.stderr, flush=True)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/h200.yaml")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    qs = load_questions(DATA, 80)
    results = {"spec": run(args.config, [], qs, args.batch_sizes, args.max_tokens),
               "plain": run(args.config, ["draft.enabled=false"], qs, args.batch_sizes, args.max_tokens)}
    with_ = [f for f in FEATURES if f != "none"]
    print("| engine | batch | tok/s without | " + " | ".join(f"with {f} (ratio)" for f in with_) + " |")
    print("|---|---|---|" + "---|" * len(with_))
    for name, r in results.items():
        for b in args.batch_sizes:
            a = r[f"none/{b}"]
            cells = " | ".join(f"{r[f'{f}/{b}']:.0f} ({r[f'{f}/{b}'] / a:.2f})" for f in with_)
            print(f"| {name} | {b} | {a:.0f} | {cells} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "feature_cost.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
