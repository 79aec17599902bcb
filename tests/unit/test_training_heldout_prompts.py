"""Held-out samples become a prompt file: the messages read back from the template's text
render to the very ids the samples hold, multi-turn ones included, and the file shipped in
benchmarks/data reads as evaluation prompts and as a contamination index."""
from __future__ import annotations

import json

from training.data import render_prompt, user_turn_prefix
from training.heldout_prompts import messages_of, parse_counts, select

SHIPPED = "benchmarks/data/smollm2_heldout_prompts.jsonl"


def sample(tokenizer, messages, answer_ids, category):
    p = render_prompt(tokenizer, messages)
    return {"input_ids": p + answer_ids, "prompt_len": len(p), "category": category, "kind": category}


def test_messages_read_back_to_the_same_ids(tokenizer):
    one = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    two = one + [{"role": "assistant", "content": "def add(a, b):\n    return a + b"},
                 {"role": "user", "content": "Thanks! Now make it add three."}]
    for messages in (one, two):
        ids = render_prompt(tokenizer, messages)
        assert messages_of(tokenizer, ids) == messages
    # a system turn of the user's own stays; ids cut mid-turn do not read back
    own = [{"role": "system", "content": "Answer in French."}] + one
    assert messages_of(tokenizer, render_prompt(tokenizer, own)) == own
    assert messages_of(tokenizer, render_prompt(tokenizer, one)[:-3]) is None
    prefix, _ = user_turn_prefix(tokenizer)
    assert messages_of(tokenizer, prefix) is None


def test_select_takes_the_first_of_each_category(tokenizer):
    rows = [sample(tokenizer, [{"role": "user", "content": f"Question {i} about {c}?"}], [5, 6], c)
            for i, c in enumerate(["chat", "code", "chat", "math", "chat", "code"])]
    got, counts = select(tokenizer, rows, {"chat": 2, "code": 1})
    assert [r["messages"][0]["content"] for r in got] == ["Question 0 about chat?", "Question 1 about code?",
                                                          "Question 2 about chat?"]
    assert counts == {"taken": {"chat": 2, "code": 1}, "unreadable": 0}
    assert parse_counts("chat=60,code=5") == {"chat": 60, "code": 5}


def test_the_shipped_file_is_usable_both_ways(tokenizer):
    from training.contamination import build_index
    from training.evaluate import read_eval_prompts
    rows = [json.loads(line) for line in open(SHIPPED)]
    cats = {}
    for r in rows:
        cats[r["category"]] = cats.get(r["category"], 0) + 1
        assert r["messages"][-1]["role"] == "user"
    assert cats == {"chat": 60, "code": 60, "math": 30, "multiturn": 30, "long": 10, "short": 10}
    prompts, categories = read_eval_prompts(SHIPPED, tokenizer)
    assert len(prompts) == 200 and categories[:3] == [r["category"] for r in rows[:3]]
    index = build_index([SHIPPED])
    follow_up = [m["content"] for m in rows[-1]["messages"] if m["role"] == "user"][-1]
    assert index.match(rows[1]["messages"][0]["content"]) == ("exact", "smollm2_heldout_prompts")
    assert index.match(follow_up.upper() + "!") is not None  # every user turn, case and punctuation aside
