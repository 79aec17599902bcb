"""Training conversations for an EAGLE head, produced by the target itself with our engine.

Magpie method: the target is given only its chat template's user-turn prefix (for SmolLM2
the default system header then "<|im_start|>user\\n") and samples what a user would say,
stopping at the end-of-turn token. Those prompts (plus, optionally, prompts from a user's
JSONL) are rendered back into the template and answered by the target, greedily or by
sampling. The head then learns on the target's own outputs, which is what it must predict
at serving time.

A sample is one JSON line: {"input_ids": [...], "loss_mask": [0/1 ...], "prompt_len": n,
"source": "magpie"|"user", "greedy": bool}; loss_mask is 1 on assistant tokens only
(the response, its end-of-turn token included).
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


def read_user_prompts(path: str) -> list[str | list[dict]]:
    """Prompts from a JSONL file: {"prompt": str}, {"messages": [...]} or {"turns": [str, ...]}
    (MT-Bench; the first turn is used)."""
    out: list[str | list[dict]] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if "messages" in row:
                out.append(list(row["messages"]))
            elif "prompt" in row:
                out.append(str(row["prompt"]))
            elif row.get("turns"):
                out.append(str(row["turns"][0]))
            else:
                raise ValueError(f"{path}:{n}: each line needs a \"prompt\", \"messages\" or \"turns\" field")
    return out


# ---- filters --------------------------------------------------------------------------------
def normalize_text(s: str) -> str:
    """Dedupe key: case and whitespace do not make a prompt new."""
    return re.sub(r"\s+", " ", s).strip().lower()


def is_degenerate(ids: list[int], n: int = 4, min_distinct: float = 0.35, tail: int = 96,
                  min_tail_distinct: float = 0.25, max_run: int = 16) -> bool:
    """Repetitive token streams: few distinct n-grams overall or in the tail (a loop the
    model fell into), or one token repeated max_run times in a row."""
    run = 1
    for a, b in zip(ids, ids[1:]):
        run = run + 1 if a == b else 1
        if run >= max_run:
            return True

    def distinct(seq: list[int]) -> float:
        grams = [tuple(seq[i:i + n]) for i in range(len(seq) - n + 1)]
        return len(set(grams)) / len(grams) if grams else 1.0

    if len(ids) >= 4 * n and distinct(ids) < min_distinct:
        return True
    return len(ids) >= tail and distinct(ids[-tail:]) < min_tail_distinct


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
                     greedy_fraction: float = 0.5, prompt_temperature: float = 1.0,
                     response_temperature: float = 0.8, eval_fraction: float = 0.05,
                     min_eval: int = 1, require_prompt_end: bool = True, min_prompt_chars: int = 8,
                     seed: int = 0, max_prompt_factor: float = 4.0,
                     time_budget_s: float | None = None, progress: bool = True) -> Dataset:
    """n_samples conversations (train + held-out) from the target behind `engine`.

    One pipeline keeps the engine full: the user's prompts (if any) are answered first;
    Magpie prompt requests are kept queued while samples are still missing, and each
    prompt that survives the filters is answered as soon as it is written (greedy with
    probability greedy_fraction, else sampled at response_temperature). At most
    max_prompt_factor * n_samples prompts are asked for. time_budget_s bounds the whole
    generation; what is unfinished at the deadline is dropped.
    """
    from tqdm import tqdm

    from serve_app.engine.request import SamplingParams

    rng = random.Random(seed)
    t_start = time.monotonic()
    deadline = None if time_budget_s is None else t_start + time_budget_s
    prefix, eot = user_turn_prefix(tokenizer)
    limit = engine.cfg.model.max_model_len - 1  # the scheduler refuses longer prompts
    stats: dict[str, Any] = {"user_prefix_len": len(prefix), "end_of_turn_id": eot,
                             "prompts_generated": 0, "prompts_unfinished": 0, "prompts_short": 0,
                             "prompts_degenerate": 0, "prompts_duplicate": 0, "prompts_too_long": 0,
                             "responses_degenerate": 0, "responses_empty": 0,
                             "responses_aborted": 0, "prompts_aborted": 0, "samples_duplicate": 0}
    seen_prompts: set[str] = set()
    seen_samples: set[tuple[int, ...]] = set()
    samples: list[dict] = []
    sub_seed = iter(range(seed * 1_000_003 + 1, 1 << 62))  # distinct per-request seeds
    # rid -> ("prompt", None, req) or ("response", (source, prompt ids, greedy), req)
    pending: dict[str, tuple] = {}
    asked_prompts = 0
    responses_pending = 0

    def ask_response(source: str, prompt) -> None:
        nonlocal responses_pending
        ids = render_prompt(tokenizer, prompt)
        if len(ids) > limit:
            stats["prompts_too_long"] += 1
            return
        greedy = rng.random() < greedy_fraction
        sp = SamplingParams(max_tokens=max_response_tokens, stop_token_ids=[eot],
                            temperature=0.0 if greedy else response_temperature,
                            seed=None if greedy else next(sub_seed))
        req = engine.add_request(ids, sp)
        pending[req.rid] = ("response", (source, ids, greedy), req)
        responses_pending += 1

    def on_prompt(req) -> None:
        stats["prompts_generated"] += 1
        out = list(req.output_ids)
        ended = req.finish_reason == "stop" and bool(out)  # at end-of-turn (or EOS)
        if require_prompt_end and not ended:
            stats["prompts_unfinished"] += 1  # ran into max_prompt_tokens: cut mid-thought
            return
        text = tokenizer.decode(out[:-1] if ended else out, skip_special_tokens=True).strip()
        if len(text) < min_prompt_chars:
            stats["prompts_short"] += 1
            return
        if is_degenerate(out):
            stats["prompts_degenerate"] += 1
            return
        key = normalize_text(text)
        if key in seen_prompts:
            stats["prompts_duplicate"] += 1
            return
        seen_prompts.add(key)
        ask_response("magpie", text)

    def on_response(meta, req) -> None:
        source, p, greedy = meta
        out = list(req.output_ids)
        body = out[:-1] if out and out[-1] == eot else out
        if not tokenizer.decode(body, skip_special_tokens=True).strip():
            stats["responses_empty"] += 1
            return
        if is_degenerate(out):
            stats["responses_degenerate"] += 1
            return
        key = tuple(p + out)
        if key in seen_samples:
            stats["samples_duplicate"] += 1
            return
        seen_samples.add(key)
        samples.append({"input_ids": p + out, "loss_mask": [0] * len(p) + [1] * len(out),
                        "prompt_len": len(p), "source": source, "greedy": greedy})

    # 1. the user's prompts, deduped like generated ones
    users = []
    for p in user_prompts or []:
        key = normalize_text(p if isinstance(p, str) else json.dumps(p, sort_keys=True))
        if key in seen_prompts:
            stats["prompts_duplicate"] += 1
            continue
        seen_prompts.add(key)
        users.append(p)
    rng.shuffle(users)
    for p in users[:n_samples]:
        ask_response("user", p)

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
            sp = SamplingParams(max_tokens=max_prompt_tokens, temperature=prompt_temperature,
                                stop_token_ids=[eot], seed=next(sub_seed))
            req = engine.add_request(prefix, sp)
            pending[req.rid] = ("prompt", None, req)
            asked_prompts += 1
        if not engine.has_work:
            break
        if deadline is not None and time.monotonic() > deadline:
            engine.abort_all()
            for kind, _, _ in pending.values():
                stats[f"{kind}s_aborted"] += 1
            log.warning("time budget spent: %d prompts and %d responses unfinished",
                        stats["prompts_aborted"], stats["responses_aborted"])
            break
        for ev in engine.step():
            if not ev.finished:  # without a stream callback only finished requests report
                continue
            kind, meta, req = pending.pop(ev.rid)
            toks += ev.num_output_tokens
            if kind == "prompt":
                on_prompt(req)
            else:
                responses_pending -= 1
                before = len(samples)
                on_response(meta, req)
                bar.update(len(samples) - before)
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
                 seconds=round(elapsed, 1), engine_steps=engine_step_summary(engine))
    if len(samples) < n_samples:
        log.warning("generated %d of %d samples requested", len(samples), n_samples)
    return Dataset(train, held, stats)


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
