"""CPU-seconds per generated token at batch B (1 thread: robust to a loaded machine)."""
import sys, time, torch
from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams
from serve_app.text.tokenizer import apply_chat_template, load_tokenizer
from actors.models.loader import default_model_path
from benchmarks.offline import load_questions, DATA
args=[a for a in sys.argv[1:]]
B=int(args.pop(0))
variants=[v.split(',') if v!='-' else [] for v in args]
tok = load_tokenizer(default_model_path())
prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in load_questions(DATA, 8)]
engs=[]
for v in variants:
    cfg = load_config(overrides=['cpu_threads=1']+v)
    e=LLMEngine(cfg, tokenizer=tok); e.generate([prompts[0]], SamplingParams(max_tokens=8, ignore_eos=True)); engs.append(e)
p = SamplingParams(max_tokens=64, ignore_eos=True)
for rep in range(2):
    for v,e in zip(variants,engs):
        n=0; c=time.process_time(); w=time.perf_counter(); acc=[]
        for i in range(0, len(prompts) if B>1 else 4, B):
            for r in e.generate(prompts[i:i+B], p): n+=len(r.output_ids); acc+=r.accept_lengths
        c=time.process_time()-c; w=time.perf_counter()-w
        print(f'{",".join(v) or "default"}: {1000*c/n:.2f} cpu-ms/token ({n/c:.1f} tok/cpu-s), wall {n/w:.1f} tok/s, accept {sum(acc)/max(1,len(acc)):.2f}', flush=True)
