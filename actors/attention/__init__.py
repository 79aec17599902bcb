"""Attention backends behind one interface: torch_native (reference), triton, flashinfer."""
