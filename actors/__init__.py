"""Data plane: RankWorker, model runner, models, KV cache, attention backends, spec, DP."""
