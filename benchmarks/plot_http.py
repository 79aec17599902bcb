"""Plot http_bench results: tokens/s and TTFT p50 against concurrency, one line per run.

    python -m benchmarks.plot_http OUT.png RUN.json[=LABEL] [RUN.json ...] [--title TEXT]

Each RUN.json is what `benchmarks.http_bench` wrote (http_bench_<name>.json); a run with
in-process figures gets a dashed line for them too. Needs matplotlib (the GPU image has
it; elsewhere `pip install matplotlib`).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("runs", nargs="+", help="RUN.json, or RUN.json=LABEL to name its line")
    ap.add_argument("--title", default="")
    args = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (tps, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    for spec in args.runs:
        path, _, label = spec.partition("=")
        run = json.loads(Path(path).read_text())
        run["name"] = label or run["name"]
        levels = sorted(run["levels"], key=lambda lv: lv["concurrency"])
        c = [lv["concurrency"] for lv in levels]
        line, = tps.plot(c, [lv["tok_s"] for lv in levels], marker="o", label=run["name"])
        ttft.plot(c, [lv["ttft_p50_ms"] for lv in levels], marker="o", color=line.get_color(),
                  label=run["name"])
        inproc = [lv.get("in_process") for lv in levels]
        if all(inproc):
            tps.plot(c, [ip["tok_s"] for ip in inproc], ls="--", color=line.get_color(),
                     label=f"{run['name']} in-process")
    for ax, label in ((tps, "output tokens/s"), (ttft, "TTFT p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ttft.set_yscale("log")
    tps.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
