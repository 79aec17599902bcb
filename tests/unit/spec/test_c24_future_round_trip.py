"""C24: values carried to the next iteration come back unchanged; idle resolve is a no-op."""
import torch

from actors.worker.future_map import FutureMap


def test_c24_round_trip():
    fm = FutureMap(num_rows=6, topk=3, hidden_size=5, dtype=torch.float32, device="cpu", spec=True)
    rows = torch.tensor([4, 1])
    seq = torch.tensor([17, 2**40 + 3])
    bonus = torch.tensor([9, 11], dtype=torch.int32)  # an int32 producer
    p = torch.rand(2, 3)
    idx = torch.randint(0, 100, (2, 3))
    h = torch.randn(2, 5)
    fm.store(rows, seq, bonus, p, idx, h)
    c = fm.resolve(rows)
    assert c.bonus.dtype == torch.int64 and c.bonus.tolist() == [9, 11]
    assert c.seq_lens.tolist() == seq.tolist()
    assert torch.equal(c.topk_p, p) and torch.equal(c.topk_index, idx) and torch.equal(c.hidden, h)
    # another row's store does not disturb these
    fm.store(torch.tensor([2]), torch.tensor([5]), torch.tensor([1]), p[:1], idx[:1], h[:1])
    assert torch.equal(fm.resolve(rows).hidden, h)
    # an idle rank: empty resolve and store change nothing
    snapshot = (fm.seq_lens.clone(), fm.bonus.clone(), fm.hidden.clone())
    empty = torch.zeros(0, dtype=torch.int64)
    e = fm.resolve(empty)
    assert e.seq_lens.numel() == 0 and e.hidden.shape == (0, 5)
    fm.store(empty, empty, empty, torch.zeros(0, 3), torch.zeros(0, 3, dtype=torch.int64),
             torch.zeros(0, 5))
    assert torch.equal(fm.seq_lens, snapshot[0]) and torch.equal(fm.bonus, snapshot[1])
    assert torch.equal(fm.hidden, snapshot[2])


def test_c24_engine_carries_lengths(tiny_llama_dir):
    """In a real run the future map's length equals the scheduler's committed length (after
    each step, with none launched ahead: a launched step has moved the map on)."""
    from spec_helpers import TREE, greedy, random_prompts, tiny_engine
    eng = tiny_engine(tiny_llama_dir, *TREE, "scheduler.launch_ahead=false")
    reqs = [eng.add_request(p, greedy(10)) for p in random_prompts(3, seed=5)]
    checked = 0
    while eng.has_work:
        eng.step()
        for r in reqs:
            if r.row is not None and not r.finished and r.output_ids:
                assert int(eng.workers[0].future.seq_lens[r.row]) == r.kv_committed_len
                assert int(eng.workers[0].future.bonus[r.row]) == r.output_ids[-1]
                checked += 1
    assert checked > 0
