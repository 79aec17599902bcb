"""Where the GPU waits: the gaps between device activities in a torch.profiler trace.

A step that costs more than its kernels leaves the device idle somewhere, and py-spy sees
only the host's side of it. From the kernels and copies the profiler recorded (CUPTI sees
those inside graph replays too), this takes the union of their intervals: the device busy
time, the idle time in between, and the gaps grouped by the activities on either side, so
a wait has a place: "after the verify forward's last kernel, before the mask copy".

    summary = gaps(device_intervals(prof), steps)   # feature_cost --timeline DIR
"""
from __future__ import annotations

import collections
from typing import Iterable

Interval = tuple[float, float, str]  # start us, end us, activity name


def device_intervals(prof) -> list[Interval]:
    """Kernels and memory copies a torch.profiler run recorded on the GPU."""
    import torch
    return [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA]


def _short(name: str, width: int = 60) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def gaps(intervals: Iterable[Interval], steps: int, min_gap_us: float = 2.0, top: int = 12) -> dict:
    """Busy and idle device time per step over the span of `intervals`, and the idle time
    grouped by (what ended before it, what started after it), largest first. Gaps under
    `min_gap_us` (a launch's own spacing) count as idle but are not grouped."""
    ivs = sorted(intervals)
    if not ivs:
        return {"steps": steps, "span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "gaps": []}
    busy = 0.0
    by_edge: dict[tuple[str, str], list[float]] = collections.defaultdict(list)
    start, end, last = ivs[0][0], ivs[0][1], ivs[0][2]
    for s, e, name in ivs[1:]:
        if s > end:  # a gap: the device had nothing running
            busy += end - start
            if s - end >= min_gap_us:
                by_edge[(_short(last), _short(name))].append(s - end)
            start, end = s, e
        if e >= end:
            end, last = e, name
    busy += end - start
    span = end - ivs[0][0]  # end: the latest end of all, blocks being in order
    per = max(1, steps)
    grouped = sorted(((sum(v), len(v), k) for k, v in by_edge.items()), reverse=True)[:top]
    return {"steps": steps, "span_us": span / per, "busy_us": busy / per, "idle_us": (span - busy) / per,
            "gaps": [{"before": k[0], "after": k[1], "count_per_step": n / per, "us_per_step": t / per}
                     for t, n, k in grouped]}


def table(summary: dict) -> str:
    lines = [f"per step: span {summary['span_us']:.0f} us, device busy {summary['busy_us']:.0f} us, "
             f"idle {summary['idle_us']:.0f} us ({summary['steps']} steps)",
             "| idle us per step | gaps per step | ended before the gap | started after it |",
             "|---|---|---|---|"]
    for g in summary["gaps"]:
        lines.append(f"| {g['us_per_step']:.1f} | {g['count_per_step']:.2f} | {g['before']} | {g['after']} |")
    return "\n".join(lines)
