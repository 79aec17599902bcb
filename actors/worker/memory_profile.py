"""How much device memory the KV cache may take: what is left after everything else.

A rank on a GPU holds, besides its KV cache: the target's and the draft's weights, the
graphs of every batch size the scheduler can form (their static outputs, and one pool of
intermediates that smaller sizes reuse), the tables sized by the running limit (rows'
slots, output counts, processing, future map) and the blocks a worst-case eager step
leaves in the caching allocator. Graphs are captured against the KV pool's buffers, so the
pool must exist first; its size has to come from a measurement made before.

The profile: a throwaway worker shares the loaded weights, holds a small KV pool, captures
its graphs at three of the batch sizes (the largest, one in the middle, the smallest),
runs the start-up warm-ups (the largest prefill shapes among them), and is dropped. What
the device lost meanwhile is everything but the KV cache at those three sizes. The sizes
not captured are filled in per size from what the middle and the smallest size's graphs
keep allocated (their outputs, on a line in the batch size), not from what the device
lost while they were captured: those graphs took most of their memory from blocks the
largest size's intermediates had left free in the pool, which the real capture's first
few sizes use up (measured: the device-loss line missed a quarter of the graphs of 512
streams). After the real capture the rank logs the estimate beside what the graphs took.
"""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import asdict, dataclass

log = logging.getLogger("kestrel.worker")

GIB = 2 ** 30


def profiled_sizes(sizes: list[int]) -> list[int]:
    """The batch sizes the profile captures: the smallest, the middle one, the largest."""
    s = sorted(sizes)
    return sorted({s[0], s[len(s) // 2], s[-1]})


def graph_bytes_beyond(per_size: dict[int, int], sizes: list[int]) -> int:
    """Bytes the graphs of the sizes in `sizes` but not in `per_size` (captured: size ->
    the bytes its graphs keep) will take, on the line through the two smallest captured
    sizes (the largest holds the shared intermediates, so it is off the line). With fewer
    than two such sizes, each missing size costs as much as the largest of them."""
    missing = [b for b in sizes if b not in per_size]
    if not missing:
        return 0
    small = sorted(b for b in per_size if b != max(per_size))
    if len(small) < 2:
        each = max((per_size[b] for b in small), default=max(per_size.values()))
        return each * len(missing)
    (b0, b1) = small[0], small[-1]
    slope = max(0.0, (per_size[b1] - per_size[b0]) / (b1 - b0))
    return int(sum(max(0.0, per_size[b0] + slope * (b - b0)) for b in missing))


def graph_bytes(per_size: dict[int, tuple[int, int]], sizes: list[int]) -> int:
    """Every size's graphs, from the profile's (size -> (device bytes taken, bytes kept)):
    the largest size's device cost (its intermediates, in the pool the others reuse, and
    its outputs), then per smaller size what its graphs keep allocated, measured or on the
    line; never less than the profile's graphs took."""
    top = max(per_size)
    kept = {b: max(0, k) for b, (_, k) in per_size.items() if b != top}
    rest = sum(kept.values()) + graph_bytes_beyond(kept | {top: 0}, [b for b in sizes if b != top])
    return max(per_size[top][0] + rest, sum(dev for dev, _ in per_size.values()))


@dataclass
class MemoryPlan:
    """A rank's device memory, in bytes: what the profile measured and what the KV gets."""
    total: int  # the device's
    budget: int  # kv_cache.memory_utilization of it: all this rank may hold
    weights: int  # target and draft: what this process's allocator held before the profile
    graphs_estimate: int  # every captured size's graphs, from the profile
    other: int  # tables by the running limit, warm-up blocks, library workspaces
    kv_cache: int  # what is left: budget - weights - graphs_estimate - other
    profile_seconds: float
    graphs: int | None = None  # what the real capture took, once done

    def as_dict(self) -> dict:
        return asdict(self)


def kv_bytes_left(total: int, utilization: float, own: int, free: int, graphs: int,
                  other: int) -> int:
    """The KV cache's bytes: the budget (utilization of the device) less what this rank
    holds already (`own`: weights), but no more than is free (another process may share
    the device), less the graphs to capture and the rest the profile measured."""
    return min(int(total * utilization) - own, free) - graphs - other


def plan_memory(cfg, rank: int, loaded, kv_bytes_per_slot: int, profile_slots: int) -> MemoryPlan:
    """Profile a throwaway RankWorker on `loaded` (the built target and draft) and return
    the memory plan; `profile_slots` is the throwaway's KV pool, `kv_bytes_per_slot` what
    one slot costs in target and draft layers. CUDA only."""
    import torch

    from actors.graphs.capture_progress import PROGRESS
    from actors.worker.rank_worker import RankWorker
    from kestrel_kernels.compile_watch import CompileWatch

    dev = torch.device(cfg.resolved_device())
    t0 = time.time()
    torch.cuda.synchronize(dev)
    gc.collect()
    torch.cuda.empty_cache()
    free0, total = torch.cuda.mem_get_info(dev)
    own = torch.cuda.memory_reserved(dev)
    a = cfg.attention
    graphs = a.cuda_graphs and not cfg.parallel.dp_attention
    sizes = cfg.graph_batch_sizes()
    sizes = [b for b in sizes if b < cfg.scheduler.max_running_requests + 2]
    upd = {"kv_cache": cfg.kv_cache.model_copy(update={"num_slots": profile_slots})}
    if graphs:
        upd["attention"] = a.model_copy(update={"cuda_graph_batch_sizes": profiled_sizes(sizes)})
    pcfg = cfg.model_copy(update=upd)
    log.info("rank %d: profiling device memory (graphs at batch sizes %s, warm-ups)", rank,
             profiled_sizes(sizes) if graphs else "none")
    PROGRESS.track_memory(dev)
    try:
        worker = RankWorker(pcfg, rank, loaded=loaded)
        per_size = PROGRESS.bytes_per_size()
    finally:
        PROGRESS.track_memory(None)
        CompileWatch.pause_all()  # the throwaway armed its watch; the real worker arms its own
    torch.cuda.synchronize(dev)
    used = free0 - torch.cuda.mem_get_info(dev)[0]  # the throwaway's all but weights
    del worker
    gc.collect()
    torch.cuda.empty_cache()
    leaked = free0 - torch.cuda.mem_get_info(dev)[0]
    profiled_graphs = sum(dev for dev, _ in per_size.values())
    graphs_estimate = graph_bytes(per_size, sizes) if graphs else 0
    other = max(0, used - profiled_graphs - profile_slots * kv_bytes_per_slot)
    own += max(0, leaked)
    kv = kv_bytes_left(total, cfg.kv_cache.memory_utilization, own, free0 - max(0, leaked),
                       graphs_estimate, other)
    plan = MemoryPlan(total, int(total * cfg.kv_cache.memory_utilization), own,
                      graphs_estimate, other, kv, round(time.time() - t0, 1))
    log.info("rank %d: memory profile in %.1fs: device %.1f GiB, budget %.1f GiB "
             "(kv_cache.memory_utilization=%.2f): weights %.2f, graphs %.2f (estimated), "
             "tables and activations %.2f, KV cache %.2f GiB%s", rank, plan.profile_seconds,
             total / GIB, plan.budget / GIB, cfg.kv_cache.memory_utilization, own / GIB,
             graphs_estimate / GIB, other / GIB, kv / GIB,
             "" if graphs or not a.cuda_graphs else
             " (dp_attention: its graphs, captured once the group forms, are not in the profile)")
    if leaked > 64 * 2 ** 20:
        log.warning("rank %d: the memory profile left %.2f GiB held after it was dropped",
                    rank, leaked / GIB)
    return plan
