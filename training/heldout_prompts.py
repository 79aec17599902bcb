"""A fixed evaluation prompt file from a run's held-out samples: `python -m training.heldout_prompts`.

A generated held-out split measures the head trained beside it, but the next run draws its
own. Written out as chat messages with their category, a few hundred of those prompts
become a prompt file that every later head is measured on (`python -m training.evaluate
--prompts FILE`) and that every later data run keeps out of its training data
(`--eval-only-prompts FILE`, the contamination check). A sample's prompt is its ids up to
the last assistant header (a multi-turn sample's first answer is part of it); the messages
are read back from the chat template's text and kept only where rendering them gives the
same ids.

    python -m training.heldout_prompts OUT/data/eval.jsonl --out FILE \\
        --per-category chat=60,code=60,math=30,multiturn=30,long=10,short=10
"""
from __future__ import annotations

import argparse
import json
import re
import sys

from training.data import load_jsonl, render_prompt

_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)<\|im_end\|>\n", re.S)


def messages_of(tokenizer, prompt_ids: list[int]) -> list[dict] | None:
    """The chat messages whose rendering is exactly `prompt_ids` (ending with the assistant
    header), or None where the text does not read back to them. A system turn the template
    writes by itself is left out, so rendering adds it again."""
    text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    turns = [{"role": r, "content": c} for r, c in _TURN.findall(text)]
    if not turns or turns[-1]["role"] != "user":
        return None
    for messages in (turns[1:] if turns[0]["role"] == "system" else None, turns):
        if messages and render_prompt(tokenizer, messages) == list(prompt_ids):
            return messages
    return None


def select(tokenizer, samples: list[dict], per_category: dict[str, int]) -> tuple[list[dict], dict]:
    """The first `per_category[c]` samples of each category, as prompt rows; and counts of
    what was taken and what did not read back."""
    rows, taken, unreadable = [], {c: 0 for c in per_category}, 0
    for s in samples:
        cat = s.get("category")
        if cat not in per_category or taken[cat] >= per_category[cat]:
            continue
        messages = messages_of(tokenizer, s["input_ids"][:s["prompt_len"]])
        if messages is None:
            unreadable += 1
            continue
        rows.append({"messages": messages, "category": cat, "kind": s.get("kind", cat)})
        taken[cat] += 1
    return rows, {"taken": taken, "unreadable": unreadable}


def parse_counts(spec: str) -> dict[str, int]:
    out = {}
    for part in spec.split(","):
        name, _, n = part.partition("=")
        if not name or not n.isdigit() or int(n) < 1:
            raise ValueError(f"--per-category: {part!r} is not CATEGORY=COUNT")
        out[name.strip()] = int(n)
    return out


def main(argv: list[str] | None = None) -> dict:
    from actors.models.loader import default_model_path
    from serve_app.text.tokenizer import load_tokenizer
    p = argparse.ArgumentParser(prog="python -m training.heldout_prompts", description=__doc__.split("\n\n")[0])
    p.add_argument("samples", help="a held-out sample file (OUT/data/eval.jsonl)")
    p.add_argument("--out", required=True)
    p.add_argument("--per-category", default="chat=60,code=60,math=30,multiturn=30,long=10,short=10")
    p.add_argument("--model", default=None, help="the target whose tokenizer wrote the samples (default: the default model)")
    args = p.parse_args(argv)
    tok = load_tokenizer(args.model or default_model_path())
    rows, counts = select(tok, load_jsonl(args.samples), parse_counts(args.per_category))
    with open(args.out, "w") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    print(json.dumps(counts), file=sys.stderr)
    return counts


if __name__ == "__main__":
    main()
