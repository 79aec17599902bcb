"""Sum py-spy's raw stacks (`py-spy record -f raw`): the share of samples in each function,
inclusive and self, to see where a process's CPU goes without a flame-graph viewer.

    python -m benchmarks.stack_summary profile_replica.txt [--top 40]
"""
from __future__ import annotations

import argparse
import collections


def frame_name(frame: str) -> str:
    """'func (path/file.py:123)' -> 'func (file.py)'; line numbers only split self time."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rsplit('/', 1)[-1].split(':')[0]})" if where else name


def summarize(path: str) -> tuple[int, collections.Counter, collections.Counter]:
    inclusive, own = collections.Counter(), collections.Counter()
    total = 0
    for line in open(path):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        for name in {frame_name(f) for f in frames}:
            inclusive[name] += n
        own[frames[-1].rsplit("/", 1)[-1]] += n
    return total, inclusive, own


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args()
    total, inclusive, own = summarize(args.path)
    print(f"{total} samples")
    for title, counter in (("inclusive", inclusive), ("self (file:line)", own)):
        print(f"--- {title}")
        for name, n in counter.most_common(args.top):
            print(f"{100 * n / max(1, total):5.1f}%  {name}")


if __name__ == "__main__":
    main()
