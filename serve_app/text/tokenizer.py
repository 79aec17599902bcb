"""Tokenizer loading (HF folder or GGUF, with an on-disk cache for GGUF) and chat templating."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Any

log = logging.getLogger(__name__)


def tokenizer_cache_root() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kestrel", "tokenizers")


def gguf_cache_dir(gguf_path: str) -> str:
    """<root>/<name>-<size>-<mtime hash>: a changed or replaced file gets a fresh entry."""
    st = os.stat(gguf_path)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    stamp = hashlib.sha256(str(st.st_mtime_ns).encode()).hexdigest()[:12]
    return os.path.join(tokenizer_cache_root(), f"{stem}-{st.st_size}-{stamp}")


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer from an HF folder, or from a GGUF's metadata (cached after the first time)."""
    from transformers import AutoTokenizer

    if not path.lower().endswith(".gguf"):
        return AutoTokenizer.from_pretrained(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: GGUF file not found")

    cache = gguf_cache_dir(path)
    if os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        return AutoTokenizer.from_pretrained(cache)

    # Converting the GGUF vocabulary and merges takes seconds; do it once and keep the result.
    tok = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)), gguf_file=os.path.basename(path))
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        # Write beside the target and rename: a reader never sees a half-written folder,
        # and of two concurrent writers the loser simply drops its copy.
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(cache))
        tok.save_pretrained(tmp)  # tokenizer.json, tokenizer_config.json, chat template
        try:
            os.rename(tmp, cache)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:  # read-only home etc.: still serve, just without the cache
        log.warning("could not cache tokenizer for %s in %s: %s", path, cache, e)
    return tok


def render_chat_template(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                         continue_final_message: bool = False, **kw: Any) -> str:
    """Chat messages -> the prompt's text: by default ending with the assistant turn header;
    with continue_final_message, ending inside the last message (no end-of-turn) so that
    generation extends it. Encode it without special tokens added (the template wrote them)."""
    return tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tokenize=False, **kw)


def apply_chat_template(tok: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                        continue_final_message: bool = False) -> list[int]:
    """Chat messages -> prompt token ids, as plain ints (render_chat_template, encoded).

    The rendered text goes to the Rust tokenizer directly: the same ids as transformers'
    tokenize=True (which encodes the rendered text without special tokens added), without
    its batch wrapping, which cost more than the encoding itself."""
    text = render_chat_template(tok, messages, add_generation_prompt, continue_final_message)
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        return backend.encode(text, add_special_tokens=False).ids
    return [int(t) for t in tok.encode(text, add_special_tokens=False)]


def stop_token_ids(tok: Any, model_eos_ids) -> set[int]:
    """Ids that end generation: the model's eos ids (a list, or an arch carrying them)
    plus the tokenizer's eos token."""
    ids = {int(t) for t in getattr(model_eos_ids, "eos_token_ids", model_eos_ids)}
    if getattr(tok, "eos_token_id", None) is not None:
        ids.add(int(tok.eos_token_id))
    return ids
