"""A RankWorker under parallel.dp_attention: its target sharded across the group
(actors/dp/sharded_layers.py) and every step run in lockstep with the other ranks.

Each plan, idle ones included, opens with the step's sync (one int64 row per rank,
actors/dp/sync.py). Every rank derives the same phases from the rows
(actors/dp/step_phases.py); the worker runs its plan, whose forwards take their phases
in order, and an empty batch through each phase its plan has no part in: a prefill
rank, for one, runs the S-1 draft-decode phases of a peer's speculative iteration
before its own prefill, an idle rank all of them. So every rank issues the same
collectives with the same padded shapes, whatever it has to do. With
attention.cuda_graphs, a step where every rank can replay a graph is replayed at one
size by all of them, idle ranks with every lane padded (actors/dp/group_graphs.py).
"""
from __future__ import annotations

import logging

import torch

from actors.dp.attention_group import DPAttentionGroup
from actors.dp.group_graphs import GroupGraphs
from actors.dp.sharded_layers import shard_model, weight_bytes
from actors.dp.step_phases import DRAFT_EXTEND, DraftShape, Phase
from actors.dp.sync import idle_sync_row, make_sync_row
from actors.worker.forward_batch import ForwardMode
from actors.worker.launched_step import LaunchedStep
from actors.worker.rank_worker import RankWorker
from actors.protocol.step_plan import StepOutput, StepPlan
from configs.schema import KestrelConfig

log = logging.getLogger("kestrel.worker")


def _no_attention(q, k, v, layer_id):
    """An empty batch's attention: no queries, nothing to attend to, no KV written."""
    return q


class LockstepWorker:
    def __init__(self, cfg: KestrelConfig, rank: int):
        self.cfg = cfg
        self.worker = RankWorker(cfg, rank)
        w, d = self.worker, cfg.draft
        draft = DraftShape(d.num_steps, d.topk, d.num_draft_tokens) if d.enabled else None
        self.dp = DPAttentionGroup(rank, cfg.parallel.dp_size, w.arch.num_layers, draft,
                                   cfg.parallel.dp_timeout_s)
        self.full_weight_bytes = self._weight_bytes()
        shard_model(w.model, self.dp)
        self.weight_bytes = self._weight_bytes()
        self.graphs: GroupGraphs | None = None  # capture_graphs() sets them
        log.info("rank %d: dp_attention over %d ranks: weights %.1f MiB (%.1f MiB whole)", rank,
                 cfg.parallel.dp_size, self.weight_bytes / 2**20, self.full_weight_bytes / 2**20)

    def _weight_bytes(self) -> int:
        w = self.worker
        return weight_bytes(w.model, *([w.eagle.head] if w.eagle is not None else []))

    # What a RankActor reads of its worker.
    @property
    def rank(self) -> int:
        return self.worker.rank

    @property
    def arch(self):
        return self.worker.arch

    @property
    def device(self) -> torch.device:
        return self.worker.device

    @property
    def grammars(self):
        return self.worker.grammars

    def join(self, master_addr: str, master_port: int | None) -> None:
        """Join the replica's group (every rank at once; rank 0 published the address),
        then capture the graphs, whose forwards hold the group's collectives."""
        self.dp.join(master_addr, master_port, device=self.worker.device)
        if self.cfg.attention.cuda_graphs:
            self.capture_graphs(self.worker.graph_batch_sizes())

    def capture_graphs(self, sizes: list[int], use_cuda_graph: bool | None = None) -> None:
        """Replay decode steps as graphs of `sizes` from now on, every rank at once; on CPU
        (use_cuda_graph None) the eager stand-in."""
        self.graphs = GroupGraphs(self.worker, self.dp)
        self.graphs.capture(sizes, use_cuda_graph)

    def info(self) -> dict:
        return {**self.worker.info(), "weight_bytes": self.weight_bytes,
                "full_weight_bytes": self.full_weight_bytes}

    # ---- one step -----------------------------------------------------------------------
    def sync_row(self, plan: StepPlan) -> torch.Tensor:
        """This rank's int64 row for the step (C03)."""
        if plan.mode == "idle" or not plan.rows:
            return idle_sync_row()
        B = len(plan.rows)
        graph = self.graphs is not None and self.graphs.can_run(plan)
        if plan.mode == "extend":
            return make_sync_row(len(plan.input_ids), B, graph, True, ForwardMode.EXTEND)
        if self.worker.eagle is not None and plan.use_spec:
            T = B * self.cfg.draft.num_draft_tokens
            return make_sync_row(T, T, graph, False, ForwardMode.TARGET_VERIFY)
        return make_sync_row(B, B, graph, False, ForwardMode.DECODE)

    # The step channel's StepRunner: every rank launches the same steps in the same order,
    # so the collectives inside `launch` pair; `finish` only waits for the tokens. A rank
    # with grammar rows waits inside `launch` for its step before (GrammarRows.settle),
    # whose collectives every rank issued before this step's: no rank waits on it.
    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        if plan.prompt_logprobs is not None:
            # Its extra LM-head calls would not line up with the peers' (the front end refuses it).
            raise ValueError("prompt_logprobs is not available with parallel.dp_attention")
        dp = self.dp
        dp.begin_step(self.sync_row(plan))
        if dp.graph is not None:  # every rank replays the graphs of one size
            step = self.worker.launch(plan)  # its forwards at that size (RankWorker.graph_size)
            if step.emitted is None:  # no work: every lane padded
                self.graphs.replay_idle(dp.graph)
        else:
            self._run_idle_phases()  # those before this rank's own (all, for an idle plan)
            step = self.worker.launch(plan)  # an idle plan applies what it carries, no forward
            self._run_idle_phases()  # any after them
        dp.end_step()
        return step

    def finish(self, step: LaunchedStep) -> StepOutput:
        return self.worker.finish(step)

    def on_steps_back(self, callback) -> None:
        """As RankWorker's: the channel answers the steps whose tokens a grammar step's
        masks have read from inside its launch. The answer only sends this rank's tokens
        to the engine core; it issues no collective, so the ranks stay paired."""
        self.worker.on_steps_back(callback)

    def _run_idle_phases(self) -> None:
        while self.dp.pending and self.dp.pending[0].own_tokens == 0:
            self._idle(self.dp.pending[0])

    def _idle(self, phase: Phase) -> None:
        """An empty batch through `phase`'s forward and LM head: only the collectives."""
        w = self.worker
        ids = torch.empty(0, dtype=torch.int64, device=w.device)  # [0] int64
        if phase.is_target:
            hidden, _ = w.model.forward(ids, ids, _no_attention)
            w.model.compute_logits(hidden)
            return
        eagle = w.eagle
        width = eagle.feature_size if phase.name == DRAFT_EXTEND else eagle.hidden_size
        h = eagle.head.forward(ids, ids, _no_attention,
                               torch.empty(0, width, dtype=w.dtype, device=w.device))  # [0, H]
        eagle.head.topk(h, self.cfg.draft.topk)
