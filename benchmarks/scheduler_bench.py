"""Host cost of an engine step at a large batch: the real scheduler, no model.

    python -m benchmarks.scheduler_bench [--running 512] [--waiting 100000] [--steps 300]
        [--config configs/h200.yaml] [--plain] [--kv-slots 262144] [--seed 0] [--profile FILE]
        [--stream] [--greedy]

Data generation runs 512 requests at once with a deep queue behind them; there the
scheduler's host time per step outweighed the GPU forward. This drives the same
`LLMEngine.step()` (schedule, execute, process_output, with KV allocation, the prefix
cache, coins, stop checks and the deferred detokenization of the real SmolLM2 tokenizer)
with a stand-in worker that returns synthetic tokens: 1-3 per request per decode step, as
speculative decoding accepts them (1 with --plain, as data generation runs). Requests
are sampled half greedy, half seeded, and end at their stop token or max_tokens, so the
queue keeps refilling the batch through extend steps.

With --stream every request streams as in the served engine: its outputs go to an outbox
each step, token ids only (the engine core makes no text; the front end does), and the
outbox is encoded as the core sends it (`send` ms a step). --greedy makes every request
greedy, as the GPU benchmarks' traffic is.

Once the batch is full, --steps steps are measured; it prints ms per step of schedule
and process (and send) for decode and extend steps, and a digest of every plan and every finished
request: equal digests mean the scheduler behaved the same (for the same arguments).
"""
from __future__ import annotations

import argparse
import cProfile
import hashlib
import random
import sys
import time
from types import SimpleNamespace

from actors.protocol.messages import Outputs, encode
from actors.protocol.step_plan import StepOutput, StepPlan
from actors.worker.kv_cache import max_request_slots
from configs.schema import load_config
from serve_app.engine.llm_engine import LLMEngine
from serve_app.engine.request import SamplingParams

EOS = 2  # SmolLM2's <|im_end|>: the chat turn's end and the model's eos
SHARED_PREFIX = list(range(1000, 1024))  # every prompt starts alike (a chat template's header)


class SyntheticWorker:
    """Stands in for a RankWorker: tokens from a seeded generator, nothing computed.

    Every plan it sees goes into `digest`, so two runs that plan differently differ."""

    def __init__(self, info: dict, seed: int, max_accept: int, eos_rate: float):
        self._info = info
        self.arch = SimpleNamespace(eos_token_ids=[EOS])
        self.rng = random.Random(seed)
        self.max_accept = max_accept
        self.eos_rate = eos_rate
        self.digest = hashlib.sha256()
        self.last_mode = ""

    def info(self) -> dict:
        return self._info

    def _token(self) -> int:
        return EOS if self.rng.random() < self.eos_rate else self.rng.randrange(100, 16000)

    def execute(self, plan: StepPlan) -> StepOutput:
        self.last_mode = plan.mode
        d = self.digest
        d.update(repr((plan.mode, plan.rows, plan.temperature, plan.top_p, plan.top_k,
                       plan.prefix_lens, plan.extend_lens, plan.last_chunk,
                       plan.next_ids, len(plan.input_ids))).encode())
        for row, start, slots in plan.kv_writes:
            d.update(repr((row, start, slots.tolist())).encode())
        d.update(plan.coins.tobytes())
        if plan.mode == "extend":
            tokens = [[self._token()] if last else [] for last in plan.last_chunk]
        else:
            tokens = [[self._token() for _ in range(self.rng.randint(1, self.max_accept))]
                      for _ in plan.rows]
        return StepOutput(plan.step_id, tokens)

    def launch(self, plan: StepPlan) -> StepOutput:
        """The engine launches step N+1 before finishing N: here the output is made at once."""
        return self.execute(plan)

    def finish(self, out: StepOutput) -> StepOutput:
        return out


def build_engine(args, tokenizer) -> tuple[LLMEngine, SyntheticWorker]:
    spec = not args.plain
    cfg = load_config(args.config, [
        f"draft.enabled={str(spec).lower()}", "draft.path=random",
        f"scheduler.max_running_requests={args.running}",
        # as training/train.py sets it for data generation (and plans that do not hang on
        # the clock, which prefill_by_cost's would)
        f"scheduler.prefill_min_batch={max(1, args.running // 8)}", "scheduler.prefill_by_cost=false",
        f"model.max_model_len={args.max_model_len}",
        # The test's pinned digests are of plans made one step at a time.
        f"scheduler.launch_ahead={str(args.launch_ahead).lower()}"])
    window = cfg.draft.window if spec else 1
    page = cfg.kv_cache.page_size
    per_request = max_request_slots(args.max_model_len, window, page)
    info = {"num_slots": args.kv_slots, "num_rows": args.running + 2,
            "max_context": per_request, "window": window}
    worker = SyntheticWorker(info, args.seed, 3 if spec else 1, args.eos_rate)
    return LLMEngine(cfg, tokenizer=tokenizer, workers=[worker]), worker


def add_requests(engine: LLMEngine, n: int, rng: random.Random, max_tokens: int,
                 outbox: list | None = None, all_greedy: bool = False) -> None:
    """`outbox`: each request's outputs go there (a stream, as in the served engine)."""
    on_output = None if outbox is None else outbox.append
    for i in range(n):
        prompt = SHARED_PREFIX + [rng.randrange(100, 16000) for _ in range(rng.randint(8, 120))]
        greedy = rng.random() < 0.5 or all_greedy
        engine.add_request(prompt, SamplingParams(
            max_tokens=rng.randint(max_tokens // 4, max_tokens), stop_token_ids=[EOS],
            temperature=0.0 if greedy else 0.8, seed=None if greedy else i), on_output=on_output)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--running", type=int, default=512, help="batch (max running requests)")
    ap.add_argument("--waiting", type=int, default=100_000, help="requests queued behind it")
    ap.add_argument("--steps", type=int, default=300, help="steps measured once the batch is full")
    ap.add_argument("--config", default="configs/h200.yaml")
    ap.add_argument("--plain", action="store_true", help="one token per step (no speculation)")
    ap.add_argument("--max-tokens", type=int, default=384)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-slots", type=int, default=1 << 18,
                    help="KV pool: small enough that the prefix cache fills it and evicts")
    ap.add_argument("--eos-rate", type=float, default=0.004,
                    help="chance that a token is the stop token")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--launch-ahead", action="store_true",
                    help="plan step N+1 before N's output is processed, as the server does")
    ap.add_argument("--profile", help="write a cProfile of the measured steps here")
    ap.add_argument("--stream", action="store_true",
                    help="requests stream token ids to an outbox, encoded each step, as served")
    ap.add_argument("--greedy", action="store_true", help="every request greedy (else half sampled)")
    args = ap.parse_args(argv)

    from actors.models.loader import default_model_path
    from serve_app.text.tokenizer import load_tokenizer
    tokenizer = load_tokenizer(default_model_path())
    engine, worker = build_engine(args, tokenizer)
    sched = engine.schedulers[0]
    t0 = time.perf_counter()
    outbox: list | None = None
    if args.stream:
        outbox = []
        for sc in engine.schedulers:
            sc.detokenizer_factory = None  # the engine core makes no text
    add_requests(engine, args.running + args.waiting, random.Random(args.seed), args.max_tokens,
                 outbox, args.greedy)
    print(f"queued {sched.num_requests} requests in {time.perf_counter() - t0:.1f} s", flush=True)

    finished = hashlib.sha256()

    def step() -> float:
        """One engine step; the seconds its outputs took to encode (--stream), else 0."""
        for ev in engine.step():
            if ev.finished:
                finished.update(repr((ev.rid, ev.finish_reason, ev.num_output_tokens,
                                      ev.new_text)).encode())
        if not outbox:
            return 0.0
        t0 = time.perf_counter()
        encode(Outputs(outbox))
        outbox.clear()
        return time.perf_counter() - t0

    warm = 0
    while len(sched.running) < args.running and sched.has_work:
        step()
        warm += 1
    print(f"batch full after {warm} steps ({len(sched.running)} running, "
          f"{len(sched.waiting)} waiting)", flush=True)

    # seconds and steps per mode, of schedule, process and (--stream) send
    spent = {m: {"schedule": 0.0, "process": 0.0, "send": 0.0, "steps": 0} for m in ("decode", "extend")}
    profiler = cProfile.Profile() if args.profile else None
    for i in range(1, args.steps + 1):
        before = dict(engine.seconds)
        if profiler:
            profiler.enable()
        send = step()
        if profiler:
            profiler.disable()
        mode = spent[worker.last_mode]
        mode["steps"] += 1
        mode["send"] += send
        for k in ("schedule", "process"):
            mode[k] += engine.seconds[k] - before[k]
        if i % 50 == 0 or i == args.steps:
            d = spent["decode"]
            n = max(d["steps"], 1)
            print(f"step {i}: decode schedule {1e3 * d['schedule'] / n:.2f} ms, process "
                  f"{1e3 * d['process'] / n:.2f} ms ({len(sched.running)} running, "
                  f"{len(sched.waiting)} waiting)", flush=True)
    if profiler:
        profiler.dump_stats(args.profile)

    result = {}
    print(f"\n{'steps':<8}{'count':>7}{'schedule ms':>13}{'process ms':>12}{'send ms':>9}")
    for mode, s in spent.items():
        n = max(s["steps"], 1)
        result[mode] = {"steps": s["steps"], "schedule_ms": 1e3 * s["schedule"] / n,
                        "process_ms": 1e3 * s["process"] / n, "send_ms": 1e3 * s["send"] / n}
        print(f"{mode:<8}{s['steps']:>7}{result[mode]['schedule_ms']:>13.2f}"
              f"{result[mode]['process_ms']:>12.2f}{result[mode]['send_ms']:>9.2f}")
    total = sum(s["steps"] for s in spent.values())
    result["all"] = {k: 1e3 * sum(s[k] for s in spent.values()) / max(total, 1)
                     for k in ("schedule", "process", "send")}
    a = result["all"]
    print(f"{'all':<8}{total:>7}{a['schedule']:>13.2f}{a['process']:>12.2f}{a['send']:>9.2f}")
    result["preemptions"] = sched.stats["preemptions"]
    print(f"{sched.stats['preemptions']} preemptions, {sched.cache.total_slots} KV slots in the "
          f"prefix cache, {sched.slots.free_slots} free")
    result["digest"] = f"{worker.digest.hexdigest()[:16]}-{finished.hexdigest()[:16]}"
    print(f"digest {result['digest']} (plans-finished requests)")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
