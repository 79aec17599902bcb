"""CUDA graphs: decode, verify and prefill replays, the plan stream, and warm-up."""
