"""C14: slots of rejected drafts stay allocated and the next round writes into them."""
import torch

from actors.worker.forward_batch import ForwardMode
from spec_helpers import TREE, greedy, random_prompts, tiny_engine


def test_c14_rejected_slots_are_reused(tiny_llama_dir, monkeypatch):
    eng = tiny_engine(tiny_llama_dir, *TREE)
    sched, worker = eng.schedulers[0], eng.workers[0]
    req = eng.add_request(random_prompts(1, seed=3)[0], greedy(40))
    eng.step()  # prefill
    verify_locs = []
    real = worker.target.forward

    def spy(fb, **kw):
        if fb.mode == ForwardMode.TARGET_VERIFY:
            verify_locs.append(fb.out_cache_loc.clone())
        return real(fb, **kw)
    monkeypatch.setattr(worker.target, "forward", spy)
    rounds = 0
    while not req.finished:
        free_before, alloc_before = sched.slots.free_slots, req.kv_allocated_len
        slots_before = req.slots.clone()
        seq_before = req.kv_committed_len
        plan = sched.schedule()
        grown = req.kv_allocated_len - alloc_before
        # the free count moves only by what the window grew; nothing was freed
        assert free_before - sched.slots.free_slots == grown >= 0
        out = worker.execute(plan)
        loc = verify_locs[-1]
        # drafts start at the committed length, in slots this row already held
        assert torch.equal(loc, req.slots[seq_before:seq_before + loc.numel()])
        if rounds and len(out.tokens[0]) < eng.cfg.draft.num_draft_tokens:
            # what the last round rejected is written again now, not reallocated
            assert set(loc.tolist()) & set(slots_before.tolist())
        sched.process_output(plan, out)
        rounds += 1
    assert rounds > 3
    assert any(a < eng.cfg.draft.num_steps + 1 for a in req.accept_lengths)  # some rejections
