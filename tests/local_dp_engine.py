"""The Serve engine under parallel.dp_attention, without Ray: one process per rank
running a LockstepWorker behind a StepServer (as a RankActor does), the ranks joined over
gloo; in the calling process an EngineCore and an EngineClient over real sockets.

A test may pass `hook`, a module-level function run first in every rank process with the
rank: it can patch the rank's code (an int32 producer, a broken protocol) and return a
callable whose value comes back from `stop()` (what the rank recorded)."""
from __future__ import annotations

import asyncio
import multiprocessing
import os
import time

WAIT_S = 120.0  # for the ranks to load and join (spawned interpreters import torch first)


def _rank_main(rank: int, cfg_json: dict, port: int, conn, hook) -> None:
    import torch

    from actors.dp.lockstep_worker import LockstepWorker
    from actors.worker.step_channel import StepServer
    from configs.schema import KestrelConfig
    report = hook(rank) if hook is not None else None
    worker = LockstepWorker(KestrelConfig.model_validate(cfg_json), rank)
    worker.join("127.0.0.1", port)
    # The channel thread runs the steps: on the GPU this process loaded on (as a RankActor).
    index = torch.cuda.current_device() if worker.device.type == "cuda" else None
    server = StepServer(worker, on_start=None if index is None else lambda: torch.cuda.set_device(index))
    conn.send((server.address, server.token, worker.info(), os.getpid()))
    conn.recv()  # "stop": the engine closed its channel; the steps queued still run
    deadline = time.monotonic() + 60
    while server.serving and time.monotonic() < deadline:
        time.sleep(0.01)
    conn.send(report() if report is not None else None)
    os._exit(0)  # no interpreter teardown: the channel thread may still be in a torch op


class LocalDPEngine:
    def __init__(self, client, core, procs, conns, infos):
        self.client, self.core, self.procs, self.conns, self.infos = client, core, procs, conns, infos

    @classmethod
    async def start(cls, cfg, tokenizer=None, hook=None, info_overrides=None,
                    wait_s: float = WAIT_S) -> "LocalDPEngine":
        """`info_overrides`: per rank, entries laid over what the rank reports (fewer KV
        slots for one rank, say). `wait_s`: for the ranks to load, join and capture."""
        from actors.dp.group import find_free_port
        from serve_app.engine.engine_client import EngineClient
        from serve_app.engine.engine_core import EngineCore
        from serve_app.engine.rank_channel import RankChannel
        from serve_app.text.tokenizer import stop_token_ids
        W = cfg.parallel.dp_size
        # Fresh interpreters (no torch threads to fork), forked from one that imported the
        # rank's modules once: a spawned rank spent ~3 s of a 2-core CPU importing torch.
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["local_dp_engine", "actors.dp.lockstep_worker",
                                    "actors.worker.step_channel", "configs.schema"])
        port = find_free_port()
        procs, conns = [], []
        for rank in range(W):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_rank_main, args=(rank, cfg.model_dump(mode="json"), port, child, hook),
                            daemon=True, name=f"kestrel-dp-rank{rank}")
            p.start()
            procs.append(p)
            conns.append(parent)
        ready = []
        for rank, conn in enumerate(conns):
            if not await asyncio.to_thread(conn.poll, wait_s):
                cls._kill(procs)
                raise TimeoutError(f"rank {rank} did not start within {wait_s:.0f}s")
            ready.append(conn.recv())
        infos = [{**info, **((info_overrides or {}).get(r, {}))} for r, (_, _, info, _) in enumerate(ready)]
        channels = [await RankChannel.connect(*addr, token, r) for r, (addr, token, _, _) in enumerate(ready)]
        eos = sorted(stop_token_ids(tokenizer, infos[0]["eos_token_ids"]))
        core = EngineCore(cfg, infos, channels, eos)
        host, cport = await core.listen("127.0.0.1")
        client = await EngineClient.connect(cfg, W, host, cport, core.token, tokenizer)
        return cls(client, core, procs, conns, infos)

    async def run(self, prompts, params: list[dict], rids=None) -> list:
        """Each prompt's outputs, collected: its token ids and its last output."""
        rids = rids or [f"r{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        streams = [self.client.add_request(p, sp, rid) for p, sp, rid in zip(prompts, params, rids)]
        return await asyncio.gather(*(collect(s) for s in streams))

    async def stats(self) -> list[dict]:
        return await self.client.rank_stats()

    async def stop(self) -> list:
        """Close the channels; each rank's report (what its hook recorded)."""
        self.client.stop()
        self.core.stop()
        reports = []
        for conn in self.conns:  # all first: a report may hold a collective of every rank
            try:
                conn.send("stop")
            except (BrokenPipeError, ConnectionError):
                pass  # the rank is gone (a test killed it)
        for conn in self.conns:
            try:
                reports.append(conn.recv() if await asyncio.to_thread(conn.poll, 30) else None)
            except (EOFError, ConnectionError):
                reports.append(None)
        self._kill(self.procs)
        return reports

    @staticmethod
    def _kill(procs) -> None:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


async def collect(stream):
    outs = [out async for out in stream]
    return [t for o in outs for t in o.new_token_ids], outs[-1]
