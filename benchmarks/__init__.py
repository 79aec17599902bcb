"""Benchmarks: offline engine, HTTP load, peers."""
