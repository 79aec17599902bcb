"""vLLM's bad_words under speculation (kestrel_kernels/penalties.py): a word's last token is banned
where the tokens before it end what was emitted, and on a tree node, what was emitted and
then the node's path. So greedy speculative output equals greedy plain output with the
same words, token for token, and no output holds a banned sequence.

The per-node reference pins the tree rule down alone; the engine tests run a random head
and an oracle draft that proposes the known answer (long accepts, where a node's context
reaches into its path)."""
from __future__ import annotations

import pytest
import torch
from spec_helpers import CHAIN, TREE, random_prompts, tiny_engine
from test_penalties_lossless import speculate_and_compare

from actors.sampling.output_counts import TAIL
from kestrel_kernels.penalties import Processing, apply_processing, node_context
from kestrel_kernels.spec_tree import build_tree
from serve_app.engine.request import SamplingParams

MAX = 24


def processing(B: int, words: list[tuple[int, list[int]]]) -> Processing:
    """Bad words per request (b, word) in the dense tables, one unused (-1) column more than
    the most words a request has, which must change nothing."""
    z = torch.zeros(B)
    P = max(len(w) - 1 for _, w in words)
    W = 1 + max(sum(b == r for b, _ in words) for r in range(B))
    last = torch.full((B, W), -1, dtype=torch.int64)
    prefix = torch.full((B, W, P), -1, dtype=torch.int64)
    used = [0] * B
    for b, w in words:
        k = used[b]
        used[b] += 1
        last[b, k] = w[-1]
        if len(w) > 1:
            prefix[b, k, P - len(w) + 1:] = torch.tensor(w[:-1])
    empty = torch.zeros(B, 0, dtype=torch.int64)
    return Processing(z, z, torch.ones(B), torch.zeros(B, dtype=torch.int64), empty,
                      empty.float(), empty, last, prefix)


def ends_with(seq: list[int], prefix: list[int]) -> bool:
    return len(prefix) == 0 or (len(seq) >= len(prefix) and seq[-len(prefix):] == prefix)


def test_tree_nodes_ban_by_their_paths_context():
    torch.manual_seed(1)
    B, N, V = 3, 8, 12
    parents = torch.tensor([[0, 0, 1, 1, 2, 4, 5], [0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 2, 3, 3]])
    draft = torch.randint(0, 4, (B, N - 1))  # few ids: the paths repeat the words' prefixes
    tree = build_tree(torch.tensor([3, 1, 2]), draft, parents, torch.tensor([10, 20, 30]))
    path = tree.tree_mask.clone()
    path[:, :, 0] = False
    emitted = [[5, 1, 3], [2], [0, 1, 2, 3, 1, 0, 2, 3, 1, 2, 0, 3, 3, 2, 1, 0, 1, 2]]
    tail = torch.full((B, TAIL), -1, dtype=torch.int64)
    for b, e in enumerate(emitted):
        e = e[-TAIL:]
        tail[b, TAIL - len(e):] = torch.tensor(e)
    words = [(0, [7]), (0, [3, 1, 9]), (1, [1, 2, 10]), (1, [2, 11]), (2, [1, 2, 3, 4, 5]),
             (2, [0, 1, 6]), (2, [2, 6])]  # two words of request 2 end in one id
    logits = torch.randn(B, N, V)
    got = apply_processing(logits, processing(B, words), torch.zeros(B, V, dtype=torch.int32),
                           torch.zeros(B, dtype=torch.int64), None, tree.tokens, path, tail)
    banned = 0
    for b in range(B):
        for i in range(N):
            # The node's own path, ordered by depth: its ancestors below the root, then itself.
            nodes = sorted((j for j in range(N) if path[b, i, j]), key=lambda j: int(path[b, j].sum()))
            ctx = emitted[b][-TAIL:] + [int(tree.tokens[b, j]) for j in nodes]
            want = logits[b, i].clone()
            for wb, w in words:
                if wb == b and ends_with(ctx, w[:-1]):
                    want[w[-1]] = float("-inf")
                    banned += 1
            torch.testing.assert_close(got[b, i], want, msg=f"request {b} node {i}, context {ctx}")
    assert banned > 10  # the words' prefixes really occur on the paths


def test_node_context_of_plain_rows_is_the_tail():
    tail = torch.tensor([[-1, -1, 4, 5, 6]])
    assert node_context(tail, None, None, 2).tolist() == [[[5, 6]]]
    assert node_context(tail, None, None, 7).tolist() == [[[-1, -1, -1, -1, 4, 5, 6]]]


def greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=MAX, ignore_eos=True, **extra)


def bad_words_of(outputs: list[list[int]]) -> list[list[int]]:
    """Words cut from the unconstrained answers, so they would occur: single ids, pairs and
    triples at several places."""
    words = []
    for out in outputs:
        words += [out[3:4], out[6:8], out[10:13], out[15:17], out[19:22]]
    return words


def holds(seq: list[int], word: list[int]) -> bool:
    return any(seq[k:k + len(word)] == word for k in range(len(seq) - len(word) + 1))


@pytest.mark.parametrize("shape", [CHAIN, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("draft", ["random", "oracle"])
def test_greedy_bad_words_speculative_equals_plain(tiny_llama_dir, shape, draft, monkeypatch):
    prompts = random_prompts(8, seed=7)
    free = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, greedy())]
    params = greedy(bad_words=bad_words_of(free))
    plain = [r.output_ids for r in tiny_engine(tiny_llama_dir, spec=False).generate(prompts, params)]
    assert plain != free  # the words change the answers
    for out in plain:
        assert not any(holds(out, w) for w in params.bad_words)
    speculate_and_compare(tiny_engine(tiny_llama_dir, *shape), prompts, params, plain, draft, monkeypatch)


def test_preempted_requests_keep_their_tail(tiny_llama_dir):
    """Re-prefilled with their outputs as prompt, requests restart their worker tail from
    those outputs: a word spanning the preemption is still banned."""
    from serve_app.engine.llm_engine import LLMEngine
    from spec_helpers import tiny_config
    prompts = random_prompts(8, seed=5)
    over = ["model.max_model_len=128", *TREE]
    roomy = tiny_engine(tiny_llama_dir, *over)
    free = [r.output_ids for r in roomy.generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))]
    params = SamplingParams(max_tokens=40, ignore_eos=True, bad_words=bad_words_of(free))
    want = [r.output_ids for r in roomy.generate(prompts, params)]
    cfg = tiny_config(tiny_llama_dir, *over)
    tight = LLMEngine(cfg, load_tokenizer=False, workers=roomy.workers, worker_info={"num_slots": 360})
    got = [r.output_ids for r in tight.generate(prompts, params)]
    assert tight.schedulers[0].stats["preemptions"] > 0
    assert got == want
    with pytest.raises(ValueError, match="bad word"):
        SamplingParams(bad_words=[list(range(17))])
