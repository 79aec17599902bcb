"""C13: a finished request frees its over-allocated tail exactly, and nothing leaks."""
import pytest

from configs.schema import load_config
from serve_app.engine.request import Request, SamplingParams
from serve_app.engine.scheduler import Scheduler


def scheduler(page: int, cache: bool) -> Scheduler:
    cfg = load_config(overrides=[f"kv_cache.page_size={page}", "model.max_model_len=64",
                                 f"kv_cache.prefix_caching={str(cache).lower()}"])
    return Scheduler(cfg, {"num_slots": 1024, "num_rows": 8, "max_context": 256, "window": 4},
                     eos_token_ids=[2])


@pytest.mark.parametrize("page,tail", [(4, range(16, 24)), (1, range(13, 24))])
def test_c13_release_ranges(page, tail):
    s = scheduler(page, cache=False)
    committed, rest = s.release_ranges(13, 24)
    assert rest == tail
    assert committed == range(0, tail.start)


@pytest.mark.parametrize("page", [1, 4])
@pytest.mark.parametrize("cache", [False, True])
def test_c13_release_frees_everything(page, cache):
    s = scheduler(page, cache)
    free0 = s.slots.free_slots
    r = Request("r", list(range(3, 20)), SamplingParams())
    r.output_ids = [7]
    r.row = s.rows.alloc()
    r.slots = s.slots.alloc(24)
    r.kv_allocated_len, r.kv_committed_len = 24, 13
    freed_tail = set(r.slots[s.release_ranges(13, 24)[1].start:].tolist())
    s._release_kv(r)
    free_pages = set(s.slots._free_pages)
    assert all(slot // page in free_pages for slot in freed_tail)
    assert s.slots.free_slots + s.cache.total_slots == free0
    s.cache.evict(s.slots.capacity)
    assert s.slots.free_slots == free0
