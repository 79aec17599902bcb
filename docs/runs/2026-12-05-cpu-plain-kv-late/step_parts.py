import sys, time, collections
sys.path.insert(0, "/work/main")
from pathlib import Path
from benchmarks.cpu_vs_llamacpp import make_engine, load_questions, DATA, run_kestrel
from actors.models.loader import default_model_path
from serve_app.text.tokenizer import apply_chat_template, load_tokenizer
import actors.worker.rank_worker as rw
import actors.spec.eagle_worker as ew
T = collections.defaultdict(float); N = collections.Counter()
def wrap(cls, name):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); T[name] += time.perf_counter() - t; N[name] += 1; return r
    setattr(cls, name, g)
for n in ("_decode", "_decode_logits", "launch", "finish", "sample", "_extend"):
    if hasattr(rw.RankWorker, n): wrap(rw.RankWorker, n)
for n in ("follow_plain_step", "features", "extend_after_prefill", "flush_plain_kv", "decode"):
    wrap(ew.EagleWorker, n)
tok = load_tokenizer(default_model_path())
prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in load_questions(Path(DATA), 8)]
eng, _ = make_engine(sys.argv[2:], tok)
for rnd in range(int(sys.argv[1])):
    T.clear(); N.clear()
    t0 = time.perf_counter()
    tps, _, acc = run_kestrel(eng, prompts, 1, 64)
    tot = time.perf_counter() - t0
    print(f"round {rnd}: {tps:.1f} tok/s accept {acc:.2f} total {tot*1e3:.0f} ms", flush=True)
    print("   ", {k: (N[k], round(T[k]*1e3/ max(N[k],1), 3), round(T[k]*1e3)) for k in T})
