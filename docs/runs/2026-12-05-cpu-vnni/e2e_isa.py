"""The default config (packed weights, the Q4_1 kernel on AVX-VNNI) against the same config with
the kernel forced to AVX2, in process: the kernel's instruction set is a module-level choice
(kestrel_kernels.cpu_q4.set_isa), not a setting, so benchmarks.cpu_vs_llamacpp's --baseline-set
cannot pick it. Its batch > 1 rows as that benchmark runs them (make_engine, run_kestrel): one
batch of the first 8, then 32 MT-bench prompts, 64 greedy tokens, rounds alternating default /
AVX2; each engine is built and timed at start-up (the draft policy's step costs) on its own
instruction set.
    PYTHONPATH=. python docs/runs/2026-12-05-cpu-vnni/e2e_isa.py [--json out.json]"""
import argparse, json, statistics, sys
from pathlib import Path
from benchmarks.cpu_vs_llamacpp import make_engine, run_kestrel
from benchmarks.offline import DATA, load_questions
from actors.models.loader import default_model_path
from kestrel_kernels.cpu_q4 import set_isa
from serve_app.text.tokenizer import apply_chat_template, load_tokenizer

ap = argparse.ArgumentParser()
ap.add_argument("--num-prompts", type=int, default=32)
ap.add_argument("--repeats", type=int, default=2)
ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32])
ap.add_argument("--max-tokens", type=int, default=64)
ap.add_argument("--json", default=None)
args = ap.parse_args()
tok = load_tokenizer(default_model_path())
prompts = [apply_chat_template(tok, [{"role": "user", "content": q}])
           for q in load_questions(DATA, max([args.num_prompts] + args.batch_sizes))]
engines = {}
for name in ("auto", "avx2"):
    set_isa(name)
    engines[name], load_s = make_engine([], tok)
    w = engines[name].workers[0]
    print(f"{name}: cpu_weights {w.cpu_weights}, Q4_1 kernel {w.info()['cpu_q4_isa']}, "
          f"warm in {load_s:.1f}s", file=sys.stderr, flush=True)
rows = []
for b in args.batch_sizes:
    tps = {"auto": [], "avx2": []}
    same = True
    for rnd in range(args.repeats):
        outs = {}
        for name in ("auto", "avx2"):
            set_isa(name)
            t, outs[name], _ = run_kestrel(engines[name], prompts[:b], b, args.max_tokens)
            tps[name].append(t)
        same &= outs["auto"] == outs["avx2"]
        print(f"batch {b} round {rnd}: default {tps['auto'][-1]:.1f} tok/s, "
              f"avx2 {tps['avx2'][-1]:.1f} tok/s, ratio {tps['auto'][-1] / tps['avx2'][-1]:.2f}",
              file=sys.stderr, flush=True)
    ratios = [a / x for a, x in zip(tps["auto"], tps["avx2"])]
    rows.append({"batch": b, "default": tps["auto"], "avx2": tps["avx2"], "ratios": ratios,
                 "ratio_median": statistics.median(ratios), "same_tokens": same})
set_isa("auto")
print("\n| batch | default tok/s | AVX2 forced tok/s | ratio per round | median | same tokens |")
print("|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['batch']} | {statistics.median(r['default']):.1f} | {statistics.median(r['avx2']):.1f} | "
          f"{' '.join(f'{x:.2f}' for x in r['ratios'])} | {r['ratio_median']:.2f} | {r['same_tokens']} |")
if args.json:
    Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
