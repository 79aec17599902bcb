"""Model definitions (Llama family, EAGLE heads) and weight loaders."""
