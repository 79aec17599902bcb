"""EAGLE speculative decoding worker (spec v2): draft, verify, draft extend, future map."""
