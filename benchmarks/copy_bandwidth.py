"""The device's measured memory bandwidth: the floor a memory-bound decode step is judged by.

    python -m benchmarks.copy_bandwidth [--gib 4] [--repeats 20]

Copies a bf16 buffer of --gib GiB into another on the GPU, best of --repeats, and prints the
bandwidth (bytes read plus bytes written, per second)."""
from __future__ import annotations

import argparse
import json

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    n = int(args.gib * 2 ** 30) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")  # [n] bf16
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    moved = 2 * n * 2  # read and written, bytes
    print(json.dumps({"device": torch.cuda.get_device_name(), "gib": args.gib,
                      "seconds": best, "tb_per_s": moved / best / 1e12}))


if __name__ == "__main__":
    main()
