"""The `kestrel` command: serve, env, generate, chat, bench, train-draft."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _config(args, extra: list[str] | None = None):
    from configs.schema import ConfigError, load_config
    try:
        return load_config(args.config, list(args.set or []) + (extra or []))
    except ConfigError as e:
        sys.exit(f"kestrel: {e}")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML preset (default: configs/default.yaml)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a setting, e.g. --set kv_cache.page_size=16 (repeatable)")


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"kestrel: {path}:{n}: not valid JSON ({e.msg})")
            if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
                sys.exit(f"kestrel: {path}:{n}: each line needs a \"prompt\" or \"messages\" field")
            rows.append(row)
    return rows


def cmd_generate(args) -> None:
    from tqdm import tqdm

    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template

    cfg = _config(args, ["draft.enabled=false"] if args.no_spec else None)
    rows = _read_jsonl(args.input)
    engine = LLMEngine(cfg)
    tok = engine.tokenizer
    prompts = []
    for n, row in enumerate(rows, 1):
        if "messages" in row:
            prompts.append(apply_chat_template(tok, row["messages"]))
        else:
            prompts.append(tok.encode(row["prompt"]))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            ignore_eos=args.ignore_eos, seed=args.seed)
    bar = tqdm(total=len(prompts), desc="generate", unit="req", file=sys.stderr)
    t0 = time.perf_counter()
    reqs = engine.generate(prompts, params, progress=bar)
    elapsed = time.perf_counter() - t0
    bar.close()
    with open(args.output, "w") as f:
        for row, req in zip(rows, reqs):
            f.write(json.dumps({
                "id": row.get("id"), "text": req.text, "token_ids": req.output_ids,
                "finish_reason": req.finish_reason, "num_prompt_tokens": len(req.prompt_ids),
                "num_output_tokens": len(req.output_ids), "accept_lengths": req.accept_lengths,
            }) + "\n")
    out_tokens = sum(len(r.output_ids) for r in reqs)
    accepts = [a for r in reqs for a in r.accept_lengths]
    stats = {"requests": len(reqs), "output_tokens": out_tokens, "seconds": elapsed,
             "tokens_per_s": out_tokens / elapsed if elapsed > 0 else 0.0,
             "mean_accept_length": sum(accepts) / len(accepts) if accepts else None,
             "speculative": cfg.draft.enabled}
    if args.stats:
        with open(args.stats, "w") as f:
            json.dump(stats, f, indent=2)
    print(f"{len(reqs)} requests, {out_tokens} tokens in {elapsed:.1f}s "
          f"({stats['tokens_per_s']:.1f} tok/s)"
          + (f", mean accept length {stats['mean_accept_length']:.2f}" if accepts else ""),
          file=sys.stderr)


def cmd_chat(args) -> None:
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.engine.request import SamplingParams
    from serve_app.text.tokenizer import apply_chat_template

    cfg = _config(args)
    print("loading the model...", file=sys.stderr)
    engine = LLMEngine(cfg)
    messages: list[dict] = []
    print("kestrel chat: type a message, an empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        ids = apply_chat_template(engine.tokenizer, messages)

        def show(ev):
            print(ev.new_text, end="", flush=True)

        req = engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens,
                                                     temperature=args.temperature), on_output=show)
        while engine.has_work:
            engine.step()
        print()
        messages.append({"role": "assistant", "content": req.text})


def cmd_serve(args) -> None:
    from serve_app.app import run_server
    cfg = _config(args)
    overrides = {}
    if args.host:
        overrides["host"] = args.host
    if args.port:
        overrides["port"] = args.port
    run_server(cfg, **overrides)


def cmd_env(args) -> None:
    """The variables `kestrel serve` sets for the Ray instance it starts, as shell
    `export` lines, for Ray's own `serve run` on this machine: `eval "$(kestrel env)"`.
    Ray's processes read them when they start, so they must be in the environment of the
    command that starts Ray; `serve run` cannot take them from its config file."""
    import shlex

    from serve_app.app import local_ray_env
    for key, value in sorted(local_ray_env(_config(args)).items()):
        print(f"export {key}={shlex.quote(value)}")


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s",
                        stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    # These own their whole argument list (argparse's REMAINDER refuses a leading option).
    if argv and argv[0] == "train-draft":
        from training.train import main as train_main
        return train_main(argv[1:])
    if argv and argv[0] == "serve":
        from serve_app.server_process import is_server, supervise
        if not is_server():  # the server runs in a session of its own (server_process.py)
            sys.exit(supervise(argv))
    if argv and argv[0] == "bench":
        from benchmarks.offline import main as offline_main
        return offline_main(argv[1:])
    parser = argparse.ArgumentParser(prog="kestrel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="offline generation from a JSONL file (no Ray)")
    _add_common(g)
    g.add_argument("--input", required=True)
    g.add_argument("--output", required=True)
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--no-spec", action="store_true", help="turn speculative decoding off")
    g.add_argument("--stats", default=None, help="write tokens/s and accept length here")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive chat on the in-process engine")
    _add_common(c)
    c.add_argument("--max-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0)
    c.set_defaults(func=cmd_chat)

    s = sub.add_parser("serve", help="start Ray (or join RAY_ADDRESS) and the Serve app")
    _add_common(s)
    s.add_argument("--host", default=None)
    s.add_argument("--port", type=int, default=None)
    s.set_defaults(func=cmd_serve)

    e = sub.add_parser("env", help="the environment for `serve run` on this machine: "
                       "eval \"$(kestrel env)\" before `serve run configs/serve.yaml`")
    _add_common(e)
    e.set_defaults(func=cmd_env)

    # Listed for --help; main() hands their arguments over before parsing.
    sub.add_parser("bench", help="benchmarks: `kestrel bench offline --help`")
    sub.add_parser("train-draft", help="train an EAGLE head: `kestrel train-draft --help`")

    args = parser.parse_args(argv)
    from serve_app.engine.model_files import ModelFilesMissing
    try:
        args.func(args)
    except (ValueError, ModelFilesMissing) as e:
        sys.exit(f"kestrel: {e}")


if __name__ == "__main__":
    main()
