"""C09: draft-extend preparation reads the lengths and never writes them."""
import torch

from actors.spec.eagle_worker import prepare_draft_extend
from serve_app.engine.request import SamplingParams


def test_c09_draft_extend_prep_leaves_lengths_alone():
    B, N, F = 3, 4, 8
    t = torch.tensor([10, 11, 12], dtype=torch.int64)
    c = t.clone()  # the CPU mirror
    s = int(c.sum())
    rows = torch.tensor([1, 2, 3])
    loc = torch.arange(B * N).view(B, N) + 100
    accept_index = torch.tensor([[0, 1, -1, -1], [0, -1, -1, -1], [0, 1, 2, 3]])
    predict = torch.tensor([[5, 6, -1, -1], [7, -1, -1, -1], [8, 9, 10, 11]])
    feats = torch.randn(B * N, F)
    fb = prepare_draft_extend(rows, t, loc, accept_index, predict, feats, N)
    assert torch.equal(t, c) and int(t.sum()) == s  # same values, same sum
    assert fb.prefix_lens is t  # the view reads the very same tensor
    assert torch.equal(fb.seq_lens, t + N)
    assert int(fb.seq_lens.sum()) == int(c.sum()) + B * N
    assert fb.extend_lens == [N] * B
    # row j of request b carries the feature of accepted node j
    assert torch.equal(fb.hidden_in[N + 0], feats[N + 0])
    assert torch.equal(fb.hidden_in[2 * N + 3], feats[2 * N + 3])
    assert fb.input_ids.dtype == torch.int64 and fb.input_ids[:2].tolist() == [5, 6]


def test_c09_only_result_processing_moves_committed_length(tiny_llama_dir):
    from spec_helpers import CHAIN, random_prompts, tiny_engine
    eng = tiny_engine(tiny_llama_dir, *CHAIN)
    sched, worker = eng.schedulers[0], eng.workers[0]
    req = eng.add_request(random_prompts(1)[0], SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step()  # prefill
    while not req.finished:
        before = req.kv_committed_len
        plan = sched.schedule()
        assert req.kv_committed_len == before  # planning does not commit
        out = worker.execute(plan)
        assert req.kv_committed_len == before  # executing does not commit
        sched.process_output(plan, out)
        if not req.finished:
            assert req.kv_committed_len == before + len(out.tokens[0])
            assert req.kv_committed_len == int(worker.future.seq_lens[req.row])
