"""The draft trainer's token loss, chunked (training/soft_ce.py) against the plain autograd
path: forward plus backward of one unrolled step's loss at SmolLM2-135M's LM head (49,152
ids, 576 wide), and whole training steps of an EAGLE head on the real target.

    python -m benchmarks.soft_ce_bench [--device cuda] [--rows 8192] [--step-batch 16 --step-tokens 1024]

`--step-batch 0` leaves out the training steps (they need the default model).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from training.soft_ce import soft_ce, soft_ce_reference


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def _peak(dev: torch.device) -> str:
    return f", peak {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB" if dev.type == "cuda" else ""


def _reset(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def loss_only(dev, dtype, rows: int, vocab: int, hidden: int, repeats: int, trained_head: bool) -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    h = torch.randn(rows, hidden, device=dev, generator=g, requires_grad=True)  # [N, H] f32
    w = (0.05 * torch.randn(vocab, hidden, device=dev, generator=g)).to(  # [V, H]
        torch.float32 if trained_head else dtype).requires_grad_(trained_head)
    t_probs = torch.softmax(3 * torch.randn(rows, vocab, device=dev, generator=g), -1)  # [N, V] f32
    r = torch.arange(rows, device=dev)  # [N] int64
    rw = torch.full((rows,), 1.0 / rows, device=dev)  # [N] f32
    for name, fn in (("autograd", soft_ce_reference), ("chunked", soft_ce)):
        def once():
            loss, _ = fn(h, w, t_probs, r, rw, dtype)
            loss.backward()
        once()  # warm-up
        _reset(dev)
        times = []
        for _ in range(repeats):
            _sync(dev)
            t0 = time.perf_counter()
            once()
            _sync(dev)
            times.append(time.perf_counter() - t0)
        print(f"  {name:>9}: {1000 * statistics.median(times):8.1f} ms (median of {repeats}){_peak(dev)}", flush=True)


def train_steps(dev, batch: int, tokens: int, repeats: int, arch: str) -> None:
    import training.train as tt
    from actors.models.loader import build_model, default_model_path
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target, tarch = build_model(default_model_path(), dtype, str(dev))
    vocab = None
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, tarch.vocab_size, (batch, tokens), generator=g)  # [B, T] int64
    mask = torch.ones(batch, tokens, dtype=torch.bool)  # [B, T]
    mask[:, : tokens // 8] = False  # a prompt, then the answer
    if arch == "eagle3":
        from training.vocab import build_draft_vocab
        samples = [{"input_ids": row.tolist(), "loss_mask": m.int().tolist()} for row, m in zip(ids, mask)]
        vocab = build_draft_vocab(samples, tarch.vocab_size, 8192)
    ids, mask, lens = ids.to(dev), mask.to(dev), torch.full((batch,), tokens, device=dev)
    cfg = tt.TrainConfig(arch=arch, epochs=1)
    real = tt.soft_ce
    for name, fn in (("autograd", soft_ce_reference), ("chunked", real)):
        tt.soft_ce = fn
        head = tt.init_head(tt.make_spec(tarch, arch, vocab), target, vocab)
        trainer = tt.Trainer(target, head, cfg, vocab)
        trainer.train_step(ids, mask, lens)  # warm-up
        _reset(dev)
        times = []
        for _ in range(repeats):
            _sync(dev)
            t0 = time.perf_counter()
            trainer.train_step(ids, mask, lens)
            _sync(dev)
            times.append(time.perf_counter() - t0)
        print(f"  {name:>9}: {1000 * statistics.median(times):8.1f} ms a step (median of {repeats}){_peak(dev)}",
              flush=True)
        del trainer, head
    tt.soft_ce = real


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", type=int, default=8192, help="supervised rows of one unrolled step")
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--step-batch", type=int, default=16, help="training-step sequences (0: no steps)")
    ap.add_argument("--step-tokens", type=int, default=1024)
    ap.add_argument("--archs", nargs="+", default=["eagle", "eagle3"])
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    print(f"loss alone: {args.rows} rows x {args.vocab} ids x {args.hidden}, {dev.type}, matmuls in {dtype}")
    print(" frozen LM head (EAGLE-1: the target's)")
    loss_only(dev, dtype, args.rows, args.vocab, args.hidden, args.repeats, trained_head=False)
    print(" trained LM head (EAGLE-3's own, 8192 ids)")
    loss_only(dev, dtype, args.rows, 8192, args.hidden, args.repeats, trained_head=True)
    if args.step_batch:
        for arch in args.archs:
            print(f"training steps: {arch}, {args.step_batch} x {args.step_tokens} tokens, the default model")
            train_steps(dev, args.step_batch, args.step_tokens, args.repeats, arch)


if __name__ == "__main__":
    main()
