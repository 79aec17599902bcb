"""Text in and out: tokenizer and chat template, incremental detokenizer, grammars."""
