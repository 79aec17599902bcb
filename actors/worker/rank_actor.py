"""RankActor: a RankWorker as a Ray actor (one per GPU / DP rank of an Engine replica).

A thin wrapper: the Engine deployment creates one per bundle of its placement group.
Steps do not travel as Ray calls: the actor serves them on its step channel
(actors/worker/step_channel.py), a socket the engine connects to with the address and token
`info()` returns. Ray calls (`info`, `ping`) run on the actor's own thread, beside the
channel's, so a health check is answered even while a long step runs. Under
parallel.dp_attention the worker is a LockstepWorker, and the deployment joins the ranks
into one group (`dp_address` on rank 0, then `join_dp` on every rank at once).
"""
from __future__ import annotations

import logging
from typing import Any

import ray
import torch

from actors.worker import gc_pauses
from actors.dp.group import find_free_port
from actors.dp.lockstep_worker import LockstepWorker
from actors.worker.rank_worker import RankWorker
from actors.worker.step_channel import StepServer
from configs.schema import KestrelConfig


@ray.remote
class RankActor:
    def __init__(self, cfg: dict[str, Any] | KestrelConfig, rank: int, engine_ip: str | None = None):
        """`engine_ip`: the node of the engine that will connect; on that node the
        channel listens on loopback only."""
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
        if not isinstance(cfg, KestrelConfig):
            cfg = KestrelConfig.model_validate(cfg)
        self.worker = LockstepWorker(cfg, rank) if cfg.parallel.dp_attention else RankWorker(cfg, rank)
        ip = ray.util.get_node_ip_address()
        host = "127.0.0.1" if engine_ip in (None, ip) else ip
        # The channel thread runs the steps: it must use the device this thread loaded on.
        index = torch.cuda.current_device() if self.worker.device.type == "cuda" else None
        bind = (lambda: torch.cuda.set_device(index)) if index is not None else None
        self.channel = StepServer(self.worker, host, on_start=bind)
        gc_pauses.serving(f"rank {rank}", cfg.serve.gc_freeze)

    def info(self) -> dict:
        host, port = self.channel.address
        return {**self.worker.info(), "channel": {"host": host, "port": port,
                                                  "token": self.channel.token}}

    def ping(self) -> int:
        return self.worker.rank

    def set_grammar_vocab(self, vocab_json: str) -> None:
        """Start-up, before the engine core connects: the grammar vocabulary, so the first
        request with a grammar does not wait for it (the step thread is not running yet)."""
        self.worker.grammars.set_vocab(vocab_json)

    def grammar_vocab_size(self) -> int:
        info = self.worker.grammars.info
        return 0 if info is None else info.vocab_size

    def gc_stats(self) -> dict[str, int]:
        return gc_pauses.stats()

    def dp_address(self) -> tuple[str, int]:
        """Rank 0: where the group meets (this node, a free port)."""
        ip = ray.util.get_node_ip_address()
        return ip, find_free_port(ip)

    def join_dp(self, master_addr: str, master_port: int) -> None:
        self.worker.join(master_addr, master_port)
