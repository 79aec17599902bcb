"""Keeps evaluation-only prompts out of training data.

A benchmark's test prompts (MT-bench, HumanEval, MBPP, GSM8K and the like) measure a head
on prompts it never saw; a generated or user-supplied training prompt that repeats one,
exactly or lightly edited, would make that measure flatter the head. `EvalPromptIndex`
holds every evaluation prompt (every turn of MT-bench) and tells whether a candidate is

- an exact duplicate: equal after normalization (case, punctuation and whitespace
  ignored), or
- a near duplicate: its word n-gram shingles overlap one evaluation prompt's with a
  Jaccard similarity of at least `jaccard`, or cover at least `containment` of that
  prompt's shingles (the evaluation prompt pasted inside a longer one); or, for a short
  evaluation prompt (under `short_words` words), their sets of words overlap with a
  Jaccard similarity of at least `word_jaccard`.

Word 3-grams by default: one changed word in a 15-word prompt removes 3 of its 13
shingles (Jaccard 10/16), where 8-grams would remove 8 of 8 and miss it. In a 6-word
prompt one changed word leaves 1 of 4 shingles, hence the word sets for short prompts
(5/7 of the words shared). Both err towards dropping: a training prompt lost costs
little, an evaluation prompt trained on spoils the measure.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

# The evaluation set that is always protected when it is in the repository.
MT_BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "data" / "mt_bench_questions.jsonl"

# JSONL fields that hold an evaluation prompt's text, in the common benchmark layouts.
_TEXT_FIELDS = ("prompt", "question", "text", "instruction", "problem", "input")


def normalize(text: str) -> str:
    """Lower case, punctuation to spaces, whitespace collapsed."""
    return " ".join(re.sub(r"[^\w]+", " ", text.lower()).split())


def shingles(norm: str, n: int) -> set[tuple[str, ...]]:
    """Word n-grams of normalized text (empty when it has fewer than n words)."""
    words = norm.split()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def prompt_texts(row: dict) -> list[str]:
    """Every prompt text of one evaluation JSONL row: all MT-bench turns, the user messages
    of a conversation, or a single prompt field."""
    if row.get("turns"):
        return [str(t) for t in row["turns"]]
    if row.get("messages"):
        return [str(m.get("content", "")) for m in row["messages"] if m.get("role") == "user"]
    return [str(row[k]) for k in _TEXT_FIELDS if isinstance(row.get(k), str)][:1]


@dataclass
class EvalPromptIndex:
    n: int = 3
    jaccard: float = 0.5
    containment: float = 0.7
    short_words: int = 16
    word_jaccard: float = 0.7
    exact: dict[str, str] = field(default_factory=dict)  # normalized text -> source name
    sources: list[str] = field(default_factory=list)  # per indexed prompt: source name
    sources_short: list[str] = field(default_factory=list)  # per short prompt: source name
    sizes: list[int] = field(default_factory=list)  # per indexed prompt: shingle count
    postings: dict[tuple[str, ...], list[int]] = field(default_factory=dict)  # shingle -> prompts
    short_sets: list[frozenset[str]] = field(default_factory=list)  # short prompts' word sets
    word_postings: dict[str, list[int]] = field(default_factory=dict)  # word -> short prompts

    def add(self, text: str, source: str) -> None:
        norm = normalize(text)
        if not norm:
            return
        self.exact.setdefault(norm, source)
        words = frozenset(norm.split())
        if len(norm.split()) < self.short_words:
            j = len(self.short_sets)
            self.short_sets.append(words)
            self.sources_short.append(source)
            for w in words:
                self.word_postings.setdefault(w, []).append(j)
        sh = shingles(norm, self.n)
        if not sh:
            return
        i = len(self.sources)
        self.sources.append(source)
        self.sizes.append(len(sh))
        for s in sh:
            self.postings.setdefault(s, []).append(i)

    def add_file(self, path: str | Path) -> int:
        """Index every prompt of an evaluation JSONL; returns how many texts it held."""
        path = Path(path)
        count = 0
        with open(path) as f:
            for line in f:
                if line.strip():
                    for text in prompt_texts(json.loads(line)):
                        self.add(text, path.stem)
                        count += 1
        return count

    def __len__(self) -> int:
        return len(self.exact)

    def match(self, text: str) -> tuple[str, str] | None:
        """(kind "exact" | "near", evaluation source) when `text` duplicates an evaluation
        prompt, else None."""
        norm = normalize(text)
        if not norm:
            return None
        if norm in self.exact:
            return "exact", self.exact[norm]
        words = frozenset(norm.split())
        if len(norm.split()) < 2 * self.short_words:
            common_words: Counter[int] = Counter(j for w in words for j in self.word_postings.get(w, ()))
            for j, common in common_words.items():
                if common / (len(words) + len(self.short_sets[j]) - common) >= self.word_jaccard:
                    return "near", self.sources_short[j]
        sh = shingles(norm, self.n)
        if not sh:
            return None
        shared: Counter[int] = Counter()
        for s in sh:
            for i in self.postings.get(s, ()):
                shared[i] += 1
        for i, common in shared.items():
            union = len(sh) + self.sizes[i] - common
            if common / union >= self.jaccard or common / self.sizes[i] >= self.containment:
                return "near", self.sources[i]
        return None


def build_index(files: Iterable[str | Path] = (), *, include_mt_bench: bool = True, n: int = 3,
                jaccard: float = 0.5, containment: float = 0.7) -> EvalPromptIndex:
    """The evaluation prompts of `files`, plus MT-bench's when it is in the repository."""
    index = EvalPromptIndex(n=n, jaccard=jaccard, containment=containment)
    paths = [Path(f) for f in files]
    if include_mt_bench and MT_BENCH.exists() and MT_BENCH.resolve() not in {p.resolve() for p in paths}:
        paths.insert(0, MT_BENCH)
    for p in paths:
        index.add_file(p)
    return index


class ContaminationFilter:
    """Counts what it drops, per evaluation source and kind, for the data report."""

    def __init__(self, index: EvalPromptIndex):
        self.index = index
        self.dropped: Counter[str] = Counter()  # "exact:mt_bench_questions" -> count
        self.checked = 0

    def keep(self, text: str) -> bool:
        self.checked += 1
        hit = self.index.match(text)
        if hit is None:
            return True
        self.dropped[f"{hit[0]}:{hit[1]}"] += 1
        return False

    def report(self) -> dict:
        return {"eval_prompts_indexed": len(self.index), "checked": self.checked,
                "dropped": sum(self.dropped.values()), "dropped_by": dict(sorted(self.dropped.items()))}
