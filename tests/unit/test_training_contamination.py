"""Evaluation-only prompts are kept out of training data: exact copies and light edits of
an MT-bench or other evaluation prompt are caught, unrelated prompts kept."""
from __future__ import annotations

import json

from training.contamination import ContaminationFilter, EvalPromptIndex, build_index

MT_FIRST = ("Compose an engaging travel blog post about a recent trip to Hawaii, highlighting "
            "cultural experiences and must-see attractions.")
MT_SECOND = "Rewrite your previous response. Start every sentence with the letter A."


def test_mt_bench_exact_and_edited_copies_are_caught():
    index = build_index()  # MT-bench is always indexed
    assert index.match(MT_FIRST) == ("exact", "mt_bench_questions")
    assert index.match(MT_SECOND) == ("exact", "mt_bench_questions")  # later turns count too
    # case, punctuation and spacing only
    assert index.match("compose an ENGAGING travel blog post about a recent trip to hawaii -- highlighting "
                       "cultural experiences AND must see attractions")[0] == "exact"
    # one word changed
    assert index.match(MT_FIRST.replace("Hawaii", "Japan")) == ("near", "mt_bench_questions")
    # pasted inside a longer request
    assert index.match("Hi! " + MT_FIRST + " Please keep it under 300 words and add a packing list.") \
        == ("near", "mt_bench_questions")


def test_unrelated_prompts_are_kept():
    index = build_index()
    for text in ["Write a Python function that merges two sorted lists into one sorted list.",
                 "What is the capital of Australia?",
                 "Compose a short poem about autumn leaves falling in a quiet park.",
                 "Hawaii"]:
        assert index.match(text) is None, text


def test_other_eval_files_and_filter_counts(tmp_path):
    humaneval = tmp_path / "humaneval.jsonl"
    rows = [{"task_id": "x/0", "prompt": "def add(a, b):\n    \"\"\"Return the sum of a and b, "
                                          "both integers, without using the plus operator.\"\"\"\n"},
            {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as "
                         "many clips in May. How many clips did Natalia sell altogether?"}]
    humaneval.write_text("".join(json.dumps(r) + "\n" for r in rows))
    index = build_index([humaneval], include_mt_bench=False)
    flt = ContaminationFilter(index)
    assert not flt.keep(rows[0]["prompt"])
    assert not flt.keep(rows[1]["question"].replace("48", "50").replace("clips", "Clips"))
    assert flt.keep(MT_FIRST)  # MT-bench left out on purpose here
    assert flt.keep("Explain what a hash map is.")
    rep = flt.report()
    assert rep["checked"] == 4 and rep["dropped"] == 2
    assert rep["dropped_by"] == {"exact:humaneval": 1, "near:humaneval": 1}


def test_short_prompts_match_only_exactly():
    index = EvalPromptIndex(n=3)
    index.add("Tell a joke.", "tiny")
    assert index.match("tell a JOKE!") == ("exact", "tiny")
    assert index.match("Tell a story.") is None
    index.add("Name a color that you like.", "tiny")
    assert index.match("name a colour that you like") == ("near", "tiny")  # one word in six
    assert index.match("Name a city that you visited.") is None
