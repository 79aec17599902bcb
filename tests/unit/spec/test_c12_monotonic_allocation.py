"""C12: allocation ahead of need is monotonic and page-aligned."""
import pytest
import torch

from configs.schema import load_config
from serve_app.engine.request import Request, SamplingParams
from serve_app.engine.scheduler import Scheduler


def scheduler(page: int) -> Scheduler:
    cfg = load_config(overrides=[f"kv_cache.page_size={page}", "model.max_model_len=64"])
    info = {"num_slots": 4096, "num_rows": 8, "max_context": 256, "window": 8}
    return Scheduler(cfg, info, eos_token_ids=[2])


@pytest.mark.parametrize("page", [1, 4])
def test_c12_allocated_never_shrinks(page):
    s = scheduler(page)
    reqs = []
    for committed, allocated in [(10, 30), (10, 12), (5, 5)]:
        r = Request(f"r{committed}-{allocated}", [1] * 4, SamplingParams())
        r.row = s.rows.alloc()
        alloc = s.slots.round_up(allocated)
        r.slots = s.slots.alloc(alloc) if alloc else torch.zeros(0, dtype=torch.int64)
        r.kv_allocated_len, r.kv_committed_len = alloc, committed
        reqs.append(r)
    for window in (8, 4):
        for r in reqs:
            before, free_before = r.kv_allocated_len, s.slots.free_slots
            assert s._grow_kv(r, r.kv_committed_len + 2 * window)
            want = max(before, s.slots.round_up(r.kv_committed_len + 2 * window))
            assert r.kv_allocated_len == want
            delta = r.kv_allocated_len - before
            assert delta >= 0 and free_before - s.slots.free_slots == delta
            assert r.kv_allocated_len % page == 0
            assert r.slots.numel() == r.kv_allocated_len
            # the row records exactly the new slots, at the old end
            writes, s._kv_writes = s._kv_writes, []
            if delta:
                (row, start, slots), = writes
                assert (row, start, slots.numel()) == (r.row, before, delta)
            else:
                assert not writes
