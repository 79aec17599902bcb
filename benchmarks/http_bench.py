"""HTTP load benchmark: Kestrel over HTTP beside the same engine in-process, same prompts.

    python -m benchmarks.http_bench [--config configs/h200.yaml] [--set KEY=VALUE ...]
        [--concurrency 1 8 32 64] [--max-tokens 256] [--c1-prompts 10] [--repeats 3] [--rounds 1] [--out DIR]
        [--sampling '{"temperature": 0.7, "top_p": 0.9}'] [--variant NAME=JSON ...]
    python -m benchmarks.http_bench --url http://127.0.0.1:8011 --name vllm   # any server
    python -m benchmarks.http_bench --tiny-model --concurrency 1 4 16 64 256  # CPU, control plane
    python -m benchmarks.http_bench --request-rate 4 8 16 inf [--num-requests 200] [--seed 0]
        [--burstiness 1] [--burst 1] [--mix mt-bench | --mix FILE.jsonl] [--answer-tokens 64 512]
        [--slo-ttft-ms 500] [--slo-tpot-ms 50] [--client-processes 1]   # open loop, any server

Starts `kestrel serve` with the config on a free port (unless --url names a running
OpenAI-compatible server) and sends MT-bench first turns as streamed chat completions
(greedy unless --sampling says otherwise, ignore_eos, stream_options.include_usage): concurrency 1 runs the first
--c1-prompts prompts one after another, concurrency c the first c at once. With --rounds R
each of the c streams sends R requests one after another (the next c prompts each round),
as `vllm bench serve --max-concurrency c` does with R * c prompts: the level then measures
c streams kept busy, and the first burst's admission and the last answers' tail weigh
1/R as much (one round at 256-512 streams lasts 1-2 s, a fifth of it admission). Per level it
reports tokens/s (and `busy tok/s`: c streams each always busy at the mean request's
speed, the level without its tail), TTFT p50/p99, TPOT (time per output token after the first) and the gap
between streamed chunks (p50/p99), and for Kestrel the server's side read from /metrics:
its own TTFT (from admission), engine steps per second and the per-step phases
(schedule and process on the engine loop, the worker's execute and recv, `wait`: the
worker idle before a step that was already queued, and `GPU idle`: the GPU idle between
the end of a step and the start of the next, read off the GPU's own clock).
Then, with the server stopped, the same prompts at batch = concurrency through the
in-process LLMEngine with the same settings, and the ratio HTTP / in-process. With
--repeats each level runs that many times on both sides and the median run is reported
(the in-process figure alone moved by up to 20% between runs on the H200).

Open loop (--request-rate): per rate, --num-requests requests arrive on a seeded schedule
(benchmarks/arrivals.py: Poisson by default; --burstiness B draws gamma gaps of shape B, as
vLLM's benchmark_serving does, B < 1 burstier, `inf` evenly spaced; --burst N sends groups of
N together, the groups' mean gap N / rate; rate `inf` sends all at once) whether or not the
earlier ones have been answered. The requests come from a mix (benchmarks/length_mix.py: by
default the MT-bench first turns, answer lengths uniform in --answer-tokens, seeded; or a
JSONL file of {"messages" | "prompt", "max_tokens"}), ignore_eos, so prompt and answer
lengths vary and every answer runs to its max_tokens. Per rate (benchmarks/open_loop.py):
requests/s, output tokens/s, TTFT, ITL, TPOT and end-to-end latency at p50 and p99, and
goodput: requests per second that met the SLO (TTFT <= --slo-ttft-ms and TPOT <=
--slo-tpot-ms), with the share that met it. One seed gives every rate and every server the
same requests in the same order. No in-process run; JSON under --out as
http_open_loop_<name>.json, a markdown table last; benchmarks/plot_open_loop.py draws
several servers' sweeps on one figure. With --concurrency too, the closed levels run first
against the same server (one start-up for both).

--tiny-model serves a random 1-layer model with SmolLM2's tokenizer on the CPU: the
engine's own work is then small, and what is left is the control plane's cost.
The client (benchmarks/http_client.py) is aiohttp, in one process per
--streams-per-client streams; JSON under --out, a markdown table last.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import open_loop
from benchmarks.arrivals import arrival_offsets
from benchmarks.http_client import median_run, pct, run_level, stream_questions
from benchmarks.length_mix import requests_for, resolve_mix
from benchmarks.offline import DATA, load_questions

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
TINY = ["device=cpu", "cpu_threads=1", "model.dtype=float32", "draft.enabled=false", "kv_cache.num_slots=65536",
        "kv_cache.prefix_caching=false", "scheduler.max_running_requests=256",
        "scheduler.max_queued_requests=512", "model.max_model_len=1024"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_tiny_model(folder: str) -> str:
    """A random 1-layer Llama (hidden 32) with SmolLM2's vocabulary and tokenizer."""
    import torch
    import transformers

    from actors.models.loader import default_model_path
    from serve_app.text.tokenizer import load_tokenizer
    tok = load_tokenizer(default_model_path())
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                   head_dim=16, max_position_embeddings=2048, tie_word_embeddings=True,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


# ---- the server process ---------------------------------------------------------------------
def start_server(config: str | None, overrides: list[str]) -> tuple[subprocess.Popen, str, Path]:
    port = _free_port()
    cmd = [sys.executable, "-m", "serve_app.cli", "serve", "--port", str(port), "--host", "127.0.0.1"]
    if config:
        cmd += ["--config", config]
    for o in overrides:
        cmd += ["--set", o]
    log = Path(tempfile.mkstemp(prefix="kestrel-serve-", suffix=".log")[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, f"http://127.0.0.1:{port}", log


async def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 900.0) -> None:
    import aiohttp
    deadline = time.time() + timeout
    async with aiohttp.ClientSession() as s:
        while time.time() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}")
            try:
                async with s.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(1.0)
    raise TimeoutError(f"server at {url} not ready after {timeout:.0f}s")


def stop_server(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGTERM)  # drains, then exits
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# ---- in-process -----------------------------------------------------------------------------
def long_prompt(questions: list[str], i: int, words: int) -> str:
    """Question i behind the questions that follow it (round the list) until the prompt
    has at least `words` words: long prompts of real text, no two with a common prefix."""
    context, n, j = [], 0, i + 1
    while n < words:
        q = questions[j % len(questions)]
        context.append(q)
        n += len(q.split())
        j += 1
    return ("Here are some questions.\n\n" + "\n\n".join(context) +
            "\n\nNow answer only this one: " + questions[i % len(questions)])


def in_process(config: str | None, overrides: list[str], questions: list[str], levels: list[int],
               max_tokens: int, c1_prompts: int, repeats: int = 1,
               samplings: list[dict | None] = (None,), rounds: int = 1) -> list[dict[int, dict]]:
    """Each sampling setting's levels on one in-process engine (loaded once) -> per setting,
    {level: the median run}."""
    from actors.worker.gc_pauses import frozen_heap
    from configs.schema import load_config
    from serve_app.engine.llm_engine import LLMEngine
    from serve_app.text.tokenizer import apply_chat_template
    eng = LLMEngine(load_config(config, overrides))
    prompts = [apply_chat_template(eng.tokenizer, [{"role": "user", "content": q}]) for q in questions]
    with frozen_heap("http_bench in-process", eng.cfg.serve.gc_freeze):
        return [_in_process_levels(eng, prompts, sampling, levels, max_tokens, c1_prompts, repeats, rounds)
                for sampling in samplings]


def _in_process_levels(eng, prompts: list[str], sampling: dict | None, levels: list[int],
                       max_tokens: int, c1_prompts: int, repeats: int, rounds: int = 1) -> dict[int, dict]:
    from serve_app.engine.request import SamplingParams
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **(sampling or {}))
    out = {}
    for c in levels:
        # a batch a round: the prompts the HTTP level's streams send in that round
        batches = [[p] for p in prompts[:c1_prompts]] if c == 1 else \
            [list(sent) for sent in zip(*stream_questions(prompts, c, rounds))]
        eng.generate(batches[0], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
        runs = []
        for _ in range(repeats):
            reqs, t0, steps0, secs0 = [], time.perf_counter(), dict(eng.mode_steps), dict(eng.seconds)
            for b in batches:
                reqs += eng.generate(b, params)
            seconds = time.perf_counter() - t0
            ttft = [r.first_token_time - r.arrival for r in reqs]
            accepts = [a for r in reqs for a in r.accept_lengths]
            steps = sum(eng.mode_steps.values()) - sum(steps0.values())
            runs.append({"tok_s": sum(len(r.output_ids) for r in reqs) / seconds,
                         "ttft_p50_ms": 1000 * pct(ttft, 0.5), "steps_s": steps / seconds,
                         "extend_steps": eng.mode_steps.get("extend", 0) - steps0.get("extend", 0),
                         "accept_mean": sum(accepts) / len(accepts) if accepts else None,
                         # The same phases as the server's, to tell a slower step from
                         # a slower loop around it.
                         "step_ms": {k: 1000 * (eng.seconds[k] - secs0.get(k, 0.0)) / max(1, steps)
                                     for k in ("schedule", "execute", "process")}})
        out[c] = median_run(runs)
        print(f"in-process batch {c}, {sampling or 'greedy'}: {out[c]['tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    return out


def c_label(lv: dict) -> str:
    words = lv.get("prompt_words")
    return f"{lv['concurrency']} ({words}-word prompts)" if words else str(lv["concurrency"])


def table(name: str, levels: list[dict]) -> str:
    head = ("| server | c | tok/s | busy tok/s | in-process tok/s | HTTP / in-process | TTFT p50 / p99 / mean ms | "
            "server TTFT mean ms | TPOT ms | chunk gap p50 / p99 ms | steps/s | per step ms: schedule, "
            "process, execute, recv, compile | GC s | wait / GPU idle ms per pipelined step | in-process per step ms: "
            "schedule, execute, process |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    def num(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for lv in levels:
        ip = lv.get("in_process") or {}
        sv = lv.get("server") or {}
        ratio = lv["tok_s"] / ip["tok_s"] if ip.get("tok_s") else None
        st = sv.get("step_ms") or {}
        phases = ", ".join(f"{st[p]:.2f}" for p in ("schedule", "process", "execute", "recv", "compile")) if st else "-"
        ist = ip.get("step_ms") or {}
        ip_phases = ", ".join(f"{ist[p]:.2f}" for p in ("schedule", "execute", "process")) if ist else "-"
        lines.append(
            f"| {name} | {c_label(lv)} | {lv['tok_s']:.0f} | {num(lv.get('busy_tok_s'), '.0f')} | "
            f"{num(ip.get('tok_s'), '.0f')} | "
            f"{num(ratio, '.2f')} | {lv['ttft_p50_ms']:.0f} / {lv['ttft_p99_ms']:.0f} / {lv['ttft_mean_ms']:.0f} | "
            f"{num(sv.get('server_ttft_mean_ms'), '.0f')} | {lv['tpot_ms']:.2f} | "
            f"{lv['gap_p50_ms']:.1f} / {lv['gap_p99_ms']:.1f} | {num(sv.get('steps_s'), '.0f')} | "
            f"{phases} | {num(sv.get('gc_s'), '.3f')} | {num(sv.get('wait_ms_per_pipelined_step'), '.3f')} / "
            f"{num(sv.get('gpu_idle_ms_per_pipelined_step'), '.3f')} | {ip_phases} |")
    return "\n".join(lines)


def cpu_model() -> str:
    """The host CPU's model name: a plain server at hundreds of streams is bound by its
    step loop, which machines of one GPU kind have run at different speeds
    (docs/benchmarks.md)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _open_sweep(args, url: str, name: str, sampling: dict | None, out: Path) -> list[dict]:
    """The open-loop runs, one per --request-rate, the JSON rewritten after each."""
    answer_tokens = tuple(args.answer_tokens)
    requests = requests_for(resolve_mix(args.mix, args.seed, answer_tokens), args.num_requests, args.seed)
    meta = {"name": name, "mode": "open-loop", "config": args.config, "overrides": args.set, "url": args.url,
            "cpus": os.cpu_count(), "cpu_model": cpu_model(), "sampling": sampling, "mix": args.mix,
            "answer_tokens": answer_tokens if args.mix == "mt-bench" else None,
            "num_requests": args.num_requests, "seed": args.seed, "burstiness": open_loop.rate_label(args.burstiness),
            "burst": args.burst, "slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms,
            "client_processes": args.client_processes}
    rates: list[dict] = []
    for rate in args.request_rate:
        offsets = arrival_offsets(len(requests), rate, args.burstiness, args.burst, args.seed)
        lv = {"request_rate": open_loop.rate_label(rate), **asyncio.run(open_loop.run_rate(
            url, args.model, requests, offsets, args.client_processes, sampling,
            args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000))}
        rates.append(lv)
        print(f"{name} rate {lv['request_rate']}: {lv['req_s']:.2f} req/s, {lv['tok_s']:.0f} tok/s, goodput "
              f"{lv['goodput_req_s']:.2f} req/s ({lv['slo_met_share']:.0%}), {lv['failed']} failed "
              f"{lv['errors'][:1]}", file=sys.stderr, flush=True)
        (out / f"http_open_loop_{name}.json").write_text(json.dumps({**meta, "rates": rates}, indent=1))
    return rates


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="preset for the server and the in-process engine")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="closed levels (default 1 8 32 64)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--c1-prompts", type=int, default=10, help="prompts run one by one at concurrency 1")
    ap.add_argument("--prompt-words", type=int, default=0, metavar="W",
                    help="lengthen each prompt to at least W words with the questions after it "
                         "(no two prompts share a prefix): about 1.3 W tokens")
    ap.add_argument("--long-prompt-words", type=int, default=0, metavar="W",
                    help="after the levels, --c1-prompts prompts of W words one at a time "
                         "(the long-context run; its level carries prompt_words)")
    ap.add_argument("--url", default=None, help="a running OpenAI-compatible server (no in-process run)")
    ap.add_argument("--name", default=None, help="the server's name in the table and the JSON")
    ap.add_argument("--model", default=MODEL, help="the model name sent with --url")
    ap.add_argument("--tiny-model", action="store_true", help="CPU control-plane benchmark")
    ap.add_argument("--no-in-process", action="store_true")
    ap.add_argument("--repeats", type=int, default=1,
                    help="runs per level, HTTP and in-process alike; the median (by tok/s) is reported")
    ap.add_argument("--rounds", type=int, default=1,
                    help="requests each stream of a closed level sends one after another (c > 1)")
    ap.add_argument("--streams-per-client", type=int, default=16,
                    help="streams per client process (more streams: more processes)")
    ap.add_argument("--sampling", default=None, metavar="JSON",
                    help='sampling fields for every request, over HTTP and in-process, e.g. '
                         '\'{"temperature": 0.7, "top_p": 0.9}\' (default: greedy)')
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=JSON",
                    help="more sampling fields (over --sampling's) for a run of their own against the "
                         "same server, e.g. 'grammar={\"structured_outputs\": {\"regex\": \".*\"}}'; "
                         "several interleave run by run, so they share the machine's state; "
                         "`none={}` runs --sampling alone. Named <name>-<NAME> in the table and the JSON")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    op = ap.add_argument_group("open loop")
    op.add_argument("--request-rate", type=float, nargs="+", default=None, metavar="R",
                    help="requests per second, one run per rate (inf: all at once); open loop instead of levels")
    op.add_argument("--num-requests", type=int, default=200, help="requests per rate")
    op.add_argument("--seed", type=int, default=0, help="arrivals, the requests' order, the named mix's lengths")
    op.add_argument("--burstiness", type=float, default=1.0,
                    help="gamma shape of the gaps between arrivals: 1 Poisson, < 1 burstier, inf even")
    op.add_argument("--burst", type=int, default=1, metavar="N", help="requests that arrive together")
    op.add_argument("--mix", default="mt-bench", help="mt-bench, or a JSONL file of requests")
    op.add_argument("--answer-tokens", type=int, nargs=2, default=[64, 512], metavar=("MIN", "MAX"),
                    help="the mt-bench mix's max_tokens, uniform in [MIN, MAX]")
    op.add_argument("--slo-ttft-ms", type=float, default=500.0)
    op.add_argument("--slo-tpot-ms", type=float, default=50.0)
    op.add_argument("--client-processes", type=int, default=1,
                    help="client processes the requests are dealt over (see send lag)")
    args = ap.parse_args(argv)
    if args.request_rate is not None:
        for flag, given in (("--variant", args.variant),):
            if given:
                ap.error(f"{flag} is for the closed levels, not with --request-rate")
        if min(args.request_rate) <= 0 or args.burstiness <= 0 or args.burst < 1 or args.num_requests < 1:
            ap.error("want rates > 0, --burstiness > 0, --burst >= 1, --num-requests >= 1")
    # With --request-rate, levels run only when asked for (first, against the same server).
    args.concurrency = args.concurrency or ([] if args.request_rate is not None else [1, 8, 32, 64])
    sampling = json.loads(args.sampling) if args.sampling else None
    variants = [("", sampling)]
    if args.variant:
        variants = [(f"-{v.split('=', 1)[0]}", {**(sampling or {}), **json.loads(v.split("=", 1)[1])} or None)
                    for v in args.variant]
    overrides = list(args.set)
    if args.tiny_model:
        overrides = TINY + [f"model.path={make_tiny_model(tempfile.mkdtemp(prefix='kestrel-tiny-'))}"] + overrides
    name = args.name or ("kestrel-tiny" if args.tiny_model else "kestrel")
    qs = load_questions(Path(DATA), 80)
    # More streams than MT-bench has questions go round it again.
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    questions = [qs[i % len(qs)] for i in range(max(max(args.concurrency, default=1) * args.rounds, args.c1_prompts))]
    if args.prompt_words:
        questions = [long_prompt(qs, i, args.prompt_words) for i in range(len(questions))]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"config": args.config, "overrides": args.set, "url": args.url, "prompt_words": args.prompt_words,
            "max_tokens": args.max_tokens, "c1_prompts": args.c1_prompts, "cpus": os.cpu_count(),
            "cpu_model": cpu_model(), "repeats": args.repeats, "rounds": args.rounds, "streams_per_client": args.streams_per_client}
    levels: dict[str, list[dict]] = {suffix: [] for suffix, _ in variants}

    def save() -> None:  # after every level: a run stopped at its time limit keeps its figures
        for suffix, samp in variants:
            (out / f"http_bench_{name}{suffix}.json").write_text(json.dumps(
                {"name": name + suffix, **meta, "sampling": samp, "levels": levels[suffix]}, indent=1))

    # A `timeout` (SIGTERM) stops the server too: it runs in its own session and would
    # otherwise outlive this process.
    signal.signal(signal.SIGTERM, _interrupt)
    proc = log = None
    url = args.url
    if url is None:
        proc, url, log = start_server(args.config, overrides)
        print(f"kestrel serve on {url} (log: {log}) ...", file=sys.stderr, flush=True)
    try:
        asyncio.run(wait_ready(url, proc))
        for c in args.concurrency:
            runs: dict[str, list[dict]] = {suffix: [] for suffix, _ in variants}
            for _ in range(args.repeats):
                for suffix, samp in variants:
                    runs[suffix].append(asyncio.run(run_level(
                        url, args.model, questions, c, args.max_tokens, args.c1_prompts,
                        args.streams_per_client, samp, args.rounds)))
            for suffix, _ in variants:
                lv = median_run(runs[suffix])
                levels[suffix].append(lv)
                print(f"{name}{suffix} c={c}: {lv['tok_s']:.1f} tok/s, TTFT p50 {lv['ttft_p50_ms']:.1f} ms, "
                      f"server {lv['server']}", file=sys.stderr, flush=True)
            save()
        if args.long_prompt_words:
            long_qs = [long_prompt(qs, i, args.long_prompt_words) for i in range(args.c1_prompts + 1)]
            # Warmed with a long prompt that is not measured: warmed with the first measured
            # one, that one would be a prefix-cache hit, its first token ~15x sooner than
            # the others', and the level's TTFT mean far below its p50.
            lv = asyncio.run(run_level(url, args.model, long_qs[:-1], 1, args.max_tokens, args.c1_prompts,
                                       args.streams_per_client, sampling, warmup=long_qs[-1:]))
            levels[""].append({**lv, "prompt_words": args.long_prompt_words})
            print(f"{name} {args.long_prompt_words}-word prompts: {lv['tok_s']:.1f} tok/s, TTFT p50 "
                  f"{lv['ttft_p50_ms']:.1f} ms", file=sys.stderr, flush=True)
            save()
        if args.request_rate is not None:
            open_rates = _open_sweep(args, url, name, sampling, out)
    except BaseException:
        if log is not None:  # what the server said, for the failure's cause
            print("".join(log.read_text(errors="replace").splitlines(True)[-60:]), file=sys.stderr)
        raise
    finally:
        if proc is not None:
            stop_server(proc)
            shutil.copy(log, out / f"server_{name}.log")  # compile warnings, step errors
    if args.request_rate is not None:
        if args.concurrency:
            print(f"\n{name}: {args.max_tokens} new tokens, {sampling or 'greedy'}, streamed chat\n")
            print(table(name, levels[""]))
        print(f"\n{name}: open loop, {args.num_requests} requests a rate, mix {args.mix}, "
              f"burstiness {args.burstiness}, burst {args.burst}, seed {args.seed}, SLO TTFT <= "
              f"{args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms, {sampling or 'greedy'}\n")
        print(open_loop.table(name, open_rates))
        return
    if args.url is None and not args.no_in_process:
        ips = in_process(args.config, overrides, questions, args.concurrency, args.max_tokens,
                         args.c1_prompts, args.repeats, [samp for _, samp in variants], args.rounds)
        for (suffix, _), ip in zip(variants, ips):
            for lv in levels[suffix]:
                lv["in_process"] = ip[lv["concurrency"]]
        save()
    for suffix, samp in variants:
        print(f"\n{name}{suffix}: {os.cpu_count()} cpus ({cpu_model()}), {args.max_tokens} new tokens, "
              f"{samp or 'greedy'}, "
              "streamed chat\n")
        print(table(name + suffix, levels[suffix]))


if __name__ == "__main__":
    main()
