"""C22: greedy speculative output equals greedy plain output, token for token, on real
SmolLM2 weights: with a random head (the real draft path), and with an oracle draft that
proposes the right tokens among decoys (so long accepts, sibling walks and the KV moves
of off-position accepted nodes all happen)."""
import pytest
import torch

from kestrel_testing import assert_same_or_near_tie
from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from spec_helpers import CHAIN, TREE, fixed_draft, greedy

BASE = ["draft.enabled=false", "model.dtype=float32", "kv_cache.num_slots=8192",
        "scheduler.max_running_requests=16", "device=cpu"]
MAX = 16  # past a page of 16 on every row; a wrong accept or KV move shows in the first rounds


@pytest.fixture(scope="module")
def spec_workers(smollm_path):
    """SmolLM2 workers with a random EAGLE head, one per draft shape (built on demand)."""
    from actors.worker.rank_worker import RankWorker
    cache = {}

    def get(shape):
        if shape not in cache:
            cache[shape] = RankWorker(load_config(
                overrides=BASE + ["draft.enabled=true", "draft.path=random", *shape]))
        return cache[shape]
    return get


def engine(workers, tokenizer, shape, *overrides):
    cfg = load_config(overrides=BASE + ["draft.enabled=true", "draft.path=random", *shape,
                                        *overrides])
    return LLMEngine(cfg, tokenizer=tokenizer, workers=[workers(shape)])


@pytest.fixture(scope="module")
def plain(plain_chat_outputs):
    """Greedy plain output (BASE, the fp32 worker) of the first 4 chat prompts: a prefix of
    the session's 64-token reference (conftest.py)."""
    return [ids[:MAX + 8] for ids in plain_chat_outputs[:4]]


@pytest.mark.parametrize("shape,batch,page", [
    # One request alone: long, for make test's budget (test_adaptive_draft_lossless.py's
    # batch of one speculates alone in make test).
    pytest.param(CHAIN, 1, 1, marks=pytest.mark.long), (CHAIN, 4, 16),
    pytest.param(TREE, 1, 16, marks=pytest.mark.long),
    # Long: a drafted tree of 4 rows is held to plain output by test_c22_shipped_head[tree],
    # and at page 1 (with rejects, long accepts and KV moves) by the oracle's (TREE, 1) case.
    pytest.param(TREE, 4, 1, marks=pytest.mark.long)])
def test_c22_random_head(spec_workers, tokenizer, chat_prompts, plain, hf_model, shape, batch, page):
    eng = engine(spec_workers, tokenizer, shape, f"kv_cache.page_size={page}")
    reqs = eng.generate(chat_prompts[:batch], greedy(MAX))
    for prompt, r, ref in zip(chat_prompts, reqs, plain):
        assert len(r.accept_lengths) > 0
        assert_same_or_near_tie(hf_model, prompt, r.output_ids, ref[:MAX])


class OracleDraft:
    """Replaces the draft model's tree with one built from the known greedy answer,
    mixing right tokens with decoys, so verification has real work to do."""

    def __init__(self, eagle, refs: dict[int, list[int]], vocab: int):
        self.eagle, self.refs, self.vocab = eagle, refs, vocab
        self.accepts: list[int] = []

    def tok(self, row, pos, right=True):
        ref = self.refs[row]
        t = ref[pos] if pos < len(ref) else 0
        return t if right else (t + 1) % self.vocab

    def __call__(self, batch):
        N, K = self.eagle.N, self.eagle.K
        drafts, parents = [], []
        for row, s in zip(batch.req_pool_indices.tolist(), batch.seq_lens.tolist()):
            flip = s % 3  # vary where the oracle goes wrong from round to round
            if K == 1:  # chain: right tokens, one wrong at a depth that moves around
                d = [self.tok(row, s + 1 + i, right=(i != flip + 1)) for i in range(N - 1)]
                p = list(range(N - 1))
            else:  # tree: the right child is the second sibling, decoys beside the path
                d = [self.tok(row, s + 1, False), self.tok(row, s + 1), self.tok(row, s + 2),
                     self.tok(row, s + 3, False), self.tok(row, s + 3, right=flip != 1),
                     self.tok(row, s + 4), self.tok(row, s + 5, right=flip != 2)]
                p = [0, 0, 2, 3, 3, 5, 6]
                d, p = d[:N - 1], p[:N - 1]
            drafts.append(d)
            parents.append(p)
        return fixed_draft(drafts, parents)


@pytest.mark.parametrize("shape,page", [(CHAIN, 1), (TREE, 16), (TREE, 1)])
def test_c22_oracle_draft_long_accepts(spec_workers, tokenizer, chat_prompts, plain, hf_model,
                                       shape, page, monkeypatch):
    spec_worker = spec_workers(shape)
    eng = engine(spec_workers, tokenizer, shape, f"kv_cache.page_size={page}")
    reqs = [eng.add_request(p, greedy(MAX)) for p in chat_prompts[:4]]
    eng.step()  # prefill: rows are assigned now
    refs = {r.row: r.prompt_ids + ref for r, ref in zip(reqs, plain)}
    oracle = OracleDraft(spec_worker.eagle, refs, spec_worker.arch.vocab_size)
    monkeypatch.setattr(spec_worker.eagle, "_draft", oracle)
    moves = []
    real_move = spec_worker.kv_pool.move
    monkeypatch.setattr(spec_worker.kv_pool, "move", lambda s, d: (moves.append(len(s)), real_move(s, d)))
    while eng.has_work:
        eng.step()
    for prompt, r, ref in zip(chat_prompts, reqs, plain):
        assert_same_or_near_tie(hf_model, prompt, r.output_ids, ref[:MAX])
        assert max(r.accept_lengths) >= 3
    if shape is TREE:
        assert moves, "the tree oracle accepts off-position nodes: their KV must move"


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
def test_c22_shipped_head(tokenizer, chat_prompts, plain, hf_model, shape):
    """The trained head shipped for the default model (draft.path unset): lossless, and it
    really drafts: a random head accepts ~1.0 tokens per iteration, this one clearly more."""
    cfg = load_config(overrides=BASE + ["draft.enabled=true", *shape])
    assert cfg.draft.path is None and cfg.model.path is None
    reqs = LLMEngine(cfg, tokenizer=tokenizer).generate(chat_prompts[:4], greedy(MAX))
    for prompt, r, ref in zip(chat_prompts, reqs, plain):
        assert_same_or_near_tie(hf_model, prompt, r.output_ids, ref[:MAX])
    acc = [a for r in reqs for a in r.accept_lengths]
    assert sum(acc) / len(acc) > 1.2, f"mean accept length {sum(acc) / len(acc):.2f}"


def test_draft_path_unset_for_another_target_is_an_error(tiny_llama_dir):
    with pytest.raises(ValueError, match="draft.path"):
        LLMEngine(load_config(overrides=[f"model.path={tiny_llama_dir}", "device=cpu",
                                         "draft.enabled=true"]), load_tokenizer=False)
