"""How much of an `ignore_eos` benchmark run comes after the answers' EOS:

    python -m benchmarks.answer_lengths [--config configs/h200.yaml] [--prompts 64]
        [--caps 256 1024] [--set KEY=VALUE ...]

The MT-bench first turns with the chat template, greedy, plain, stopping at EOS. The
benchmarks run with `ignore_eos`, and after its EOS a stream's text depends on whether a
grammar masks EOS (it does for the never-ending regex), so runs with and without the
grammar decode different texts there and, under speculation, accept differently. Prints
the answer lengths and, per cap, how many answers end before it and what share of an
`ignore_eos` run's tokens come after an EOS.
"""
from __future__ import annotations

import argparse
import sys
import time

from benchmarks.offline import DATA, load_questions


def after_eos(lengths: list[int], cap: int) -> tuple[int, float]:
    """-> (answers shorter than cap, share of cap * len(lengths) tokens after their EOS)."""
    return sum(n < cap for n in lengths), sum(max(0, cap - n) for n in lengths) / (cap * len(lengths))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--caps", type=int, nargs="+", default=[256, 1024])
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template
    cap = max(args.caps)
    cfg = load_config(args.config, ["draft.enabled=false", f"scheduler.max_running_requests={args.prompts}",
                                    *args.set])
    eng = LLMEngine(cfg)
    prompts = [apply_chat_template(eng.tokenizer, [{"role": "user", "content": q}])
               for q in load_questions(DATA, args.prompts)]
    print(f"{len(prompts)} answers of up to {cap} tokens ...", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    lengths = sorted(len(r.output_ids) for r in eng.generate(prompts, SamplingParams(max_tokens=cap)))
    print(f"generated in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print("answer lengths:", lengths)
    for c in args.caps:
        ended, share = after_eos(lengths, c)
        print(f"max_tokens {c}: {ended} of {len(lengths)} answers end before it; "
              f"{share:.0%} of an ignore_eos run's tokens come after an answer's EOS")


if __name__ == "__main__":
    main()
