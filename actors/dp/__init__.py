"""Data-parallel ranks: their group, the per-step int64 sync, and dp_attention (steps in
lockstep, the dense layers split across the group)."""
