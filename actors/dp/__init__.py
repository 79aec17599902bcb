"""Data-parallel groups of RankWorkers and their per-step int64 sync."""
