"""Sum py-spy's raw stacks (`py-spy record -f raw`): the share of samples in each function,
inclusive and self, to see where a process's CPU goes without a flame-graph viewer.

    python -m benchmarks.stack_summary profile_replica.txt [--top 40] [--within generate]

--within keeps the samples whose stack holds a function of that name, a method's name
without its class (a run's timed part, without model load and graph capture).
"""
from __future__ import annotations

import argparse
import collections


def frame_name(frame: str) -> str:
    """'func (path/file.py:123)' -> 'func (file.py)'; line numbers only split self time."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':')[0]})" if where else name


def summarize(path: str, within: str | None = None) -> tuple[int, collections.Counter, collections.Counter]:
    inclusive, own = collections.Counter(), collections.Counter()
    total = 0
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n = int(count)
        frames = stack.split(";")
        if within is not None and not any(f.partition(" (")[0].rsplit(".", 1)[-1] == within for f in frames):
            continue
        total += n
        for name in {frame_name(f) for f in frames}:
            inclusive[name] += n
        own[frames[-1].rsplit("/", 1)[-1]] += n
    return total, inclusive, own


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--within", default=None, help="only stacks through this function")
    args = ap.parse_args()
    total, inclusive, own = summarize(args.path, args.within)
    print(f"{total} samples")
    for title, counter in (("inclusive", inclusive), ("self (file:line)", own)):
        print(f"--- {title}")
        for name, n in counter.most_common(args.top):
            print(f"{100 * n / max(1, total):5.1f}%  {name}")


if __name__ == "__main__":
    main()
