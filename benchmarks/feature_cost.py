"""What a sampling feature costs, in-process on the GPU machine:

    python -m benchmarks.feature_cost [--config configs/h200.yaml] [--batch-sizes 1 64]
        [--max-tokens 256] [--out DIR] [--repeats R] [--set KEY=VALUE ...]
        [--tiny-model [--count-ops]] [--timeline DIR]

MT-bench first turns with the chat template, greedy, `ignore_eos`, at each batch size:
tokens/s plain and speculative (the preset's tree), without any feature, then with each:
the penalties and a logit bias, 5 logprobs per token, a grammar (a regex that allows
nearly any text and never ends, so acceptance stays comparable and the figure is the
masking's own cost),
and seeded sampling as users mostly ask for it (temperature 0.7, top-p 0.9).
Batches with processing, logprobs or sampling replay the processed / logprobs / sampled
variants of the decode and step graphs, grammar batches the step graph's three parts with
the masks walked between them (`--set attention.feature_graphs=false`: the eager paths
instead).
Prints a markdown table (tokens/s, and milliseconds per step); JSON under --out.
--timeline DIR profiles one more run of each cell: where the GPU sits idle in a step.

--tiny-model runs on the CPU: a random 1-layer model with SmolLM2's tokenizer
(benchmarks/http_bench.py), a random draft head in the h200 preset's tree shape, and the
graphs' eager stand-ins (the same bodies the CUDA graphs record, run op by op), so what
each feature adds to a step's host work shows without a GPU.
"""
from __future__ import annotations

import argparse
import gc
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
    # Any text up to a control character the model never writes: every token is masked to
    # the end (a grammar that may end, as [^\x00]* did, masks nothing after the answer's EOS:
    # 19% of the tokens of 64 MT-bench answers at 256 with ignore_eos). Compiled for the
    # engine's tokenizer in run().
    "grammar": ("regex", r"[^\x01]*\x01"),
    "sampled": dict(temperature=0.7, top_p=0.9, seed=1),
}


# --tiny-model: the CPU, one thread (a shared machine), the h200 preset's tree.
TINY = ["device=cpu", "cpu_threads=1", "model.dtype=float32", "draft.path=random", "draft.topk=4",
        "draft.num_steps=5", "draft.num_draft_tokens=8", "kv_cache.num_slots=65536",
        "scheduler.max_running_requests=64", "model.max_model_len=1024"]
GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64]


def cpu_graphs(eng) -> None:
    """The graphs' eager stand-ins on every rank (attention.cuda_graphs needs CUDA)."""
    for w in eng.workers:
        w.capture_decode_graphs(GRAPH_SIZES)
        if w.eagle is not None:
            w.eagle.capture_graphs(GRAPH_SIZES)


def run(config: str, overrides: list[str], prompts_text: list[str], batches: list[int],
        max_tokens: int, stand_in_graphs: bool = False, count_ops: bool = False,
        repeats: int = 1, features: list[str] | None = None, timeline: str | None = None) -> dict:
    from actors.worker.gc_pauses import frozen_heap, watch
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    eng = LLMEngine(load_config(config, overrides))
    if stand_in_graphs:
        cpu_graphs(eng)
    try:
        with frozen_heap("feature_cost", eng.cfg.serve.gc_freeze):
            return _cells(eng, watch(), overrides, prompts_text, batches, max_tokens, count_ops,
                          repeats, features, timeline)
    finally:
        del eng  # and its KV cache and graphs with it, before the next engine loads
        gc.collect()


def _cells(eng, gc_pauses, overrides: list[str], prompts_text: list[str], batches: list[int],
           max_tokens: int, count_ops: bool, repeats: int, features: list[str] | None,
           timeline: str | None) -> dict:
    """Each feature at each batch size on `eng` -> tok/s, ms per step, GC seconds (and
    ops, timelines) by "feature/batch[/what]"."""
    from serve_app.text.grammar import compiler_for
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template
    prompts = [apply_chat_template(eng.tokenizer, [{"role": "user", "content": q}]) for q in prompts_text]
    out = {}
    for feature, extra in FEATURES.items():
        if features is not None and feature not in features:
            continue
        if isinstance(extra, tuple):
            extra = dict(grammar=compiler_for(eng.tokenizer).compile(extra))
        for b in batches:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **extra)
            eng.generate(batch, SamplingParams(max_tokens=8, ignore_eos=True, **extra))  # warm-up
            best = None
            for _ in range(repeats):  # the best of them: a shared machine only ever slows a run
                steps0, t0, _ = eng.steps, time.perf_counter(), gc_pauses.take_seconds()
                reqs = eng.generate(batch, params)
                secs = time.perf_counter() - t0
                if best is None or secs < best[0]:
                    best = secs, eng.steps - steps0, sum(len(r.output_ids) for r in reqs), gc_pauses.take_seconds()
            secs, steps, tokens, gc_s = best
            out[f"{feature}/{b}"] = tokens / secs
            out[f"{feature}/{b}/ms_per_step"] = 1000 * secs / steps
            out[f"{feature}/{b}/gc_s"] = gc_s
            engine = "plain" if "draft.enabled=false" in overrides else "spec"
            print(f"{engine} {feature} batch {b}: {out[f'{feature}/{b}']:.0f} tok/s, "
                  f"{out[f'{feature}/{b}/ms_per_step']:.2f} ms/step, GC {1000 * gc_s:.1f} ms", file=sys.stderr, flush=True)
            if timeline:
                out[f"{feature}/{b}/timeline"] = device_timeline(eng, batch, params, Path(timeline) / f"{engine}_{feature}_{b}.json")
            if count_ops:
                from benchmarks.step_ops import count_decode_ops
                with count_decode_ops(eng.workers) as c:
                    eng.generate(batch, SamplingParams(max_tokens=16, ignore_eos=True, **extra))
                out[f"{feature}/{b}/ops"] = c.ops / c.steps
    return out


def device_timeline(eng, batch: list, params, path: Path) -> dict:
    """One more run of the cell under torch.profiler: the device's busy and idle time per
    step and where the idle time sits (benchmarks/gpu_gaps.py), printed and written to
    `path`. Profiling slows the host, so the run's own speed is no figure."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.gpu_gaps import device_intervals, gaps, table
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    steps0 = eng.steps
    with profile(activities=activities) as prof:
        eng.generate(batch, params)
    summary = gaps(device_intervals(prof), eng.steps - steps0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=1))
    print(f"{path.stem}: {table(summary)}", file=sys.stderr, flush=True)
    return summary


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="default: configs/h200.yaml (configs/default.yaml "
                                                   "with --tiny-model)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=1, help="timed runs per cell; the fastest counts")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for both engines (e.g. attention.feature_graphs=false)")
    ap.add_argument("--tiny-model", action="store_true", help="CPU: the host work of each path")
    ap.add_argument("--features", nargs="+", choices=list(FEATURES), default=list(FEATURES),
                    help="a subset (a profile of one path); the table needs all of them")
    ap.add_argument("--engines", nargs="+", choices=["spec", "plain"], default=["spec", "plain"])
    ap.add_argument("--count-ops", action="store_true",
                    help="also count each decode step's eager device ops (benchmarks/step_ops.py; "
                         "with --tiny-model)")
    ap.add_argument("--timeline", default=None, metavar="DIR",
                    help="after each cell, one more run under torch.profiler: where the GPU sits "
                         "idle in a step (benchmarks/gpu_gaps.py), a JSON per cell in DIR")
    args = ap.parse_args(argv)
    qs = load_questions(DATA, 80)
    base, tiny = list(args.overrides), args.tiny_model
    config = args.config or ("configs/default.yaml" if tiny else "configs/h200.yaml")
    if tiny:
        import tempfile

        from benchmarks.http_bench import make_tiny_model
        base = TINY + [f"model.path={make_tiny_model(tempfile.mkdtemp(prefix='kestrel-tiny-'))}"] + base
    engines = {"spec": base, "plain": base + ["draft.enabled=false"]}
    results = {name: run(config, engines[name], qs, args.batch_sizes, args.max_tokens, tiny,
                         args.count_ops, args.repeats, args.features, args.timeline)
               for name in args.engines}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "feature_cost.json").write_text(json.dumps(results, indent=1))
    if set(args.features) != set(FEATURES):
        return  # the per-cell lines above are the figures
    with_ = [f for f in FEATURES if f != "none"]
    print("| engine | batch | tok/s (ms/step) without | " + " | ".join(f"with {f} (ratio)" for f in with_) + " |")
    print("|---|---|---|" + "---|" * len(with_))
    for name, r in results.items():
        for b in args.batch_sizes:
            a = r[f"none/{b}"]
            cells = " | ".join(f"{r[f'{f}/{b}']:.0f} ({r[f'{f}/{b}'] / a:.2f}; "
                               f"{r[f'{f}/{b}/ms_per_step']:.2f} ms)" for f in with_)
            print(f"| {name} | {b} | {a:.0f} ({r[f'none/{b}/ms_per_step']:.2f} ms) | {cells} |")
    if args.count_ops:
        print("\nEager device ops per decode step, a graph replay counted as one:\n")
        print("| engine | batch | " + " | ".join(FEATURES) + " |")
        print("|---|---|" + "---|" * len(FEATURES))
        for name, r in results.items():
            for b in args.batch_sizes:
                cells = " | ".join(f"{r[f'{f}/{b}/ops']:.0f}" for f in FEATURES)
                print(f"| {name} | {b} | {cells} |")


if __name__ == "__main__":
    main()
