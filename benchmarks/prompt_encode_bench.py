"""A long prompt's encoding, three ways, in one process: the tokenizer's batch call on the
whole text (with offsets), its ids-only call on the whole text, and the prompt encoder's
pieces (serve_app/text/text_pieces.py), which spread one text over the cores.

    python -m benchmarks.prompt_encode_bench [--model models/qwen2.5-7b] [--words 22800] [--texts 15]

Each text is a chat-templated MT-bench prompt lengthened as http_bench's
--long-prompt-words does; the three ways run in turn on each text (so a busy machine
slows all three alike), and the pieces' ids are checked against the whole text's.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks.http_bench import long_prompt
from benchmarks.offline import DATA, load_questions
from serve_app.text.text_pieces import PieceEncoder
from serve_app.text.tokenizer import load_tokenizer, render_chat_template


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a model folder with a tokenizer (default: the default model)")
    ap.add_argument("--words", type=int, default=22800, help="words a prompt has at least")
    ap.add_argument("--texts", type=int, default=15)
    args = ap.parse_args(argv)
    if args.model is None:
        from actors.models.loader import default_model_path
        args.model = default_model_path()
    tok = load_tokenizer(args.model)
    backend = tok.backend_tokenizer
    pieces = PieceEncoder(backend)
    questions = load_questions(Path(DATA), 80)
    texts = [render_chat_template(tok, [{"role": "user", "content": long_prompt(questions, i, args.words)}])
             for i in range(args.texts)]
    ways = {
        "encode_batch, whole text": lambda t: backend.encode_batch([t], add_special_tokens=False)[0].ids,
        "encode_batch_fast, whole text": lambda t: backend.encode_batch_fast([t], add_special_tokens=False)[0].ids,
        "pieces (the prompt encoder)": lambda t: pieces.encode_batch([t], False)[0],
    }
    ms: dict[str, list[float]] = {name: [] for name in ways}
    for i, text in enumerate(texts):
        ids = None
        for name, encode in ways.items():
            t0 = time.perf_counter()
            out = encode(text)
            ms[name].append(1000 * (time.perf_counter() - t0))
            if ids is not None and out != ids:
                raise SystemExit(f"text {i}: {name} gave other ids than the whole text's")
            ids = out
        print(f"text {i + 1}/{len(texts)}: {len(ids)} tokens, {len(pieces.cuts(text)) + 1} pieces", flush=True)
    print(f"{args.model}: ms per text, median (min-max) of {len(texts)}")
    for name, xs in ms.items():
        print(f"  {name:32s} {statistics.median(xs):6.1f} ({min(xs):.1f}-{max(xs):.1f})")


if __name__ == "__main__":
    main()
