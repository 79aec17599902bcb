"""One rank: its models, KV cache and step execution, and the step channel it serves."""
