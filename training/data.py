"""Training conversations for an EAGLE head, produced by the target itself with our engine.

Magpie method: the target is given only its chat template's user-turn prefix (for SmolLM2
the default system header then "<|im_start|>user\\n") and samples what a user would say,
stopping at the end-of-turn token. Those prompts (plus, optionally, prompts from a user's
JSONL) are rendered back into the template and answered by the target, greedily or by
sampling. The head then learns on the target's own outputs, which is what it must predict
at serving time.

Each prompt request may start the user turn with seed words of a category (chat, code,
math, multi-turn, long and short answers; training/categories.py), so the data covers
what users send rather than only the short chat unseeded Magpie gives.

A sample is one JSON line: {"input_ids": [...], "loss_mask": [0/1 ...], "prompt_len": n,
"source": "magpie"|"user", "greedy": bool, "category": str, "kind": str}; loss_mask is 1 on
assistant tokens only (every assistant turn, its end-of-turn token included), and
input_ids[:prompt_len] ends with the header of the last assistant turn.
"""
from __future__ import annotations

import json
import logging
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from training.categories import MULTITURN, Task, draw_task, follow_up_task
from training.contamination import ContaminationFilter

log = logging.getLogger("kestrel.training.data")

# Rendered as the user's message, then cut at: what precedes it is the user-turn prefix.
_PLACEHOLDER = "KESTRELPLACEHOLDER7319"


# ---- chat template ------------------------------------------------------------------------
def user_turn_prefix(tokenizer) -> tuple[list[int], int]:
    """(ids of everything the template puts before a first user message, end-of-turn id).

    Derived generically: render a one-message conversation whose content is a placeholder
    and cut the text at it, so the default system prompt, BOS and role header come out as
    the template writes them. The end-of-turn token is the first token after the
    placeholder when it is a special token (<|im_end|>, <|eot_id|>), else EOS.
    """
    text = tokenizer.apply_chat_template([{"role": "user", "content": _PLACEHOLDER}],
                                         tokenize=False, add_generation_prompt=False)
    if _PLACEHOLDER not in text:
        raise ValueError("the chat template does not echo the user message; cannot find the user prefix")
    head, tail = text.split(_PLACEHOLDER, 1)
    prefix = tokenizer.encode(head, add_special_tokens=False)
    if not prefix:
        raise ValueError("the chat template puts nothing before the user message")
    after = tokenizer.encode(tail, add_special_tokens=False)
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    if after and after[0] in special:
        eot = after[0]
    elif tokenizer.eos_token_id is not None:
        eot = int(tokenizer.eos_token_id)
    else:
        raise ValueError("cannot tell the end-of-turn token: the template has none and there is no EOS")
    return [int(t) for t in prefix], int(eot)


def render_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """A user text (or a message list ending with a user turn) -> ids up to the assistant header."""
    from serve_app.text.tokenizer import apply_chat_template
    msgs = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    return apply_chat_template(tokenizer, msgs)


def follow_up_prefix(tokenizer, turns: list[dict]) -> list[int]:
    """Ids of a conversation `turns` (ending with an assistant turn) up to the start of the
    next user message, as the template writes it: where the target writes a follow-up."""
    text = tokenizer.apply_chat_template(turns + [{"role": "user", "content": _PLACEHOLDER}],
                                         tokenize=False, add_generation_prompt=False)
    return [int(t) for t in tokenizer.encode(text.split(_PLACEHOLDER, 1)[0], add_special_tokens=False)]


def assistant_mask(tokenizer, messages: list[dict], prompt_ids: list[int], eot: int) -> list[int]:
    """Loss mask over prompt_ids (a conversation rendered up to its last assistant header):
    1 on each earlier assistant turn's tokens and its end-of-turn token. A turn whose
    rendering is not a prefix of prompt_ids (a template that rewrites history) stays 0."""
    mask = [0] * len(prompt_ids)
    for j, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        start = len(render_prompt(tokenizer, messages[:j]))
        text = tokenizer.apply_chat_template(messages[:j + 1], tokenize=False, add_generation_prompt=False)
        upto = [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
        if upto != prompt_ids[:len(upto)] or eot not in upto[start:]:
            continue
        end = len(upto) - upto[::-1].index(eot)  # just past the turn's end-of-turn token
        mask[start:end] = [1] * (end - start)
    return mask


def read_prompt_rows(path: str) -> list[tuple[str | list[dict], str | None]]:
    """(prompt, category or None) per line of a JSONL file: {"prompt": str},
    {"messages": [...]} or {"turns": [str, ...]} (MT-Bench; the first turn is used), with an
    optional "category"."""
    out: list[tuple[str | list[dict], str | None]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" in row:
                p = list(row["messages"])
            elif "prompt" in row:
                p = str(row["prompt"])
            elif row.get("turns"):
                p = str(row["turns"][0])
            else:
                raise ValueError(f"{path}:{n}: each line needs a \"prompt\", \"messages\" or \"turns\" field")
            out.append((p, row.get("category")))
    return out


def read_user_prompts(path: str) -> list[str | list[dict]]:
    """Prompts from a JSONL file (read_prompt_rows without the categories)."""
    return [p for p, _ in read_prompt_rows(path)]


# ---- filters --------------------------------------------------------------------------------
def normalize_text(s: str) -> str:
    """Dedupe key: case and whitespace do not make a prompt new."""
    return re.sub(r"\s+", " ", s).strip().lower()


def _has_run(ids: list[int], max_run: int) -> bool:
    """One token max_run times in a row."""
    run = 1
    for a, b in zip(ids, ids[1:]):
        run = run + 1 if a == b else 1
        if run >= max_run:
            return True
    return False


def _distinct(seq: list[int], n: int) -> float:
    """The share of distinct n-grams among seq's n-grams."""
    grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def in_loop(ids: list[int], n: int = 4, tail: int = 96, min_tail_distinct: float = 0.25,
            max_run: int = 16) -> bool:
    """The stream's last `tail` tokens are a loop: few distinct n-grams, or one token
    max_run times in a row. It reads the tail alone, so an answer can be checked as it is
    written; what it finds, is_degenerate finds too."""
    end = ids[-tail:]
    return _has_run(end, max_run) or (len(end) >= tail and _distinct(end, n) < min_tail_distinct)


def is_degenerate(ids: list[int], n: int = 4, min_distinct: float = 0.35, tail: int = 96,
                  min_tail_distinct: float = 0.25, max_run: int = 16) -> bool:
    """Repetitive token streams: few distinct n-grams overall or in the tail (a loop the
    model fell into), or one token repeated max_run times in a row."""
    return (_has_run(ids, max_run) or (len(ids) >= 4 * n and _distinct(ids, n) < min_distinct)
            or in_loop(ids, n, tail, min_tail_distinct, max_run))


# ---- engine driving -------------------------------------------------------------------------
def engine_step_summary(engine) -> str:
    """'extend/decode steps, ms per step in schedule/execute/process' of an LLMEngine."""
    n = max(engine.steps, 1)
    ms = "/".join(f"{1000 * v / n:.1f}" for v in engine.seconds.values())
    return f"{engine.mode_steps['extend']}e/{engine.mode_steps['decode']}d {ms}ms"


@dataclass
class Dataset:
    train: list[dict]
    eval: list[dict]
    stats: dict[str, Any] = field(default_factory=dict)


def generate_dataset(engine, tokenizer, n_samples: int, max_prompt_tokens: int = 128,
                     max_response_tokens: int = 384, *, user_prompts: Iterable | None = None,
                     user_categories: list[str | None] | None = None,
                     category_mix: dict[str, float] | None = None,
                     contamination: ContaminationFilter | None = None,
                     greedy_fraction: float = 0.5, prompt_temperature: float = 1.0,
                     response_temperature: float = 0.8, eval_fraction: float = 0.05,
                     min_eval: int = 1, require_prompt_end: bool = True, min_prompt_chars: int = 8,
                     seed: int = 0, max_prompt_factor: float = 4.0,
                     time_budget_s: float | None = None, loop_check_tokens: int = 96,
                     loop_check_every: int = 64, progress: bool = True) -> Dataset:
    """n_samples conversations (train + held-out) from the target behind `engine`.

    One pipeline keeps the engine full: the user's prompts (if any) are answered first;
    Magpie prompt requests are kept queued while samples are still missing, and each
    prompt that survives the filters is answered as soon as it is written (greedy with
    probability greedy_fraction, else sampled at response_temperature). Each prompt
    request draws a category from `category_mix` (default: unseeded Magpie only) and
    starts the user turn with that category's seed words (training/categories.py); a
    multi-turn one is answered, then the target writes a follow-up user turn, which is
    answered too. Prompts that duplicate an evaluation prompt (`contamination`) are
    dropped. At most max_prompt_factor * n_samples first-turn prompts are asked for.
    time_budget_s bounds the whole generation; what is unfinished at the deadline is
    dropped. An answer whose last tokens are a loop (`in_loop`, once it holds
    loop_check_tokens tokens, looked at every loop_check_every engine steps) is stopped
    there and dropped, as is_degenerate would drop it at its end: a loop runs to
    max_response_tokens, so these answers took about a quarter of a run's generated
    tokens while giving none. The check reads each answer's tail alone, so it stays cheap
    beside the engine's steps.
    """
    from tqdm import tqdm

    from serve_app.engine.request import SamplingParams

    rng = random.Random(seed)
    mix = category_mix or {"magpie": 1.0}
    t_start = time.monotonic()
    deadline = None if time_budget_s is None else t_start + time_budget_s
    prefix, eot = user_turn_prefix(tokenizer)
    limit = engine.cfg.model.max_model_len - 1  # the scheduler refuses longer prompts
    stats: dict[str, Any] = {"user_prefix_len": len(prefix), "end_of_turn_id": eot,
                             "category_mix": mix,
                             "prompts_generated": 0, "prompts_unfinished": 0, "prompts_short": 0,
                             "prompts_degenerate": 0, "prompts_duplicate": 0, "prompts_too_long": 0,
                             "prompts_contaminated": 0,
                             "responses_degenerate": 0, "responses_empty": 0,
                             "responses_aborted": 0, "prompts_aborted": 0, "samples_duplicate": 0,
                             "responses_stopped_in_loop": 0}
    asked_by_category: dict[str, int] = {}
    dropped_by_category: dict[str, dict[str, int]] = {}  # category -> stats key -> count
    seen_prompts: set[str] = set()
    seen_samples: set[tuple[int, ...]] = set()
    samples: list[dict] = []
    sub_seed = iter(range(seed * 1_000_003 + 1, 1 << 62))  # distinct per-request seeds
    # rid -> ("prompt", (task, seed ids), req) or ("response", (source, messages, ids, greedy, task), req)
    pending: dict[str, tuple] = {}
    asked_prompts = 0
    responses_pending = 0
    steps = 0

    def drop(reason: str, category: str | None) -> None:
        """Count a prompt or response left out, overall and for its category: where a
        category's share falls short of the mix, this says why."""
        stats[reason] += 1
        per = dropped_by_category.setdefault(category or "none", {})
        per[reason] = per.get(reason, 0) + 1

    def clean(text: str, category: str | None) -> bool:
        if contamination is None or contamination.keep(text):
            return True
        drop("prompts_contaminated", category)
        return False

    def ask_prompt(task: Task) -> None:
        head = prefix if not task.follow_up else follow_up_prefix(tokenizer, task.turns)
        seed_ids = tokenizer.encode(task.seed, add_special_tokens=False) if task.seed else []
        ids = head + seed_ids
        if len(ids) + max_prompt_tokens > limit:
            drop("prompts_too_long", task.category)
            return
        sp = SamplingParams(max_tokens=max_prompt_tokens, temperature=prompt_temperature,
                            stop_token_ids=[eot], seed=next(sub_seed))
        req = engine.add_request(ids, sp)
        pending[req.rid] = ("prompt", (task, seed_ids), req)

    def ask_response(source: str, messages: list[dict], task: Task | None, category: str | None) -> None:
        nonlocal responses_pending
        ids = render_prompt(tokenizer, messages)
        if len(ids) > limit:
            drop("prompts_too_long", category)
            return
        greedy = rng.random() < greedy_fraction
        sp = SamplingParams(max_tokens=max_response_tokens, stop_token_ids=[eot],
                            temperature=0.0 if greedy else response_temperature,
                            seed=None if greedy else next(sub_seed))
        req = engine.add_request(ids, sp)
        pending[req.rid] = ("response", (source, messages, ids, greedy, task, category), req)
        responses_pending += 1

    def on_prompt(meta, req) -> None:
        task, seed_ids = meta
        stats["prompts_generated"] += 1
        out = list(req.output_ids)
        ended = req.finish_reason == "stop" and bool(out)  # at end-of-turn (or EOS)
        if require_prompt_end and not ended:
            drop("prompts_unfinished", task.category)  # ran into max_prompt_tokens: cut mid-thought
            return
        text = tokenizer.decode(seed_ids + (out[:-1] if ended else out), skip_special_tokens=True).strip()
        if len(text) < min_prompt_chars:
            drop("prompts_short", task.category)
            return
        if is_degenerate(out):
            drop("prompts_degenerate", task.category)
            return
        key = normalize_text(json.dumps(task.turns) + text)
        if key in seen_prompts:
            drop("prompts_duplicate", task.category)
            return
        if not clean(text, task.category):
            return
        seen_prompts.add(key)
        ask_response("magpie", task.turns + [{"role": "user", "content": text}], task, task.category)

    def on_response(meta, req) -> None:
        source, messages, p, greedy, task, category = meta
        out = list(req.output_ids)
        body = out[:-1] if out and out[-1] == eot else out
        answer = tokenizer.decode(body, skip_special_tokens=True).strip()
        if not answer:
            drop("responses_empty", category)
            return
        if is_degenerate(out):
            drop("responses_degenerate", category)
            return
        if task is not None and task.category == MULTITURN and not task.follow_up:
            # the first exchange of a conversation: the target now writes the user's next turn
            ask_prompt(follow_up_task(task, messages + [{"role": "assistant", "content": answer}], rng))
            return
        key = tuple(p + out)
        if key in seen_samples:
            drop("samples_duplicate", category)
            return
        seen_samples.add(key)
        earlier = assistant_mask(tokenizer, messages, p, eot)
        samples.append({"input_ids": p + out, "loss_mask": earlier + [1] * len(out),
                        "prompt_len": len(p), "source": source, "greedy": greedy,
                        "category": category or source,
                        "kind": task.kind if task is not None else (category or source)})

    # 1. the user's prompts, deduped like generated ones and checked against evaluation sets
    users = []
    cats = list(user_categories or [])
    for i, p in enumerate(user_prompts or []):
        key = normalize_text(p if isinstance(p, str) else json.dumps(p, sort_keys=True))
        cat = cats[i] if i < len(cats) else None
        if key in seen_prompts:
            drop("prompts_duplicate", cat or "user")
            continue
        texts = [p] if isinstance(p, str) else [m.get("content", "") for m in p if m.get("role") == "user"]
        if not all(clean(t, cat or "user") for t in texts):
            continue
        seen_prompts.add(key)
        users.append((p, cat))
    rng.shuffle(users)
    for p, cat in users[:n_samples]:
        msgs = p if isinstance(p, list) else [{"role": "user", "content": p}]
        ask_response("user", msgs, None, cat or "user")

    # 2. Magpie prompts keep the queue one batch deep until the samples are there
    batch = engine.cfg.scheduler.max_running_requests
    bar = tqdm(total=n_samples, desc="samples", unit="conv", file=sys.stderr, disable=not progress)
    toks = 0
    while True:
        prompts_pending = len(pending) - responses_pending
        missing = n_samples - len(samples) - responses_pending
        want = min(math.ceil(1.25 * missing) - prompts_pending, batch - prompts_pending,
                   int(max_prompt_factor * n_samples) - asked_prompts)
        for _ in range(max(want, 0)):
            task = draw_task(mix, rng)
            asked_by_category[task.category] = asked_by_category.get(task.category, 0) + 1
            ask_prompt(task)
            asked_prompts += 1
        if not engine.has_work:
            break
        if deadline is not None and time.monotonic() > deadline:
            engine.abort_all()
            for kind, meta, _ in pending.values():
                drop(f"{kind}s_aborted", meta[0].category if kind == "prompt" else meta[5])
            log.warning("time budget spent: %d prompts and %d responses unfinished",
                        stats["prompts_aborted"], stats["responses_aborted"])
            break
        for ev in engine.step():
            if not ev.finished:  # without a stream callback only finished requests report
                continue
            kind, meta, req = pending.pop(ev.rid)
            toks += ev.num_output_tokens
            if kind == "prompt":
                on_prompt(meta, req)
            else:
                responses_pending -= 1
                before = len(samples)
                on_response(meta, req)
                bar.update(len(samples) - before)
        steps += 1
        if steps % loop_check_every == 0:
            for rid, (kind, meta, req) in list(pending.items()):
                out = req.output_ids
                if kind == "response" and len(out) >= loop_check_tokens and in_loop(out):
                    engine.abort(rid)  # its KV is freed now; no event follows
                    del pending[rid]
                    responses_pending -= 1
                    toks += len(out)
                    stats["responses_stopped_in_loop"] += 1
                    drop("responses_degenerate", meta[5])
        bar.set_postfix(tok_s=f"{toks / max(time.monotonic() - t_start, 1e-6):.0f}",
                        steps=engine_step_summary(engine), refresh=False)
    bar.close()

    # 3. hold out a split (by sample, after shuffling: prompts are all distinct)
    rng.shuffle(samples)
    samples = samples[:n_samples]
    n_eval = 0
    if len(samples) >= 2 and eval_fraction > 0:
        n_eval = min(len(samples) - 1, max(min_eval, round(len(samples) * eval_fraction)))
    held, train = samples[:n_eval], samples[n_eval:]
    elapsed = time.monotonic() - t_start
    stats.update(samples=len(samples), train=len(train), eval=len(held),
                 greedy=sum(s["greedy"] for s in samples),
                 assistant_tokens=sum(sum(s["loss_mask"]) for s in samples),
                 total_tokens=sum(len(s["input_ids"]) for s in samples),
                 generated_tokens=toks, generated_tokens_per_s=round(toks / max(elapsed, 1e-6)),
                 seconds=round(elapsed, 1), engine_steps=engine_step_summary(engine),
                 prompts_asked_by_category=asked_by_category,
                 dropped_by_category=dropped_by_category,
                 categories=category_coverage(train, held))
    if contamination is not None:
        stats["contamination"] = contamination.report()
    log.info("coverage by category:\n%s", format_coverage(stats["categories"]))
    log.info("left out by category: %s", json.dumps(dropped_by_category, sort_keys=True))
    if len(samples) < n_samples:
        log.warning("generated %d of %d samples requested", len(samples), n_samples)
    return Dataset(train, held, stats)


def category_coverage(train: list[dict], held: list[dict]) -> dict[str, dict]:
    """Per category (a sample without one counts under its source): samples in the
    training and held-out splits, assistant tokens, and the share of all assistant tokens."""
    out: dict[str, dict] = {}
    for split, rows in (("train", train), ("eval", held)):
        for r in rows:
            c = out.setdefault(r.get("category") or r.get("source") or "unknown",
                               {"train": 0, "eval": 0, "assistant_tokens": 0, "kinds": {}})
            c[split] += 1
            c["assistant_tokens"] += sum(r["loss_mask"])
            kind = r.get("kind")
            if kind:
                c["kinds"][kind] = c["kinds"].get(kind, 0) + 1
    total = sum(c["assistant_tokens"] for c in out.values()) or 1
    for c in out.values():
        c["token_share"] = round(c["assistant_tokens"] / total, 4)
    return dict(sorted(out.items()))


def format_coverage(cov: dict[str, dict]) -> str:
    lines = [f"{'category':<12} {'train':>8} {'eval':>6} {'asst tokens':>12} {'share':>6}"]
    for name, c in cov.items():
        lines.append(f"{name:<12} {c['train']:>8} {c['eval']:>6} {c['assistant_tokens']:>12} "
                     f"{c['token_share']:>6.3f}")
    return "\n".join(lines)


# ---- files ----------------------------------------------------------------------------------
def save_jsonl(rows: list[dict], path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)  # a crash mid-write never leaves a half file under the real name


def join_samples(parts: Iterable[list[dict]], held_out: Iterable[dict] = ()) -> list[dict]:
    """Samples of several files (generations with different seeds, say) as one training
    set: an exact repeat is kept once, and a sample whose prompt is also a held-out prompt
    is dropped, so the held-out measure stays unseen."""
    held = {tuple(r["input_ids"][:r["prompt_len"]]) for r in held_out}
    seen: set[tuple[int, ...]] = set()
    out = []
    for rows in parts:
        for r in rows:
            key = tuple(r["input_ids"])
            if key in seen or key[:r["prompt_len"]] in held:
                continue
            seen.add(key)
            out.append(r)
    return out


def load_jsonl(path: str | Path) -> list[dict]:
    """Samples with input_ids and loss_mask (checked); other fields kept as they are."""
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            r = json.loads(line)
            ids, mask = r.get("input_ids"), r.get("loss_mask")
            if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
                raise ValueError(f"{path}:{n}: needs \"input_ids\" and a \"loss_mask\" of the same length")
            r.setdefault("prompt_len", next((i for i, m in enumerate(mask) if m), len(mask)))
            rows.append(r)
    return rows
