"""Race hunt: speculative decoding with graphs + plan stream vs everything eager.

Requests with random prompts and random max_tokens arrive over time, so the running
batch grows and shrinks through sizes that need graph padding, sizes that do not and
sizes above the largest captured one. The same arrival schedule runs twice: once with
the speculative runners (CUDA graphs) and the plan stream, once with both off. Every
request must get the same tokens; a missing stream wait, a stale padded lane or a freed
buffer still in use shows up as a mismatch.

GPU:  python -m benchmarks.race_hunt --iterations 2000 --seed 0
CPU:  python -m benchmarks.race_hunt --iterations 30 --device cpu   (torch_native; the
      runners' eager stand-in replays the padded batches, no plan stream)

Prints progress and a final PASS/FAIL line with counts; exit code 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from configs.schema import load_config
from serve_app.llm_engine import LLMEngine
from serve_app.request import Request, SamplingParams

SHAPES = {"chain": ["draft.topk=1", "draft.num_steps=3", "draft.num_draft_tokens=4"],
          "tree": ["draft.topk=4", "draft.num_steps=5", "draft.num_draft_tokens=8"]}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iterations", type=int, default=2000, help="speculative iterations per run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--model", default=None, help="target path (default: the embedded SmolLM2)")
    p.add_argument("--dtype", default="float32", help="float32 keeps greedy ties out of the way")
    p.add_argument("--shape", choices=sorted(SHAPES), default="tree")
    p.add_argument("--graph-sizes", default="1,2,4,8", help="captured batch sizes")
    p.add_argument("--max-running", type=int, default=12,
                   help="concurrent requests (above the largest graph size: eager steps too)")
    p.add_argument("--max-tokens", type=int, default=48, help="upper bound of random max_tokens")
    p.add_argument("--arrival", type=float, default=0.3, help="chance of new requests per step")
    p.add_argument("--sampled", type=float, default=0.25,
                   help="fraction of seeded temperature>0 requests")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override, for both runs")
    return p.parse_args(argv)


def make_engine(args, device: str, graphs: bool) -> LLMEngine:
    sizes = [int(s) for s in args.graph_sizes.split(",")]
    cuda = device == "cuda"
    overrides = [f"device={device}", f"model.dtype={args.dtype}", "draft.enabled=true",
                 "draft.path=random", f"scheduler.max_running_requests={args.max_running}",
                 "kv_cache.num_slots=8192", "model.max_model_len=1024",
                 f"attention.backend={'triton' if cuda else 'torch_native'}",
                 f"attention.cuda_graph_batch_sizes={sizes}",
                 f"attention.cuda_graphs={str(graphs and cuda).lower()}",
                 f"attention.plan_stream={str(graphs and cuda).lower()}", *SHAPES[args.shape]]
    if args.model:
        overrides.append(f"model.path={args.model}")
    eng = LLMEngine(load_config(overrides=overrides + args.set), load_tokenizer=False)
    if graphs and not cuda:  # CPU: the runners' eager stand-in, same padding path
        for w in eng.workers:
            w.eagle.capture_graphs(sizes)
    return eng


class Workload:
    """The arrival schedule: one seeded draw per loop pass, so two runs that behave the
    same see the same requests at the same steps."""

    def __init__(self, args, vocab: int):
        self.args, self.vocab = args, vocab
        self.rng = random.Random(args.seed)
        self.count = 0

    def arrivals(self) -> list[tuple[str, list[int], SamplingParams]]:
        a, rng = self.args, self.rng
        n = rng.choice([1, 1, 2, 3]) if rng.random() < a.arrival else 0
        out = []
        for _ in range(n):
            prompt = [rng.randrange(3, self.vocab) for _ in range(rng.randrange(4, 64))]
            sampled = rng.random() < a.sampled
            params = SamplingParams(max_tokens=rng.randrange(1, a.max_tokens + 1), ignore_eos=True,
                                    temperature=0.8 if sampled else 0.0, seed=self.count)
            out.append((f"r{self.count}", prompt, params))
            self.count += 1
        return out


def run(args, device: str, graphs: bool) -> tuple[dict[str, list[int]], int, int]:
    """-> (tokens per request id, speculative iterations, largest batch seen)."""
    eng = make_engine(args, device, graphs)
    eagle = eng.workers[0].eagle
    stats = {"iterations": 0, "max_batch": 0}
    decode = eagle.decode

    def counted(plan):
        stats["iterations"] += 1
        stats["max_batch"] = max(stats["max_batch"], len(plan.rows))
        return decode(plan)

    eagle.decode = counted
    work = Workload(args, eng.workers[0].arch.vocab_size)
    reqs: list[Request] = []
    label = "graphs+plan" if graphs else "eager"
    t0, shown = time.time(), 0
    while stats["iterations"] < args.iterations or eng.has_work:
        if stats["iterations"] < args.iterations:
            reqs += [eng.add_request(p, sp, rid) for rid, p, sp in work.arrivals()]
        if not eng.has_work:
            continue
        eng.step()
        if stats["iterations"] // 100 > shown:
            shown = stats["iterations"] // 100
            print(f"  {label}: {stats['iterations']} iterations, {len(reqs)} requests, "
                  f"{time.time() - t0:.0f}s", flush=True)
    if device == "cuda":
        torch.cuda.synchronize()
    return {r.rid: list(r.output_ids) for r in reqs}, stats["iterations"], stats["max_batch"]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"race hunt: {args.iterations} iterations, seed {args.seed}, {device}, {args.dtype}, "
          f"{args.shape}, graph sizes {args.graph_sizes}, up to {args.max_running} running")
    got, iters, max_bs = run(args, device, graphs=True)
    want, ref_iters, _ = run(args, device, graphs=False)
    bad = [rid for rid in want if got.get(rid) != want[rid]]
    for rid in bad[:5]:
        a, b = got.get(rid, []), want[rid]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"  mismatch {rid}: first difference at token {at} ({a[at:at + 3]} vs {b[at:at + 3]})")
    tokens = sum(len(t) for t in want.values())
    verdict = "PASS" if not bad and len(got) == len(want) else "FAIL"
    print(f"{verdict}: {len(want) - len(bad)}/{len(want)} requests identical, {tokens} tokens, "
          f"{iters} speculative iterations with graphs ({ref_iters} eager), largest batch {max_bs}")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
