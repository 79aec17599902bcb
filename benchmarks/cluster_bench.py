"""Kestrel on a Ray cluster of 1, 2, 3 worker nodes under one open-loop schedule, and a
timeline through the loss of a node.

    python -m benchmarks.cluster_bench [--nodes 1 2 3] [--rate 6] [--seconds 30] \
        [--max-tokens 64] [--loss-seconds 60] [--loss-rate R] [--out FILE.json] \
        [--plot docs/cluster_node_loss.png] [--model PATH] [--set k=v ...]

The cluster is `ray.cluster_utils.Cluster` on this machine (as tests/integration/
test_serve_cluster.py builds it): a head node with HAProxy, and worker nodes of 3 CPUs and
one `kestrel_node` each, the resource every replica asks for (serve.replica_resources), so
N worker nodes hold N replicas, one each. On one machine the nodes share its cores: the
ratio between node counts says what the cluster adds over HAProxy and Serve, not what
more hardware would give.

1. For each node count: the app at that many replicas, then the same open-loop schedule
   (Poisson arrivals at --rate for --seconds, streamed completions of --max-tokens tokens,
   one client process): output tok/s, completed req/s, TTFT p50 / p99, failures.
2. Node loss: 3 worker nodes, 2 replicas (one node spare); at a third of --loss-seconds
   the node of one replica is removed (its processes killed, as a machine that goes away).
   Each request's send time, TTFT or failure, when the node went and when Serve's
   replacement ran, to the JSON and the plot.

The model is the tiny random one by default (benchmarks/http_bench.py's TINY settings), as
the tests use; --model serves another. Needs matplotlib for --plot.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODE_RESOURCE = "kestrel_node"
APP = "bench"


def _prompts(n: int) -> list[dict]:
    from kestrel_testing import mt_bench_first_turns
    questions = mt_bench_first_turns(80)
    return [{"prompt": questions[i % len(questions)]} for i in range(n)]


def _replica_states() -> dict[str, int]:
    from ray import serve
    status = serve.status().applications.get(APP)
    if status is None or "EngineDeployment" not in status.deployments:
        return {}
    return {str(k): v for k, v in status.deployments["EngineDeployment"].replica_states.items()}


def _deploy(overrides: list[str], replicas: int) -> float:
    from ray import serve

    from configs.schema import load_config
    from serve_app.app import build_app
    cfg = load_config(overrides=overrides + [
        f"serve.replica_resources={{{NODE_RESOURCE}: 1}}",
        f"serve.engine_autoscaling.min_replicas={replicas}",
        f"serve.engine_autoscaling.max_replicas={replicas}"])
    t0 = time.monotonic()
    serve.run(build_app(cfg, engine_options={"health_check_period_s": 1.0}), name=APP, route_prefix="/")
    return time.monotonic() - t0


async def _open_loop(url: str, model: str, rate: float, seconds: float, max_tokens: int, seed: int):
    """The schedule's rows in send order (one client process) and the wall-clock start."""
    from benchmarks.arrivals import arrival_offsets
    from benchmarks.http_client import client_session, run_in_processes
    n = max(1, int(rate * seconds))
    offsets = arrival_offsets(n, rate, seed=seed)
    jobs = [(t, item, max_tokens) for t, item in zip(offsets, _prompts(n))]
    async with client_session(1) as session:
        rows, wall, _, _ = await run_in_processes(url, model, [jobs], session, None, warm=2,
                                                  keep_errors=True)
    for row, offset in zip(rows, offsets):
        row["offset"] = offset
    ok = next(r for r in rows if "error" not in r)
    start = ok["end"] - ok["e2e"] - ok["lag"] - ok["offset"]  # the schedule's wall-clock origin
    return rows, wall, start


def _summary(rows: list[dict], wall: float) -> dict:
    from benchmarks.http_client import pct
    ok = [r for r in rows if "error" not in r]
    ttft = [r["ttft"] for r in ok]
    return {"requests": len(rows), "failed": len(rows) - len(ok), "seconds": wall,
            "req_s": len(ok) / wall, "tok_s": sum(r["tokens"] for r in ok) / wall,
            "ttft_p50_ms": 1000 * pct(ttft, 0.5), "ttft_p99_ms": 1000 * pct(ttft, 0.99),
            "errors": sorted({r["error"] for r in rows if "error" in r})[:5]}


def node_loss(cluster, nodes: dict, url: str, model: str, args) -> dict:
    """2 replicas on 3 nodes; one replica's node removed at a third of the run."""
    from ray import serve
    engine = serve.get_deployment_handle("EngineDeployment", app_name=APP)
    victim = engine.stats.remote().result(timeout_s=30)["node"]
    events: dict[str, float] = {}

    def lose_node(at: float):
        time.sleep(max(0.0, at - time.time()))
        events["lost"] = time.time()
        cluster.remove_node(nodes.pop(victim), allow_graceful=False)
        while _replica_states() == {"RUNNING": 2}:  # until Serve sees the replica gone
            time.sleep(0.2)
        events["noticed"] = time.time()
        while _replica_states() != {"RUNNING": 2}:
            time.sleep(0.2)
        events["replaced"] = time.time()

    # The client processes start the schedule a moment after they are ready: the loss is
    # placed from this estimate and reported against the schedule's real start.
    loser = threading.Thread(target=lose_node, args=(time.time() + 5 + args.loss_seconds / 3,), daemon=True)
    loser.start()
    rows, wall, start = asyncio.run(_open_loop(url, model, args.loss_rate or args.rate, args.loss_seconds,
                                               args.max_tokens, 1))
    loser.join(timeout=300)
    timeline = [{"sent_s": r["offset"] + r["lag"], "ttft_ms": None if "error" in r else 1000 * r["ttft"],
                 "e2e_s": r.get("e2e"), "error": r.get("error")} for r in rows]
    lost_s = events["lost"] - start
    after = [t for t in timeline if t["sent_s"] > lost_s]
    first_ok = min((t["sent_s"] + t["e2e_s"] for t in after if t["error"] is None), default=None)
    return {**_summary(rows, wall), "rate": args.loss_rate or args.rate, "lost_s": lost_s,
            "noticed_s": events.get("noticed", float("nan")) - start,
            "replaced_s": events.get("replaced", float("nan")) - start,
            "in_flight_at_loss": sum(1 for t in timeline
                                     if t["sent_s"] <= lost_s <= t["sent_s"] + (t["e2e_s"] or 1e9)),
            "failed_sent_after_loss": sum(1 for t in after if t["error"]),
            "first_answer_after_loss_s": None if first_ok is None else first_ok - lost_s,
            "timeline": timeline}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    loss = result["node_loss"]
    tl = loss["timeline"]
    fig, ax = plt.subplots(figsize=(9, 4.2))
    ok = [t for t in tl if t["error"] is None]
    bad = [t for t in tl if t["error"]]
    ax.scatter([t["sent_s"] for t in ok], [t["ttft_ms"] for t in ok], s=10, label="TTFT of an answered request")
    top = max([t["ttft_ms"] for t in ok] or [1.0]) * 1.1
    ax.scatter([t["sent_s"] for t in bad], [top] * len(bad), marker="x", color="red", s=30,
               label=f"failed ({len(bad)})")
    ax.axvline(loss["lost_s"], color="black", linestyle="--", label="worker node removed")
    ax.axvline(loss["replaced_s"], color="green", linestyle=":", label="replacement replica running")
    ax.set_xlabel("request sent at (s)")
    ax.set_ylabel("TTFT (ms)")
    ax.axvline(loss["noticed_s"], color="orange", linestyle="-.", label="Serve sees the replica gone")
    ax.set_title(f"Kestrel, 2 replicas on 3 worker nodes, {loss['rate']:g} req/s open loop: a node lost "
                 f"({result['machine']})", fontsize=9)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nodes", type=int, nargs="*", default=[1, 2, 3])
    ap.add_argument("--rate", type=float, default=6.0, help="requests per second (Poisson)")
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--loss-seconds", type=float, default=60.0, help="the node-loss run; 0 skips it")
    ap.add_argument("--loss-rate", type=float, default=None, help="its rate (default: --rate)")
    ap.add_argument("--model", default=None, help="model.path (default: the tiny random model)")
    ap.add_argument("--set", action="append", default=[])
    ap.add_argument("--machine", default="2-core CPU dev machine")
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))  # kestrel_testing: the MT-bench questions

    from benchmarks.http_bench import TINY, _free_port, make_tiny_model
    from configs.schema import load_config
    from serve_app.app import local_ray_env
    model = args.model or make_tiny_model(tempfile.mkdtemp(prefix="kestrel-tiny-"))
    overrides = TINY + [f"model.path={model}"] + args.set
    cfg = load_config(overrides=overrides)
    os.environ.update(local_ray_env(cfg))
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    ray.init(address=cluster.address, log_to_driver=False,
             runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
    port = _free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    nodes: dict[str, object] = {}

    def add_node():
        node = cluster.add_node(num_cpus=3, resources={NODE_RESOURCE: 1})
        cluster.wait_for_nodes()
        nodes[node.node_id] = node

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    result = {"date": datetime.date.today().isoformat(), "commit": commit, "machine": args.machine,
              "command": "python -m benchmarks.cluster_bench " + " ".join(argv or sys.argv[1:]),
              "rate": args.rate, "seconds": args.seconds, "max_tokens": args.max_tokens,
              "model": "tiny random (1 layer, hidden 32)" if not args.model else args.model,
              "nodes": {}}
    try:
        for n in args.nodes:
            while len(nodes) < n:
                add_node()
            up = _deploy(overrides, n)
            rows, wall, _ = asyncio.run(_open_loop(url, cfg.model.name, args.rate, args.seconds, args.max_tokens, 0))
            result["nodes"][n] = {**_summary(rows, wall), "deploy_s": up}
            s = result["nodes"][n]
            print(f"{n} worker node(s): {s['tok_s']:.0f} tok/s, {s['req_s']:.2f} req/s, TTFT p50/p99 "
                  f"{s['ttft_p50_ms']:.0f}/{s['ttft_p99_ms']:.0f} ms, {s['failed']} failed", flush=True)
            serve.delete(APP)
        if args.loss_seconds > 0:
            while len(nodes) < 3:
                add_node()
            _deploy(overrides, 2)
            loss = node_loss(cluster, nodes, url, cfg.model.name, args)
            result["node_loss"] = loss
            print(f"node loss: {loss['requests']} requests, {loss['failed']} failed "
                  f"({loss['in_flight_at_loss']} in flight at the loss, {loss['failed_sent_after_loss']} "
                  f"failed of those sent after it); Serve saw it {loss['noticed_s'] - loss['lost_s']:.1f}s and "
                  f"ran a replacement {loss['replaced_s'] - loss['lost_s']:.1f}s after the loss", flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.plot and "node_loss" in result:
        plot(result, args.plot)


if __name__ == "__main__":
    main()
