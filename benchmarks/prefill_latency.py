"""Prefill latency of one short prompt, with and without prefill graphs (GPU machine):

    python -m benchmarks.prefill_latency [--config configs/h200.yaml] [--prompts 10] [--out DIR]

The first turns of MT-bench with the chat template, each prefilled alone with the prefix
cache off (every prompt token computed), one output token. Reports per prompt length the
worker's prefill step (host time of `execute`, which ends by reading the token back, so
it is the GPU's time too) and the in-process time to first token, p50 over the prompts,
alone and eight at once, for `attention.prefill_graph_tokens` at its default and off.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
from pathlib import Path

from benchmarks.offline import DATA, load_questions


def measure(config: str | None, overrides: list[str], questions: list[str], rounds: int) -> dict:
    import torch

    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template
    eng = LLMEngine(load_config(config, ["kv_cache.prefix_caching=false", "kv_cache.num_slots=65536",
                                         *overrides]))
    prompts = [apply_chat_template(eng.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    worker = eng.workers[0]
    real = worker.execute
    steps: list[float] = []

    def timed(plan):
        out = real(plan)
        if plan.mode == "extend":
            steps.append(out.timings["extend"])
        return out

    worker.execute = timed
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    eng.generate(prompts[:1], one)  # warm-up
    steps.clear()
    ttft = []
    for _ in range(rounds):
        for p in prompts:
            r = eng.generate([p], one)[0]
            ttft.append(r.first_token_time - r.arrival)
    single = list(steps)
    steps.clear()
    burst = []
    for _ in range(rounds):  # eight prompts arriving together: one prefill step
        reqs = eng.generate(prompts[:8], one)
        burst += [r.first_token_time - r.arrival for r in reqs]
    graphs = worker.prefill_graphs
    out = {"burst8_prefill_ms_p50": 1000 * statistics.median(steps),
           "burst8_ttft_ms_p50": 1000 * statistics.median(burst),"prompt_tokens_p50": statistics.median(len(p) for p in prompts),
           "prefill_ms_p50": 1000 * statistics.median(single),
           "prefill_ms_min": 1000 * min(single),
           "ttft_ms_p50": 1000 * statistics.median(ttft),
           "graph_shapes": len(graphs.shapes) if graphs else 0}
    del eng, worker, real
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/h200.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--prompts", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    questions = load_questions(DATA, args.prompts)
    results = {}
    for name, extra in (("graphs", []), ("eager", ["attention.prefill_graph_tokens=[]"])):
        print(f"prefill latency: {name} ...", file=sys.stderr, flush=True)
        results[name] = measure(args.config, args.overrides + extra, questions, args.rounds)
    print("| prefill | prompt tokens p50 | one prompt: prefill step ms p50 (min) | TTFT ms p50 | "
          "eight at once: prefill step ms p50 | TTFT ms p50 |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} ({r['graph_shapes']} shapes) | {r['prompt_tokens_p50']:.0f} | "
              f"{r['prefill_ms_p50']:.2f} ({r['prefill_ms_min']:.2f}) | {r['ttft_ms_p50']:.2f} | "
              f"{r['burst8_prefill_ms_p50']:.2f} | {r['burst8_ttft_ms_p50']:.2f} |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefill_latency.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
