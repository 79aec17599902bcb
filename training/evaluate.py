"""Acceptance of a trained head measured with the real engine (not a proxy metric)."""
from __future__ import annotations

import logging
import re
import time

log = logging.getLogger("kestrel.training.eval")

SETTING_NAME = re.compile(r"(?:chain_k1_s(\d+)|tree_k(\d+)_s(\d+)_n(\d+))")


def parse_setting(name: str) -> tuple[str, int, int, int]:
    """'chain_k1_sS' or 'tree_kK_sS_nN' -> (name, topk K, num_steps S, num_draft_tokens N),
    any shape the config accepts; a chain holds S+1 nodes, the root included."""
    m = SETTING_NAME.fullmatch(name)
    if m is None:
        raise ValueError(f"draft shape {name!r}: use chain_k1_sS or tree_kK_sS_nN, e.g. tree_k4_s5_n16")
    if m.group(1):
        s = int(m.group(1))
        return name, 1, s, s + 1
    return name, int(m.group(2)), int(m.group(3)), int(m.group(4))


# The wide tree: on the H200 at batch 1 it ran 2.13x plain decoding against K4 S5 N8's
# 1.93x (heads/README.md).
DEFAULT_SETTINGS = [parse_setting(n) for n in ("chain_k1_s3", "chain_k1_s5", "tree_k4_s5_n8", "tree_k8_s8_n32")]


def by_category(categories: list[str | None], accept_lengths: list[list[int]]) -> dict[str, dict]:
    """Per prompt category: prompts, speculative iterations and the mean accept length over
    those iterations (as the overall figure is computed)."""
    out: dict[str, dict] = {}
    for cat, acc in zip(categories, accept_lengths):
        c = out.setdefault(cat or "none", {"prompts": 0, "iterations": 0, "_sum": 0})
        c["prompts"] += 1
        c["iterations"] += len(acc)
        c["_sum"] += sum(acc)
    for c in out.values():
        s = c.pop("_sum")
        c["mean_accept_length"] = round(s / c["iterations"], 4) if c["iterations"] else None
    return dict(sorted(out.items()))


def category_table(result: dict) -> str:
    """Mean accept length per category (rows) and setting (columns) of an eval_acceptance
    result, as text."""
    names = [n for n, row in result["settings"].items() if "by_category" in row]
    if not names:
        return ""
    cats = sorted({c for n in names for c in result["settings"][n]["by_category"]})
    width = max(12, *(len(c) for c in cats))
    lines = [f"{'category':<{width}} {'prompts':>7} " + " ".join(f"{n:>15}" for n in names)]
    for cat in cats + ["all"]:
        cells = []
        for n in names:
            row = result["settings"][n]
            v = row["mean_accept_length"] if cat == "all" else row["by_category"].get(cat, {}).get("mean_accept_length")
            cells.append(f"{v:>15.3f}" if v is not None else f"{'-':>15}")
        count = result["prompts"] if cat == "all" else \
            result["settings"][names[0]]["by_category"].get(cat, {}).get("prompts", 0)
        lines.append(f"{cat:<{width}} {count:>7} " + " ".join(cells))
    return "\n".join(lines)


def eval_acceptance(cfg, draft_path: str | None, prompts: list[list[int]], *, tokenizer=None,
                    categories: list[str | None] | None = None,
                    settings=DEFAULT_SETTINGS, max_tokens: int = 256, arch: str = "auto",
                    baseline: bool = True, progress: bool = True) -> dict:
    """Greedy generation of `prompts` (token ids) with the head at `draft_path`, once per
    (K, S, N) setting. Reports the mean accept length over all speculative iterations
    (accepted drafts + the bonus token, as `kestrel generate` does) and output tokens/s of
    the whole batch; with `baseline`, also plain decoding's tokens/s. With `categories`
    (one per prompt), also the mean accept length per category."""
    if categories is not None and len(categories) != len(prompts):
        raise ValueError(f"{len(categories)} categories for {len(prompts)} prompts")
    import sys

    from tqdm import tqdm

    from configs.schema import DraftConfig
    from serve_app.engine.llm_engine import LLMEngine, release_device_memory
    from serve_app.engine.request import SamplingParams
    from training.device_turn import device_key, device_turn

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    runs = ([("no_spec", None)] if baseline else []) + [(n, (k, s, m)) for n, k, s, m in settings]
    out: dict = {"prompts": len(prompts), "max_tokens": max_tokens, "settings": {}}
    for name, kst in runs:
        c = cfg.model_copy(deep=True)
        # One shape a setting: no adaptive shapes or plain steps, whose steps would count
        # in the mean as the smaller shapes' accept lengths (a GPU captures them).
        c.draft = (DraftConfig(enabled=False) if kst is None else
                   DraftConfig(enabled=True, path=draft_path, arch=arch, topk=kst[0],
                               num_steps=kst[1], num_draft_tokens=kst[2], adaptive_shapes=[],
                               plain_steps=False))
        with device_turn(device_key(c.resolved_device())):
            engine = LLMEngine(c, tokenizer=tokenizer, load_tokenizer=tokenizer is not None)
            bar = tqdm(total=len(prompts), desc=f"eval {name}", unit="req", file=sys.stderr,
                       disable=not progress)
            t0 = time.perf_counter()
            reqs = engine.generate(prompts, greedy, progress=bar)
            dt = time.perf_counter() - t0
            bar.close()
            accepts = [list(r.accept_lengths) for r in reqs]
            toks = sum(len(r.output_ids) for r in reqs)
            del engine, reqs  # all of it gone before the next engine's memory profile
            release_device_memory()
        acc = [a for r_acc in accepts for a in r_acc]
        row = {"output_tokens": toks, "seconds": round(dt, 3),
               "tokens_per_s": round(toks / dt, 2) if dt > 0 else None}
        if kst is not None:
            row.update(topk=kst[0], num_steps=kst[1], num_draft_tokens=kst[2],
                       iterations=len(acc),
                       mean_accept_length=round(sum(acc) / len(acc), 4) if acc else None)
            if categories is not None:
                row["by_category"] = by_category(categories, accepts)
            log.info("%s: mean accept length %s, %.1f tok/s", name, row["mean_accept_length"],
                     row["tokens_per_s"] or 0.0)
        out["settings"][name] = row
    base = out["settings"].get("no_spec", {}).get("tokens_per_s")
    if base:
        for name, row in out["settings"].items():
            if name != "no_spec" and row.get("tokens_per_s"):
                row["speedup_vs_no_spec"] = round(row["tokens_per_s"] / base, 3)
    return out


def main(argv: list[str] | None = None) -> dict:
    """`python -m training.evaluate`: accept lengths and tokens/s of a head on a prompt file."""
    import argparse
    import json
    import sys

    from configs.schema import load_config
    from serve_app.text.tokenizer import load_tokenizer

    names = [n for n, *_ in DEFAULT_SETTINGS]
    p = argparse.ArgumentParser(prog="python -m training.evaluate", description=eval_acceptance.__doc__)
    p.add_argument("--config", default=None)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--draft", default=None, help="head folder (default: the shipped head of the default model)")
    p.add_argument("--prompts", required=True,
                   help="JSONL of prompts (prompt/messages/turns: first turn; an optional \"category\") or "
                        "of training samples (input_ids + prompt_len + category, e.g. OUT/data/eval.jsonl)")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--batch", type=int, default=None, help="concurrent requests (default: the config's)")
    p.add_argument("--settings", nargs="+", default=names, metavar="SHAPE",
                   help="draft shapes: chain_k1_sS or tree_kK_sS_nN (default: %(default)s)")
    p.add_argument("--no-baseline", action="store_true", help="skip plain decoding")
    p.add_argument("--out", default=None, help="write the result here as JSON")
    args = p.parse_args(argv)
    try:
        settings = [parse_setting(n) for n in args.settings]
    except ValueError as e:
        p.error(str(e))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    cfg = load_config(args.config, args.set)
    if args.batch:
        cfg.scheduler.max_running_requests = args.batch
    from actors.models.eagle import resolve_draft_path
    from actors.models.loader import default_model_path
    draft = resolve_draft_path(args.draft, cfg.model.path)
    tok = load_tokenizer(cfg.model.path or default_model_path())
    prompts, cats = read_eval_prompts(args.prompts, tok)
    prompts, cats = prompts[:args.num_prompts], cats[:args.num_prompts]
    res = eval_acceptance(cfg, draft, prompts, tokenizer=tok, categories=cats, settings=settings,
                          max_tokens=args.max_tokens, baseline=not args.no_baseline)
    res["draft"], res["prompts_file"] = draft, args.prompts
    text = json.dumps(res, indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(text)
    print("mean accept length per category\n" + category_table(res), file=sys.stderr)
    return res


def read_eval_prompts(path: str, tokenizer) -> tuple[list[list[int]], list[str | None]]:
    """(prompt ids, category) per line of a prompt file or of a training-sample file (whose
    prompt is input_ids[:prompt_len])."""
    import json

    from training.data import load_jsonl, read_prompt_rows, render_prompt
    with open(path) as f:
        first = next((json.loads(line) for line in f if line.strip()), {})
    if "input_ids" in first:
        rows = load_jsonl(path)
        return ([r["input_ids"][:r["prompt_len"]] for r in rows],
                [r.get("category") or r.get("source") for r in rows])
    rows = read_prompt_rows(path)
    return [render_prompt(tokenizer, p) for p, _ in rows], [c for _, c in rows]


if __name__ == "__main__":
    main()
