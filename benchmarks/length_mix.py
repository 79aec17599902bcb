"""The requests of an open-loop run: prompts with the answer length each asks for.

A mix is a JSONL file, one request a line: {"messages": [...], "max_tokens": N} (a chat)
or {"prompt": "...", "max_tokens": N} (a text completion). Or the named mix `mt-bench`
(the default): the 80 MT-bench first turns the closed benchmark sends
(benchmarks.offline.DATA) as chats, each with max_tokens drawn uniformly from an
inclusive range (64..512 unless told) with the run's seed. Answers run to max_tokens
(ignore_eos), so the lengths are the mix's.

    python -m benchmarks.length_mix [--seed S] [--answer-tokens 64 512] > mix.jsonl

writes the named mix out, to edit or to replay elsewhere.
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from benchmarks.offline import DATA, load_questions


def mt_bench_mix(seed: int = 0, answer_tokens: tuple[int, int] = (64, 512)) -> list[dict]:
    rng = random.Random(seed)
    return [{"messages": [{"role": "user", "content": q}], "max_tokens": rng.randint(*answer_tokens)}
            for q in load_questions(DATA, 80)]


def load_mix(path: str | Path) -> list[dict]:
    """The rows of a mix file; a line that is neither a chat nor a prompt with a positive
    max_tokens is an error naming the line."""
    rows = []
    for i, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        ok = (isinstance(row, dict) and ("messages" in row) != ("prompt" in row)
              and isinstance(row.get("max_tokens"), int) and row["max_tokens"] > 0
              and (isinstance(row.get("prompt"), str) or isinstance(row.get("messages"), list)))
        if not ok:
            raise ValueError(f"{path}:{i}: want {{\"messages\": [...] | \"prompt\": \"...\", "
                             f"\"max_tokens\": N > 0}}, got {line[:120]}")
        rows.append({k: row[k] for k in ("messages", "prompt", "max_tokens") if k in row})
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def resolve_mix(name_or_path: str, seed: int, answer_tokens: tuple[int, int]) -> list[dict]:
    if name_or_path == "mt-bench":
        return mt_bench_mix(seed, answer_tokens)
    return load_mix(name_or_path)


def requests_for(mix: list[dict], n: int, seed: int) -> list[dict]:
    """n requests: the mix in a seeded order, again in a fresh order when n outruns it."""
    rng = random.Random(seed)
    out: list[dict] = []
    while len(out) < n:
        order = list(mix)
        rng.shuffle(order)
        out += order[:n - len(out)]
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--answer-tokens", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"))
    args = ap.parse_args(argv)
    for row in mt_bench_mix(args.seed, tuple(args.answer_tokens)):
        print(json.dumps(row))


if __name__ == "__main__":
    main()
