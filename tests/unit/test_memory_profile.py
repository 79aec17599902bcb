"""The start-up memory plan's arithmetic (actors/worker/memory_profile.py) and its export.
The profile itself needs a GPU: tests/gpu/test_memory_profile_gpu.py."""
import pytest

from actors.worker.memory_profile import (MemoryPlan, graph_bytes, graph_bytes_beyond,
                                          kv_bytes_left, profiled_sizes)
from configs.schema import graph_sizes_up_to, load_config


def test_profiled_sizes_are_the_ends_and_the_middle():
    sizes = graph_sizes_up_to(512)
    assert profiled_sizes(sizes) == [1, sizes[len(sizes) // 2], 512]
    assert profiled_sizes([4]) == [4]
    assert profiled_sizes([2, 8]) == [2, 8]


def test_missing_sizes_follow_the_line_through_the_smaller_captured_ones():
    # Graphs whose outputs take 1000 + 10 * b bytes; the largest also holds 10**6 of
    # intermediates that the others reuse.
    sizes = [1, 2, 4, 8, 16, 32, 64]
    cost = {b: 1000 + 10 * b for b in sizes}
    per_size = {b: cost[b] for b in (1, 8)} | {64: cost[64] + 10 ** 6}
    assert graph_bytes_beyond(per_size, sizes) == sum(cost[b] for b in (2, 4, 16, 32))
    assert graph_bytes_beyond(per_size, [1, 8, 64]) == 0


def test_smaller_sizes_count_what_they_keep_not_what_the_device_lost():
    # The largest size took 10**6 from the device (intermediates and outputs); the two
    # smaller ones fit in the blocks it left free (the device lost nothing) but keep
    # outputs of 10 * b bytes, as every size between them will.
    sizes = [1, 2, 4, 8, 16, 32, 64]
    per_size = {64: (10 ** 6, 640), 8: (0, 80), 1: (0, 10)}
    assert graph_bytes(per_size, sizes) == 10 ** 6 + sum(10 * b for b in sizes if b != 64)
    # never less than the profile's own graphs took from the device
    assert graph_bytes({64: (100, 640), 8: (5000, 80), 1: (0, 10)}, [1, 8, 64]) == 5100
    assert graph_bytes({64: (700, 640)}, [64]) == 700


def test_a_falling_line_is_not_extrapolated_below_zero():
    per_size = {1: 5000, 8: 1000, 64: 10 ** 6}  # allocator noise: the smaller size cost more
    assert graph_bytes_beyond(per_size, [1, 8, 16, 64]) == 5000  # flat at the smaller's cost


def test_with_one_smaller_size_each_missing_size_costs_as_much_as_it():
    assert graph_bytes_beyond({2: 300, 64: 10 ** 6}, [2, 4, 8, 64]) == 600
    assert graph_bytes_beyond({64: 900}, [8, 64]) == 900


def test_kv_gets_the_budget_less_everything_else_and_no_more_than_is_free():
    G = 2 ** 30
    assert kv_bytes_left(100 * G, 0.9, own=20 * G, free=80 * G, graphs=10 * G, other=5 * G) == 55 * G
    # another process holds most of the device: only what is free counts
    assert kv_bytes_left(100 * G, 0.9, own=20 * G, free=30 * G, graphs=10 * G, other=5 * G) == 15 * G


def test_the_old_memory_fraction_key_is_refused_by_name():
    with pytest.raises(ValueError, match="memory_fraction"):
        load_config(None, ["kv_cache.memory_fraction=0.5"])
    assert load_config(None, ["kv_cache.memory_utilization=0.8"]).kv_cache.memory_utilization == 0.8
    with pytest.raises(ValueError, match="memory_utilization"):
        load_config(None, ["kv_cache.memory_utilization=1.5"])


def test_the_memory_plan_is_exported_per_rank_and_part():
    from serve_app.api.metrics import ServerMetrics
    plan = MemoryPlan(total=100, budget=90, weights=20, graphs_estimate=12, other=5, kv_cache=53,
                      profile_seconds=1.0, graphs=11)
    m = ServerMetrics("m")
    m.update_engine({"replica": "r", "running": 0, "waiting": 0, "kv": [],
                     "memory": [{"rank": 0, **plan.as_dict()}]})
    text = m.render()[0].decode()
    for part, value in (("kv_cache", 53), ("graphs", 11), ("graphs_estimate", 12), ("weights", 20)):
        line = f'kestrel_device_memory_bytes{{model="m",part="{part}",rank="0",replica="r"}} {float(value)}'
        assert line in text, (line, [l for l in text.splitlines() if "device_memory" in l])
