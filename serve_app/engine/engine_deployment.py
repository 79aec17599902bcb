"""The Engine deployment: one replica = one engine = one DP group of RankActors, and the
replica serves the OpenAI HTTP API itself.

Each replica starts an engine core (serve_app/engine/engine_core.py: the schedulers and step
loops, a Ray actor beside it in bundle 0 of its placement group) and its RankActors
(bundle 1+rank), which the core drives over their step channels. The replica itself is
the front end: the FastAPI app of OpenAIServer and an EngineClient on one event loop,
which sends requests to the core and spreads each step's outputs over the requests'
streams. HTTP reaches the replica through Serve: with serve.http_proxy=haproxy, HAProxy
forwards each connection straight to the replica's own HTTP server (Serve's direct
ingress); with `serve`, Serve's Python proxy relays it (one Ray hop per SSE chunk).
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray
from ray import serve
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.worker import gc_pauses
from actors.worker.rank_actor import RankActor
from configs.schema import KestrelConfig
from serve_app.engine.engine_client import EngineClient
from serve_app.engine.engine_core import EngineCoreActor
from serve_app.engine.model_files import local_model
from serve_app.api.metrics import EngineGauges
from serve_app.api.openai_server import OpenAIServer, build_api
from serve_app.text.tokenizer import stop_token_ids

log = logging.getLogger("kestrel.engine")

DRAIN_TIMEOUT_S = 30.0  # how long shutdown waits for running requests before aborting them
PING_TIMEOUT_S = 20.0  # below Serve's health_check_timeout_s (30 s by default)
GAUGE_PERIOD_S = 2.0


def _replica_id() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (direct construction in tests)
        return "local"


def _http_path() -> str:
    """How HTTP reaches this replica: 'direct' (its own server, behind HAProxy) or
    'proxy' (Serve's proxy relays it)."""
    try:
        from ray.serve._private import constants
        return "direct" if constants.RAY_SERVE_ENABLE_DIRECT_INGRESS else "proxy"
    except (ImportError, AttributeError):  # a Ray without direct ingress
        return "proxy"


@serve.deployment(
    name="EngineDeployment",
    # build_app adds placement_group_bundles (bundle 0 this replica, 1+rank each
    # RankActor) and the STRICT_PACK strategy, both of which depend on the config.
    ray_actor_options={"num_cpus": 1},
    # Streams are long-lived: let a draining replica finish them (see __del__ as well).
    graceful_shutdown_wait_loop_s=1.0,
    graceful_shutdown_timeout_s=DRAIN_TIMEOUT_S + 30.0,
    health_check_period_s=10.0,
    health_check_timeout_s=30.0,
)
@serve.ingress()
class EngineDeployment:
    async def __init__(self, cfg: dict[str, Any]):
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        cfg_obj = KestrelConfig.model_validate(cfg)
        self._shutdown_started = False
        self._replica = _replica_id()
        self._node = ray.get_runtime_context().get_node_id()
        # Before any actor starts: a URI model.path is fetched to this node, and a node
        # without the model fails this replica now, by name. The actors (on this node: the
        # placement group is STRICT_PACK) get the local path.
        cfg_obj, model_path = await asyncio.to_thread(
            local_model, cfg_obj, f"{ray.util.get_node_ip_address()} ({self._node})")
        cfg = cfg_obj.model_dump(mode="json")
        dp = cfg_obj.parallel.dp_size
        gpu = cfg_obj.resolved_device() == "cuda"
        pg = ray.util.get_current_placement_group()

        def in_bundle(index: int) -> dict[str, Any]:
            if pg is None or pg.bundle_count <= index:
                return {}
            return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=index)}

        # Named for operators (and the fault tests): ray.get_actor(name, namespace="kestrel").
        name = f"kestrel-{self._replica}"
        self.core = EngineCoreActor.options(name=f"{name}-core", namespace="kestrel", num_cpus=1,
                                            **in_bundle(0)).remote(cfg)
        # A rank's step channel listens on loopback where the core shares its node. Under
        # the STRICT_PACK group that node is this replica's, known now, so the ranks start
        # beside the core rather than after it (a process start and its imports sooner).
        if pg is not None and ray.util.placement_group_table(pg).get("strategy") == "STRICT_PACK":
            core_ip = ray.util.get_node_ip_address()
        else:
            core_ip = await self.core.node_ip.remote()
        self.actors = []
        for rank in range(dp):
            opts: dict[str, Any] = {"num_cpus": 0, "num_gpus": 1} if gpu else {"num_cpus": 1}
            self.actors.append(RankActor.options(name=f"{name}-rank{rank}", namespace="kestrel",
                                                 **opts, **in_bundle(1 + rank))
                               .remote(cfg, rank, core_ip))
        # Load the tokenizer, and xgrammar's view of it, while the actors load their models.
        from serve_app.text.grammar import compiler_for
        from serve_app.text.tokenizer import load_tokenizer

        def tokenizer_and_vocab():
            tok = load_tokenizer(model_path)
            return tok, compiler_for(tok).vocab_json

        infos, (tokenizer, vocab) = await asyncio.gather(
            asyncio.gather(*[a.info.remote() for a in self.actors]), asyncio.to_thread(tokenizer_and_vocab))
        # Each rank takes the grammar vocabulary now, not in the first grammar request's step.
        await asyncio.gather(*[a.set_grammar_vocab.remote(vocab) for a in self.actors])
        if cfg_obj.parallel.dp_attention:  # one group: rank 0 publishes where it meets
            addr, port = await self.actors[0].dp_address.remote()
            await asyncio.gather(*[a.join_dp.remote(addr, port) for a in self.actors])
        eos = sorted(stop_token_ids(tokenizer, infos[0]["eos_token_ids"]))
        front = await self.core.start.remote(infos, eos, ray.util.get_node_ip_address())
        self.engine = await EngineClient.connect(
            cfg_obj, dp, front["host"], front["port"], front["token"], tokenizer,
            ping=self._ping, replica=self._replica, vocab_at_ranks=True)
        self.server = OpenAIServer(cfg_obj, self.engine, tokenizer)
        self._gauges_task = asyncio.create_task(self._publish_gauges(cfg_obj.model.name))
        # What is alive now lives as long as the replica: keep the collector off it, so
        # its full passes do not pause the event loop walking a heap that never changes.
        gc_pauses.serving(f"replica {self._replica}", cfg_obj.serve.gc_freeze)
        log.info("engine replica %s ready: dp_size=%d, HTTP %s, placement group %s, %s",
                 self._replica, dp, _http_path(), pg.id.hex() if pg is not None else None,
                 {k: v for k, v in infos[0].items() if k != "channel"})

    def __serve_build_asgi_app__(self):
        return build_api(self.server)

    async def _ping(self) -> None:
        await asyncio.wait_for(asyncio.gather(self.core.check.remote(),
                                              *[a.ping.remote() for a in self.actors]),
                               timeout=PING_TIMEOUT_S)

    async def _publish_gauges(self, model_name: str) -> None:
        try:
            gauges = EngineGauges(model_name)
        except Exception:  # metrics are best effort
            log.warning("engine gauges unavailable", exc_info=True)
            return
        while True:
            try:
                gauges.update(await self.engine.stats())
            except Exception:
                log.debug("gauge update failed", exc_info=True)
            await asyncio.sleep(GAUGE_PERIOD_S)

    # ---- health and state, for Serve and for handle callers (tests, tools) --------------
    async def check_health(self) -> None:
        await self.engine.check_health()

    # `async`: the figures come from the engine core over the front channel.
    async def kv_stats(self) -> list[dict[str, int]]:
        return await self.engine.kv_stats()

    async def rank_stats(self) -> list[dict[str, Any]]:
        return await self.engine.rank_stats()

    async def gc_stats(self) -> dict[str, Any]:
        """The collector in each process of this replica (serve.gc_freeze): objects frozen
        out of its passes, and the full passes seen since start-up."""
        core, ranks = await asyncio.gather(self.core.gc_stats.remote(),
                                           asyncio.gather(*[a.gc_stats.remote() for a in self.actors]))
        return {"replica": gc_pauses.stats(), "core": core, "ranks": list(ranks)}

    async def num_running(self) -> int:
        """Requests this replica holds (queued, prefilling or decoding)."""
        return self.engine.num_requests()

    async def stats(self) -> dict[str, Any]:
        return {**(await self.engine.stats()), "http": _http_path(), "node": self._node}

    # ---- shutdown ------------------------------------------------------------------------
    async def __del__(self):
        # Serve awaits this on the replica's event loop during graceful shutdown, after it
        # has drained the replica's ongoing calls. It must be a coroutine function: the
        # ingress wrapper (serve.ingress) calls a plain __del__ without awaiting what it
        # returns, so a drain returned from one never ran.
        if getattr(self, "_shutdown_started", True):
            return
        self._shutdown_started = True
        await self._drain_and_stop()

    async def _drain_and_stop(self) -> None:
        if hasattr(self, "engine"):
            await self.engine.drain(DRAIN_TIMEOUT_S)  # new requests get 503: retry elsewhere
        self._stop()

    def _stop(self) -> None:
        if hasattr(self, "engine"):
            self.engine.stop()
        task = getattr(self, "_gauges_task", None)
        if task is not None:
            task.cancel()
        for a in [getattr(self, "core", None), *getattr(self, "actors", [])]:
            try:
                if a is not None:
                    ray.kill(a)
            except Exception:
                pass
