"""Device ops: pure-torch references (CPU path and test oracle), Triton kernels on GPU."""
