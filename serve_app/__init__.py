"""Control plane (CPU only): OpenAI ingress, tokenizer, Engine deployment (scheduler), CLI."""
