import sys, time, collections
sys.path.insert(0, ".")
from pathlib import Path
from benchmarks.cpu_vs_llamacpp import make_engine, load_questions, DATA, run_kestrel
from actors.models.loader import default_model_path
from serve_app.text.tokenizer import apply_chat_template, load_tokenizer
import actors.worker.rank_worker as rw
import actors.spec.eagle_worker as ew
import actors.models.packed_cpu_weights as pk
import serve_app.engine.llm_engine as le
T = collections.defaultdict(float); N = collections.Counter()
def wrap(cls, name, label=None):
    f = getattr(cls, name); label = label or f"{cls.__name__}.{name}"
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[label] += time.perf_counter() - t; N[label] += 1; return r
    setattr(cls, name, g)
for n in ("launch", "finish", "_decode", "_extend"):
    wrap(rw.RankWorker, n)
for n in ("_verify_forward", "_draft", "_draft_extend", "decode", "_keep_accepted_kv", "follow_plain_step", "flush_plain_kv", "extend_after_prefill", "features"):
    if hasattr(ew.EagleWorker, n): wrap(ew.EagleWorker, n)
wrap(pk.PackedLlamaForCausalLM, "forward"); wrap(pk.Q8LMHead, "forward")
wrap(le.LLMEngine, "step")
tok = load_tokenizer(default_model_path())
prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in load_questions(Path(DATA), 8)]
eng, _ = make_engine(sys.argv[1:], tok)
for rnd in range(3):
    T.clear(); N.clear()
    t0 = time.perf_counter()
    tps, _, acc = run_kestrel(eng, prompts, 1, 64)
    tot = time.perf_counter() - t0
    print(f"round {rnd}: {tps:.1f} tok/s accept {acc:.2f} total {tot*1e3:.0f} ms", flush=True)
    for k in sorted(T, key=lambda k: -T[k]): print(f"   {k:40s} n={N[k]:5d} {T[k]*1e3/max(N[k],1):7.3f} ms each, {T[k]*1e3:7.0f} ms")
