"""Logit processing under speculation (kestrel_kernels/penalties.py): presence, frequency and
repetition penalties, logit bias and min_tokens keep greedy speculative output equal to
greedy plain output with the same processing, token for token.

Each tree node is processed with the counts along its own path. A random head rarely gets
past the root, where the path is empty, so the engine tests also run an oracle draft that
proposes the known answer among decoys: long accepts, where a node's path holds ids the
emitted counts do not. The per-node reference below pins the tree processing down alone.
"""
from __future__ import annotations

import pytest
import torch
from spec_helpers import CHAIN, TREE, fixed_draft, random_prompts, tiny_engine
from test_c22_greedy_lossless import OracleDraft

from actors.spec.step_graph import Variant
from kestrel_kernels.penalties import Processing, _penalize, apply_processing
from kestrel_kernels.spec_tree import build_tree
from serve_app.engine.request import SamplingParams

PENALIZED = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3,
                 logit_bias={5: 2.5, 7: -1.5, 11: 4.0})
MAX = 24


def processing(B: int, V: int, min_tokens: int = 0, stops=(2,)) -> Processing:
    """PENALIZED for B requests, each table with an unused (-1) column, which must change nothing."""
    f = lambda v: torch.full((B,), v, dtype=torch.float32)
    pad = lambda row: torch.tensor([list(row) + [-1]] * B)
    bias = PENALIZED["logit_bias"]
    no_words = torch.zeros(B, 0, dtype=torch.int64)
    return Processing(f(0.7), f(0.4), f(1.3), torch.full((B,), min_tokens, dtype=torch.int64),
                      pad(bias), pad(bias.values()).float(), pad(stops), no_words,
                      no_words.view(B, 0, 0))


def test_tree_nodes_are_processed_with_their_paths_counts():
    torch.manual_seed(0)
    B, N, V = 3, 8, 16
    parents = torch.tensor([[0, 0, 1, 1, 2, 4, 5], [0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 3]])
    draft = torch.randint(0, 6, (B, N - 1))  # few ids: paths repeat them
    tree = build_tree(torch.tensor([3, 4, 5]), draft, parents, torch.tensor([10, 20, 30]))
    path = tree.tree_mask.clone()
    path[:, :, 0] = False
    logits = torch.randn(B, N, V) * 3
    counts = torch.randint(0, 3, (B, V), dtype=torch.int32)
    num_out = torch.tensor([1, 4, 6])
    prompt = torch.rand(B, V) < 0.3
    p = processing(B, V, min_tokens=6)
    got = apply_processing(logits, p, counts, num_out, prompt, tree.tokens, path)
    for b in range(B):
        for i in range(N):
            x = logits[b, i].clone()
            for t, v in PENALIZED["logit_bias"].items():
                x[t] += v
            depth = int(path[b, i].sum())
            if num_out[b] + depth < 6:
                x[2] = float("-inf")
            c = counts[b].float().clone()
            for j in range(N):
                if path[b, i, j]:
                    c[tree.tokens[b, j]] += 1
            want = _penalize(x, c, prompt[b], torch.tensor(1.3), torch.tensor(0.4), torch.tensor(0.7))
            torch.testing.assert_close(got[b, i], want, msg=f"request {b} node {i}")


def greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=MAX, ignore_eos=True, **extra)


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("draft", ["random", "oracle"])
def test_greedy_penalties_speculative_equals_plain(tiny_llama_dir, shape, draft, monkeypatch):
    prompts = random_prompts(4, seed=7)
    params = greedy(**PENALIZED)
    plain = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, params)]
    unpenalized = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, greedy())]
    assert plain != unpenalized  # the processing changes the answer
    speculate_and_compare(tiny_engine(tiny_llama_dir, *shape), prompts, params, plain, draft, monkeypatch)


def speculate_and_compare(eng, prompts, params, plain, draft, monkeypatch) -> None:
    """Run `eng` (speculative) on the prompts (one params, or one per prompt), with its own
    random head or ("oracle") a draft proposing the plain answers among decoys, and check
    it emits the plain answers."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [eng.add_request(p, sp) for p, sp in zip(prompts, plist)]
    eng.step()  # the prefill: rows are assigned now
    if draft == "oracle":
        eagle = eng.workers[0].eagle
        refs = {0: [], **{r.row: r.prompt_ids + ref for r, ref in zip(reqs, plain)}}  # 0: padded lanes
        oracle = OracleDraft(eagle, refs, 128)
        monkeypatch.setattr(eagle, "_draft", oracle)
        monkeypatch.setattr(eagle, "draft_body", oracle)  # what the step graph's body calls
    while eng.has_work:
        eng.step()
    assert [r.output_ids for r in reqs] == plain
    if draft == "oracle":
        assert max(a for r in reqs for a in r.accept_lengths) >= 3


GRAPH_SIZES = [1, 2, 4, 8]
WORDS = [[9, 10], [12], [3, 4, 5]]  # bad words the tiny model's answers come near


def spy_variants(eagle) -> list[Variant]:
    """Log the variant of each step-graph run."""
    seen, run = [], eagle.step_graph.run

    def spy(rows, variant=Variant(), bs=None):
        seen.append(variant)
        return run(rows, variant, bs)

    eagle.step_graph.run = spy
    return seen


def spy_decode_replays(worker) -> list[str]:
    """Log which decode graph set ("plain" or "processed") each plain decode step replays."""
    seen = []
    for name, runner in (("plain", worker.decode_graphs), ("processed", worker.processed_decode_graphs)):
        def replay(batch, _name=name, _replay=runner.replay, **kw):
            seen.append(_name)
            return _replay(batch, **kw)
        runner.replay = replay
    return seen


@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_processing_on_the_graph_paths_equals_eager_plain(tiny_llama_dir, shape, monkeypatch):
    """Penalties, bias, min_tokens and bad words read from the rows' processing tables inside
    the decode graphs (CPU: their eager stand-ins, the same bodies on padded lanes): the
    processed decode graph for plain decoding, the processed step graph under speculation
    (an oracle draft: long accepts). A batch of processed and unprocessed requests gives
    the eager plain answer of each, and no step leaves the graph path."""
    prompts = random_prompts(5, seed=7)
    processed = greedy(**PENALIZED, min_tokens=4, bad_words=WORDS)
    plist = [processed if i % 2 == 0 else greedy() for i in range(len(prompts))]
    plain = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, plist)]
    alone = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, greedy())]
    assert plain[0] != alone[0] and plain[1] == alone[1]  # processing changes only its requests
    eng = tiny_engine(tiny_llama_dir, *(shape or ()), spec=shape is not None)
    w = eng.workers[0]
    if shape is None:
        w.capture_decode_graphs(GRAPH_SIZES)
        seen = spy_decode_replays(w)
        assert [r.output_ids for r in eng.generate(prompts, plist)] == plain
        assert set(seen) == {"processed"}
        return
    w.eagle.capture_graphs(GRAPH_SIZES)
    seen = spy_variants(w.eagle)
    speculate_and_compare(eng, prompts, plist, plain, "oracle", monkeypatch)
    assert set(seen) == {Variant(processed=True)}


@pytest.mark.parametrize("shape", [None, TREE], ids=["plain", "tree"])
def test_entries_past_the_table_widths_run_eagerly(tiny_llama_dir, shape, monkeypatch):
    """A request with more bias entries, stop ids and bad words than the tables hold gets
    all of them, on the eager path: the answer of tables wide enough for it."""
    prompts = random_prompts(3, seed=8)
    params = greedy(**PENALIZED, min_tokens=4, stop_token_ids=[7, 11], bad_words=WORDS)
    plain = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, params)]
    narrow = ("processing.logit_bias=1", "processing.stop_ids=1", "processing.bad_words=1")
    eng = tiny_engine(tiny_llama_dir, *narrow, *(shape or ()), spec=shape is not None)
    w = eng.workers[0]
    if shape is None:
        w.capture_decode_graphs(GRAPH_SIZES)
        seen = spy_decode_replays(w)
        assert [r.output_ids for r in eng.generate(prompts, params)] == plain
        assert set(seen) == {"plain"}  # the processing ran after the graph, with every entry
        return
    w.eagle.capture_graphs(GRAPH_SIZES)
    seen = spy_variants(w.eagle)
    speculate_and_compare(eng, prompts, params, plain, "oracle", monkeypatch)
    assert seen == []


@pytest.mark.parametrize("shape", [None, CHAIN, TREE], ids=["plain", "chain", "tree"])
def test_min_tokens_holds_back_a_forced_stop(tiny_llama_dir, shape):
    """The bias makes EOS (id 2) every position's choice; min_tokens bans it for the first
    five outputs, at tree depth too, so each request ends with EOS as its sixth token."""
    prompts = random_prompts(3, seed=2)
    params = SamplingParams(max_tokens=MAX, logit_bias={2: 50.0}, min_tokens=5)
    eng = tiny_engine(tiny_llama_dir, *(shape or ()), spec=shape is not None)
    for r in eng.generate(prompts, params):
        assert len(r.output_ids) == 6 and r.output_ids[-1] == 2 and 2 not in r.output_ids[:5]


@pytest.mark.parametrize("shape", [None, TREE], ids=["plain", "tree"])
def test_preempted_requests_keep_their_counts(tiny_llama_dir, shape):
    """Out of KV, requests are preempted and re-prefilled with their outputs as prompt: the
    worker's counts restart from those outputs, so the penalized answer is unchanged."""
    from serve_app.engine.llm_engine import LLMEngine
    from spec_helpers import tiny_config
    prompts = random_prompts(8, seed=5)
    params = SamplingParams(max_tokens=40, ignore_eos=True, **PENALIZED)
    over = ["model.max_model_len=128", *(shape or ())]
    roomy = tiny_engine(tiny_llama_dir, *over, spec=shape is not None)
    want = [r.output_ids for r in roomy.generate(prompts, params)]
    cfg = tiny_config(tiny_llama_dir, *over, spec=shape is not None)
    tight = LLMEngine(cfg, load_tokenizer=False, workers=roomy.workers, worker_info={"num_slots": 360})
    got = [r.output_ids for r in tight.generate(prompts, params)]
    assert tight.schedulers[0].stats["preemptions"] > 0
    assert got == want


class TopTwoDraft:
    """A tree holding, below the root (the first output t1), the target's two likeliest next
    ids under the processing, and below each of those its two likeliest: with top_k=2 the
    sampled verify accepts two nodes every time, so t2 and t3 come from one iteration, t3
    from a node whose path holds t2."""

    def __init__(self, eagle, top2: dict):
        self.eagle, self.top2 = eagle, top2

    def __call__(self, batch):
        drafts, parents = [], []
        for row in batch.req_pool_indices.tolist():
            t1 = int(self.eagle.w.future.bonus[row])
            if (t1,) not in self.top2:  # a graph's padded lane (row 0)
                drafts.append([0] * (self.eagle.N - 1))
                parents.append([0] * (self.eagle.N - 1))
                continue
            a, b = self.top2[(t1,)]
            drafts.append([a, b, *self.top2[(t1, a)], *self.top2[(t1, b)], 0][:self.eagle.N - 1])
            parents.append([0, 0, 1, 1, 2, 2, 3][:self.eagle.N - 1])
        return fixed_draft(drafts, parents)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "step_graph"])
def test_sampled_tree_with_penalties_keeps_the_target_distribution(tiny_llama_dir, graphs, monkeypatch):
    """C23 with processing: the first three sampled tokens of 800 seeded requests through
    the tree (t2 and t3 accepted in one iteration) follow the plain processed distribution
    P(t1) P(t2 | t1) P(t3 | t1, t2), each factor computed from the target's logits with the
    counts of the outputs before it (chi-square over the 8 outcomes). With `graphs`, each
    iteration replays the step graph's sampled variant (CPU: its eager stand-in), the
    sampling parameters read by row from the processing table."""
    from scipy.stats import chisquare
    from transformers import LlamaForCausalLM

    from kestrel_kernels.sampling import process_logits
    prompt = random_prompts(1, seed=13)[0]
    pen = dict(presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.5)
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir).float().eval()
    V = model.config.vocab_size

    def dist(outputs: tuple) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + list(outputs)])).logits[0, -1].float()
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=V)[None]
        prompt_mask = torch.zeros(1, V, dtype=torch.bool)
        prompt_mask[0, prompt] = True
        f = lambda v: torch.tensor([v])
        none = torch.zeros(1, 0, dtype=torch.int64)
        p = Processing(f(1.0), f(0.5), f(1.5), torch.zeros(1, dtype=torch.int64), none,
                       none.float(), none, none, none.view(1, 0, 0))
        x = apply_processing(logits[None, None], p, counts, torch.tensor([len(outputs)]), prompt_mask)[0]
        return process_logits(x, f(1.0), f(1.0), torch.tensor([2]))[0]

    expected, top2 = {}, {}
    p1 = dist(())
    top2[()] = p1.topk(2).indices.tolist()
    for t1 in top2[()]:
        p2 = dist((t1,))
        top2[(t1,)] = p2.topk(2).indices.tolist()
        for t2 in top2[(t1,)]:
            p3 = dist((t1, t2))
            top2[(t1, t2)] = p3.topk(2).indices.tolist()
            for t3 in top2[(t1, t2)]:
                expected[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3])
    assert len(expected) == 8 and min(expected.values()) > 0.01
    eng = tiny_engine(tiny_llama_dir, *TREE)
    eagle = eng.workers[0].eagle
    draft = TopTwoDraft(eagle, top2)
    monkeypatch.setattr(eagle, "_draft", draft)
    if graphs:
        eagle.capture_graphs(GRAPH_SIZES)
        monkeypatch.setattr(eagle, "draft_body", draft)  # what the step graph's body calls
        variants = spy_variants(eagle)
    trials = 800
    reqs = eng.generate([prompt] * trials, [
        SamplingParams(max_tokens=3, ignore_eos=True, temperature=1.0, top_k=2, seed=s, **pen)
        for s in range(trials)])
    seen = {k: 0 for k in expected}
    for r in reqs:
        assert tuple(r.output_ids) in seen, r.output_ids  # only ids the processing allows
        seen[tuple(r.output_ids)] += 1
    assert all(r.accept_lengths[0] == 3 for r in reqs)  # t2 and t3 from one tree
    if graphs:
        assert set(variants) == {Variant(processed=True, sampled=True, filtered=True)}
    keys = sorted(expected)
    total = sum(expected.values())
    p = chisquare([seen[k] for k in keys], [trials * expected[k] / total for k in keys]).pvalue
    assert p > 1e-3, (p, seen, expected)
