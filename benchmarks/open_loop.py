"""An open-loop run: requests sent on an arrival schedule whatever the server's progress,
and its summary against a latency SLO.

Per request rate: request throughput, output tokens/s, TTFT, ITL (the gap between streamed
chunks with text, every gap of every request), TPOT (per request, its time per output
token after the first), end-to-end latency, each at p50 and p99, and goodput: the requests
per second that met the SLO (TTFT and TPOT both within it), with their share of all sent.
A failed request (an HTTP error, a rejection when the server's queue is full, an error
event) counts as sent and not met. Seconds run from the schedule's start to the last
answer's end. `send lag` is how late the client sent behind the schedule: when its p99
grows, the client, not the server, is what is measured (--client-processes).
"""
from __future__ import annotations

import math

from benchmarks.http_client import client_session, pct, run_in_processes, server_side


def _pcts(xs: list[float], scale: float) -> tuple[float | None, float | None]:
    return (scale * pct(xs, 0.5), scale * pct(xs, 0.99)) if xs else (None, None)


def summarize_open(rows: list[dict], seconds: float, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    ok = [r for r in rows if "error" not in r]
    met = sum(r["ttft"] <= slo_ttft_s and r["tpot"] <= slo_tpot_s for r in ok)
    out = {"requests": len(rows), "completed": len(ok), "failed": len(rows) - len(ok),
           "errors": sorted({r["error"] for r in rows if "error" in r})[:5], "seconds": seconds,
           "req_s": len(ok) / seconds, "tok_s": sum(r["tokens"] for r in ok) / seconds,
           "goodput_req_s": met / seconds, "slo_met_share": met / len(rows) if rows else 0.0}
    for key, xs, scale in (("ttft", [r["ttft"] for r in ok], 1000), ("itl", [g for r in ok for g in r["gaps"]], 1000),
                           ("tpot", [r["tpot"] for r in ok], 1000), ("e2e", [r["e2e"] for r in ok], 1),
                           ("send_lag", [r["lag"] for r in rows], 1000)):
        unit = "s" if scale == 1 else "ms"
        out[f"{key}_p50_{unit}"], out[f"{key}_p99_{unit}"] = _pcts(xs, scale)
    return out


async def run_rate(url: str, model: str, requests: list[dict], offsets: list[float], procs: int,
                   extra: dict | None, slo_ttft_s: float, slo_tpot_s: float) -> dict:
    """requests[i] sent at offsets[i] s, dealt round-robin over `procs` client processes so
    each one's share spans the whole schedule."""
    jobs = [(t, {k: v for k, v in r.items() if k != "max_tokens"}, r["max_tokens"])
            for t, r in zip(offsets, requests)]
    shares = [s for s in (jobs[i::procs] for i in range(procs)) if s]
    async with client_session(1) as session:  # for /metrics
        rows, seconds, before, after = await run_in_processes(url, model, shares, session, extra,
                                                              warm=4, keep_errors=True)
    return {**summarize_open(rows, seconds, slo_ttft_s, slo_tpot_s), "client_processes": len(shares),
            "server": server_side(before, after, seconds)}


def rate_label(rate: float) -> float | str:
    """A rate as the JSON holds it: strict JSON has no infinity."""
    return "inf" if math.isinf(rate) else rate


def table(name: str, rates: list[dict]) -> str:
    head = ("| server | rate req/s | sent / failed | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
            "TPOT p50 / p99 ms | e2e p50 / p99 s | goodput req/s | met SLO | send lag p99 ms |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]

    def two(lv: dict, key: str, unit: str, fmt: str) -> str:
        a, b = lv[f"{key}_p50_{unit}"], lv[f"{key}_p99_{unit}"]
        return "-" if a is None else f"{a:{fmt}} / {b:{fmt}}"

    for lv in rates:
        rate = lv["request_rate"]
        lines.append(
            f"| {name} | {rate if isinstance(rate, str) else format(rate, 'g')} | {lv['requests']} / {lv['failed']} | {lv['req_s']:.2f} | "
            f"{lv['tok_s']:.0f} | {two(lv, 'ttft', 'ms', '.0f')} | {two(lv, 'itl', 'ms', '.1f')} | "
            f"{two(lv, 'tpot', 'ms', '.1f')} | {two(lv, 'e2e', 's', '.2f')} | {lv['goodput_req_s']:.2f} | "
            f"{lv['slo_met_share']:.0%} | {lv['send_lag_p99_ms']:.1f} |")
    return "\n".join(lines)
