"""Processing, logprobs and grammars on the CUDA graph paths (attention.feature_graphs; the
h200 preset's engine in fp32, where speculative output equals plain token for token):
the processed decode graph, the step graph's (processed, logprobs) variants and its three
parts for grammar batches replay, and give the answers of the eager paths they replace
and of plain decoding."""
import json

from test_prefill_graph_gpu import engine

from actors.spec.step_graph import Variant
from serve_app.engine.request import SamplingParams

MAX = 64
FP32 = "model.dtype=float32"
ON = "attention.feature_graphs=true"  # explicit: what this file tests, whatever the preset says
FEATURES = dict(presence_penalty=0.6, frequency_penalty=0.3, repetition_penalty=1.2,
                logit_bias={13: -5.0}, min_tokens=4, bad_words=[[28705], [30, 31]], logprobs=5)


def spy_step_graph(eng) -> list:
    """Log what the step graph replays: ("whole" | "parts", variant)."""
    g, seen = eng.workers[0].eagle.step_graph, []
    run, accept = g.run, g.run_accept
    g.run = lambda rows, variant=Variant(), bs=None: \
        seen.append(("whole", variant)) or run(rows, variant, bs)
    g.run_accept = lambda raw, variant: seen.append(("parts", variant)) or accept(raw, variant)
    return seen


def same_or_all_but_one(a, b, what: str) -> None:
    same = sum(x == y for x, y in zip(a, b))
    assert same >= len(a) - 1, f"{what}: only {same} of {len(a)} prompts identical"


def test_processing_and_logprobs_replay_and_equal_eager(tokenizer, chat_prompts):
    params = SamplingParams(max_tokens=MAX, ignore_eos=True, **FEATURES)
    eager = engine(tokenizer, FP32, "draft.enabled=false", "attention.feature_graphs=false")
    want = eager.generate(chat_prompts, params)
    plain = engine(tokenizer, FP32, ON, "draft.enabled=false")
    assert plain.workers[0].processed_decode_graphs.use_cuda_graph
    got = plain.generate(chat_prompts, params)
    same_or_all_but_one([r.output_ids for r in got], [r.output_ids for r in want], "processed decode graph")
    spec = engine(tokenizer, FP32, ON)
    seen = spy_step_graph(spec)
    tree = spec.generate(chat_prompts, params)
    assert set(seen) == {("whole", Variant(True, True))}
    same_or_all_but_one([r.output_ids for r in tree], [r.output_ids for r in want], "processed step graph")
    for a, b in zip(tree, want):
        if a.output_ids == b.output_ids:
            worst = max(abs(x[0] - y[0]) for x, y in zip(a.token_logprobs, b.token_logprobs))
            assert worst < 1e-3, worst


def test_grammar_batches_replay_the_step_graph_parts(tokenizer, chat_prompts):
    from serve_app.text.grammar import compiler_for
    schema = {"type": "object", "additionalProperties": False, "required": ["answer", "score"],
              "properties": {"answer": {"type": "string", "maxLength": 40},
                             "score": {"type": "integer", "minimum": 0, "maximum": 10}}}
    grammar = compiler_for(tokenizer).compile(("json_schema", json.dumps(schema)))
    params = SamplingParams(max_tokens=MAX, grammar=grammar, presence_penalty=0.3)
    plain = engine(tokenizer, FP32, "draft.enabled=false").generate(chat_prompts, params)
    spec = engine(tokenizer, FP32, ON)
    seen = spy_step_graph(spec)
    tree = spec.generate(chat_prompts, params)
    assert ("parts", Variant(processed=True)) in seen and all(kind == "parts" for kind, _ in seen)
    same_or_all_but_one([r.output_ids for r in tree], [r.output_ids for r in plain], "grammar parts")
    finished = [r for r in tree if r.finish_reason == "stop"]
    assert finished
    for r in finished:
        assert set(json.loads(r.text)) == {"answer", "score"}
