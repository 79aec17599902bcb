"""Greedy agreement of three implementations of the same Q4_1 GGUF over 8 MT-bench prompts x 64
tokens: Kestrel's default (packed kernels), Kestrel with float32 weights (the GGUF dequantized,
model.dtype=float32: the reference) and llama.cpp; and teacher-forced, on the float32 model's own
continuations, how often the packed model's next-token pick equals the float32 model's.
    PYTHONPATH=. python docs/runs/2026-12-05-cpu-default-packed/quality.py /tmp/lcp-avx2"""
import sys

import torch
import torch.nn.functional as F

from actors.models.loader import build_model, default_model_path
from benchmarks.cpu_vs_llamacpp import LlamaCpp, agreement, import_llama_cpp, make_engine, run_kestrel, run_llamacpp
from benchmarks.offline import DATA, load_questions
from serve_app.text.tokenizer import apply_chat_template, load_tokenizer

N = 64
tok = load_tokenizer(default_model_path())
prompts = [apply_chat_template(tok, [{"role": "user", "content": q}]) for q in load_questions(DATA, 8)]
outs = {}
for name, ov in (("packed", []), ("float32", ["model.dtype=float32", "model.cpu_weights=float"])):
    eng, _ = make_engine(ov, tok)
    assert eng.workers[0].cpu_weights == ("packed" if name == "packed" else "float")
    outs[name] = run_kestrel(eng, prompts, 1, N)[1]
outs["llama.cpp"] = run_llamacpp(LlamaCpp(import_llama_cpp(sys.argv[1]), default_model_path(), 2, 2048), prompts, N)[1]
for a, b in (("packed", "float32"), ("llama.cpp", "float32"), ("packed", "llama.cpp")):
    r = agreement(outs[a], outs[b], N)
    print(f"{a} vs {b}: {r['exact_prompts']:.0%} of prompts identical, {r['matching_prefix']:.0%} of tokens "
          f"before the first difference {r['prefix_lengths']}")


def attn(q, k, v, layer):
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          is_causal=True, enable_gqa=True).transpose(0, 1)


packed, _ = build_model(default_model_path(), torch.float32, "cpu", cpu_weights="packed")
ref, _ = build_model(default_model_path(), torch.float32, "cpu")
same = total = 0
with torch.inference_mode():
    for p, o in zip(prompts, outs["float32"]):
        ids = torch.tensor(p + o)
        pos = torch.arange(ids.numel())
        picks = [m.compute_logits(m(ids, pos, attn)[0])[len(p) - 1:-1].argmax(-1) for m in (packed, ref)]
        same += int((picks[0] == picks[1]).sum())
        total += len(o)
print(f"teacher-forced on the float32 model's continuations: the packed model picks the same next token "
      f"at {same}/{total} positions ({same / total:.1%})")
