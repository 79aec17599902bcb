"""Plot open-loop sweeps: goodput, p99 TTFT and p99 TPOT against request rate, one line per
server, on one figure.

    python -m benchmarks.plot_open_loop OUT.png RUN.json[=LABEL] [RUN.json ...] [--title TEXT]

Each RUN.json is what `benchmarks.http_bench --request-rate ...` wrote
(http_open_loop_<name>.json). The rate `inf` (all at once) is drawn one step past the
highest finite rate, and the goodput panel has the diagonal of every request meeting the
SLO. Needs matplotlib, imported only here (the GPU image has it; elsewhere
`pip install matplotlib`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def series(run: dict) -> dict[str, list]:
    """A run's points in rate order: x (the rate; `inf` at twice the highest finite rate, or
    1 when none is finite), its tick label, and the panels' figures (None where no request
    finished)."""
    rates = run["rates"]
    finite = [lv["request_rate"] for lv in rates if lv["request_rate"] != "inf"]
    inf_x = 2 * max(finite) if finite else 1.0
    rates = sorted(rates, key=lambda lv: inf_x if lv["request_rate"] == "inf" else lv["request_rate"])
    return {"x": [inf_x if lv["request_rate"] == "inf" else lv["request_rate"] for lv in rates],
            "labels": [lv["request_rate"] if lv["request_rate"] == "inf" else format(lv["request_rate"], "g")
                       for lv in rates],
            "goodput": [lv["goodput_req_s"] for lv in rates],
            "ttft_p99": [lv["ttft_p99_ms"] for lv in rates],
            "tpot_p99": [lv["tpot_p99_ms"] for lv in rates]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="RUN.json, or RUN.json=LABEL to name its line")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (good, ttft, tpot) = plt.subplots(1, 3, figsize=(15, 4.2))
    ticks: dict[float, str] = {}
    slo = None
    for spec in args.runs:
        path, _, label = spec.partition("=")
        run = json.loads(Path(path).read_text())
        s = series(run)
        ticks.update(zip(s["x"], s["labels"]))
        slo = slo or (run["slo_ttft_ms"], run["slo_tpot_ms"])
        line, = good.plot(s["x"], s["goodput"], marker="o", label=label or run["name"])
        for ax, key in ((ttft, "ttft_p99"), (tpot, "tpot_p99")):
            ax.plot(s["x"], s[key], marker="o", color=line.get_color())
    finite = [x for x, t in ticks.items() if t != "inf"]
    if finite:
        good.plot(sorted(finite), sorted(finite), ls=":", color="grey", label="every request met the SLO")
    for ax, ylabel, bound in ((good, "goodput (req/s within the SLO)", None),
                              (ttft, "TTFT p99 (ms)", slo[0]), (tpot, "TPOT p99 (ms)", slo[1])):
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(ticks), list(ticks.values()))
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if bound is not None:
            ax.axhline(bound, ls=":", color="grey", label="SLO")
            ax.set_yscale("log")
            ax.legend(fontsize=8)
    good.set_ylim(bottom=0)
    good.legend(fontsize=8)
    fig.suptitle(args.title or f"open loop, SLO TTFT <= {slo[0]:g} ms, TPOT <= {slo[1]:g} ms", fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
