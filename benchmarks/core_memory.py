"""Does the engine core's host memory grow with the requests it has served?

    python -m benchmarks.core_memory [--warm 1000] [--requests 3000] [--slots 4096]

The engine core, its front end and a rank worker in one process (tests' LocalEngine: real
sockets, the tiny random model on the CPU, prefix caching on with a small KV cache so it
is full and evicting early), `--requests` requests of mixed kinds (greedy, seeded
sampling, logprobs, penalties, stop strings, streams dropped after two outputs) at 16 at
a time, traced by tracemalloc from the first. After `--warm` requests (the KV cache and
the prefix cache full) it takes a snapshot and the resident size, and again at the end: what grew between the two, per request, and where (the ten largest
growths by traceback). A leak shows as growth that scales with the requests; the prefix
cache's index is bounded by the KV capacity (serve_app/engine/radix_cache.py).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rss_mb() -> float:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 / 2**20


def request_params(i: int, rng: random.Random) -> dict:
    kinds = [{}, dict(temperature=0.9, seed=i), dict(logprobs=2), dict(presence_penalty=0.5),
             dict(stop=["ab"])]
    return dict(max_tokens=rng.randrange(4, 40), ignore_eos=True, **kinds[i % len(kinds)])


async def serve(engine, n_warm: int, n_total: int, concurrency: int = 16) -> dict:
    rng = random.Random(0)
    gate = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with gate:
            prompt = [rng.randrange(3, 2000) for _ in range(rng.randrange(8, 60))]
            stream = engine.client.add_request(prompt, request_params(i, rng), f"r{i}")
            seen = 0
            async for _ in stream:
                seen += 1
                if i % 7 == 0 and seen == 2:  # a client that hangs up
                    stream.cancel()
                    break

    t0 = time.time()
    out = {}
    done = 0
    tracemalloc.start(12)  # from the first request: what the caches hold at the warm
    # snapshot is traced too, so churn inside their bounds does not read as growth
    for name, upto in (("warm", n_warm), ("end", n_total)):
        while done < upto:
            batch = range(done, min(upto, done + 256))
            await asyncio.gather(*(one(i) for i in batch))
            done = batch[-1] + 1
        await asyncio.sleep(0.5)  # the last outputs processed, the cancels applied
        gc.collect()
        out[name] = (tracemalloc.take_snapshot(), rss_mb(), time.time() - t0)
        print(f"after {upto} requests: RSS {out[name][1]:.1f} MB ({out[name][2]:.0f} s)", flush=True)
    out["kv"] = await engine.client.kv_stats()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warm", type=int, default=1000)
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--slots", type=int, default=4096)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from actors.worker.rank_worker import RankWorker
    from benchmarks.http_bench import make_tiny_model
    from configs.schema import load_config
    from kestrel_testing import LocalEngine
    from serve_app.text.tokenizer import load_tokenizer

    path = make_tiny_model(tempfile.mkdtemp(prefix="kestrel-tiny-"))
    cfg = load_config(overrides=[
        "device=cpu", "cpu_threads=1", "model.dtype=float32", "draft.enabled=false",
        f"model.path={path}", f"kv_cache.num_slots={args.slots}", "kv_cache.prefix_caching=true",
        "scheduler.max_running_requests=32", "model.max_model_len=512"])
    worker = RankWorker(cfg)

    async def run() -> dict:
        engine = await LocalEngine.start(cfg, worker.info(), worker, load_tokenizer(path))
        try:
            return await serve(engine, args.warm, args.requests)
        finally:
            await engine.stop()

    res = asyncio.run(run())
    (a, rss_a, _), (b, rss_b, _) = res["warm"], res["end"]
    n = args.requests - args.warm
    growth = b.compare_to(a, "traceback")
    total = sum(d.size_diff for d in growth)
    print(f"\nKV at the end: {res['kv']}")
    print(f"requests {args.warm} -> {args.requests}: RSS {rss_a:.1f} -> {rss_b:.1f} MB "
          f"({1024 * (rss_b - rss_a) / n:.2f} KB per request); traced Python memory "
          f"{total / 1024:+.1f} KB ({total / n:.0f} B per request)\n")
    for d in growth[:10]:
        where = d.traceback.format()[-2].strip()
        print(f"{d.size_diff / 1024:+8.1f} KB {d.count_diff:+6d} blocks  {where}")


if __name__ == "__main__":
    main()
