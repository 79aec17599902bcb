"""Prompt categories for generated training data, and the seed words that steer the target.

Unseeded Magpie (the target given only the user-turn header) writes mostly short chat. To
cover what users send, a prompt request starts the user turn with a few seed words of its
category ("Write a Python function that", "Solve for x:") and the target writes the rest
of the prompt. A category has kinds (code: write, explain, fix), each with its own seeds;
a request picks a category by the mix weights, then a kind and a seed uniformly.

"multiturn" is a conversation: a first turn of another category (its kind says which),
the target's answer, then a follow-up user turn the target writes after that answer
(seeded by FOLLOW_UP_SEEDS), and the answer to it.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

# category -> kind -> seed words; "" leaves the whole user turn to the target.
SEEDS: dict[str, dict[str, list[str]]] = {
    "magpie": {"magpie": [""]},
    "chat": {"chat": ["", "Can you", "What do you think about", "I'm planning", "How can I",
                      "Give me some advice on", "What's the difference between", "Tell me about",
                      "Recommend", "Help me write an email to"]},
    "code": {
        "code/write": ["Write a Python function that", "Write a JavaScript function to", "Implement a",
                       "Write a SQL query that", "Write a bash script that", "Create a Python class"],
        "code/explain": ["Explain what this code does:\n```python\n",
                         "Can you explain how this function works?\n```python\ndef",
                         "What does the following JavaScript do?\n```javascript\n"],
        "code/fix": ["This Python code raises an error. Can you fix it?\n```python\n",
                     "Find the bug in my code:\n```python\ndef",
                     "Why does this code not work?\n```"],
    },
    "math": {
        "math": ["Solve for x:", "Calculate", "What is the probability that", "A train leaves",
                 "Prove that", "If a store sells", "Find the derivative of", "How many ways"],
        "reasoning": ["Think step by step:", "Which is heavier,", "If all", "A farmer has",
                      "Is it true that", "Explain the logic behind"],
    },
    "long": {"long": ["Write a detailed essay about", "Write a comprehensive guide to",
                      "Explain in detail how", "Write a long story about", "Write a blog post about"]},
    "short": {"short": ["In one sentence,", "Briefly, what is", "Give a one-word answer:", "Yes or no:",
                        "Name three", "What is the capital of"]},
}
MULTITURN = "multiturn"
# Categories a multi-turn conversation's first turn is drawn from.
MULTITURN_FIRST = ("chat", "code", "math")
FOLLOW_UP_SEEDS = ["", "Can you", "Thanks! Now", "What about", "Why", "Make it", "Could you explain",
                   "Now rewrite"]
CATEGORIES = tuple(SEEDS) + (MULTITURN,)

DEFAULT_MIX = "chat=0.3,code=0.25,math=0.15,multiturn=0.15,long=0.1,short=0.05"


def parse_mix(spec: str) -> dict[str, float]:
    """"chat=0.35,code=0.3" -> weights summing to 1 (categories not named get none)."""
    mix: dict[str, float] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        name, sep, value = part.partition("=")
        name = name.strip()
        if not sep or name not in CATEGORIES:
            raise ValueError(f"category mix entry {part!r}: want NAME=WEIGHT with NAME one of "
                             f"{', '.join(CATEGORIES)}")
        w = float(value)
        if w < 0:
            raise ValueError(f"category mix entry {part!r}: negative weight")
        mix[name] = mix.get(name, 0.0) + w
    total = sum(mix.values())
    if total <= 0:
        raise ValueError(f"category mix {spec!r} has no positive weight")
    return {k: v / total for k, v in mix.items() if v > 0}


@dataclass
class Task:
    """One conversation to generate: its category, kind, the seed of the user turn being
    written, and the turns so far (a multi-turn follow-up has the first exchange)."""
    category: str
    kind: str
    seed: str
    turns: list[dict]

    @property
    def follow_up(self) -> bool:
        return bool(self.turns)


def draw_task(mix: dict[str, float], rng: random.Random) -> Task:
    cat = rng.choices(list(mix), weights=list(mix.values()))[0]
    first = rng.choice(MULTITURN_FIRST) if cat == MULTITURN else cat
    kind = rng.choice(sorted(SEEDS[first]))
    return Task(cat, kind, rng.choice(SEEDS[first][kind]), [])


def follow_up_task(task: Task, turns: list[dict], rng: random.Random) -> Task:
    """The follow-up user turn of a multi-turn task, after its first exchange `turns`."""
    return Task(task.category, task.kind, rng.choice(FOLLOW_UP_SEEDS), turns)
