"""Checkpoint load speed and host memory: write a safetensors checkpoint of a model shape
from dummy weights, then load it with Kestrel's loader in a fresh process (its page cache
dropped first, so the load reads the disk) and print load seconds, GB/s and the peak host
memory above the process's baseline; the loaded weights are checked against the written ones.

    python -m benchmarks.load_bench --shape models/qwen2.5-7b --dir /local/ckpt --device cuda
    python -m benchmarks.load_bench --shape models/qwen2.5-7b --dir /tmp/tiny --device cpu \\
        --override num_hidden_layers=2 hidden_size=256 intermediate_size=512 \\
                   num_attention_heads=4 num_key_value_heads=2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from actors.models.loader import build_model


def write_checkpoint(shape: str, out: str, overrides: dict, dtype: torch.dtype, device: str,
                     shard_bytes: int, seed: int) -> float:
    """The shape's model with dummy weights as an HF folder in ``out`` (sharded); its GB."""
    from safetensors.torch import save_file

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(shape, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(overrides)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    model, _ = build_model(out, dtype, device, load_format="dummy", seed=seed)
    state = model.checkpoint_state()  # HF names; q/k/v and gate/up as views of the fused rows
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = total = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if size and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
        total += n
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        # One shard on the host at a time (at most shard_bytes).
        save_file({k: v.to("cpu").contiguous() for k, v in shard.items()}, os.path.join(out, fname),
                  metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total / 1e9


def drop_page_cache(folder: str) -> None:
    """Evict the folder's files from the page cache (written back first), so the load reads the disk."""
    for name in os.listdir(folder):
        fd = os.open(os.path.join(folder, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load(folder: str, dtype: torch.dtype, device: str, seed: int, verify: bool) -> dict:
    """Kestrel's load of ``folder``, with its figures (and, verified, the weights' equality)."""
    t0 = time.perf_counter()
    model, _ = build_model(folder, dtype, device)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    out = dict(model.load_stats, build_seconds=time.perf_counter() - t0,
               ru_maxrss_gb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9)
    if device == "cpu":  # the loaded model itself lives in host memory there
        model_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e9
        out["peak_host_gb_beyond_model"] = out["peak_host_gb_above_baseline"] - model_gb
    if verify:
        ref, _ = build_model(folder, dtype, device, load_format="dummy", seed=seed)
        mine, want = dict(model.named_parameters()), dict(ref.named_parameters())
        bad = [k for k in want if not torch.equal(mine[k], want[k])]
        out["verified"] = not bad
        if bad:
            out["mismatched"] = bad[:8]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="models/qwen2.5-7b", help="a folder with config.json")
    ap.add_argument("--dir", required=True, help="where to write the checkpoint (local disk)")
    ap.add_argument("--override", nargs="*", default=[], help="config.json key=value (ints), e.g. a tiny shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shard-gb", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-verify", action="store_true", help="skip comparing the loaded weights")
    ap.add_argument("--load-only", action="store_true", help="(internal) load --dir and print JSON")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    if args.load_only:
        print(json.dumps(load(args.dir, dtype, args.device, args.seed, not args.no_verify)))
        return
    overrides = {k: int(v) for k, v in (o.split("=", 1) for o in args.override)}
    t0 = time.perf_counter()
    gb = write_checkpoint(args.shape, args.dir, overrides, dtype, args.device,
                          int(args.shard_gb * 1e9), args.seed)
    print(f"wrote {gb:.2f} GB to {args.dir} in {time.perf_counter() - t0:.1f} s")
    drop_page_cache(args.dir)
    # A fresh process: its baseline is a server's before loading, not this one's after writing.
    cmd = [sys.executable, "-m", "benchmarks.load_bench", "--load-only", "--dir", args.dir,
           "--dtype", args.dtype, "--device", args.device, "--seed", str(args.seed)]
    if args.no_verify:
        cmd.append("--no-verify")
    res = subprocess.run(cmd, check=True, capture_output=True, text=True)
    r = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"load: {r['seconds']:.2f} s ({r['build_seconds']:.2f} s with the model's allocation), "
          f"{r['gb']:.2f} GB, {r['gb_per_s']:.2f} GB/s; host memory peak "
          f"{r['peak_host_gb_above_baseline']:.3f} GB above baseline"
          + (f" ({r['peak_host_gb_beyond_model']:.3f} GB beyond the model's own)" if "peak_host_gb_beyond_model" in r else "")
          + f" (ru_maxrss {r['ru_maxrss_gb']:.2f} GB); "
          f"weights equal to the written ones: {r.get('verified', 'not checked')}")
    print(json.dumps(r))


if __name__ == "__main__":
    main()
