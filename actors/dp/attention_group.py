"""One rank's side of dp_attention: its group, the current step's phases, the padded
collectives of the tensor-parallel layers (actors/dp/sharded_layers.py).

The step opens with one sync (:meth:`begin_step`, the int64 row of actors/dp/sync.py);
from the rows every rank derives the same phases (actors/dp/step_phases.py). Every model
forward starts with the embedding, which opens the next phase (:meth:`open_forward`);
the MLP layers and the LM head of that forward pad to its sizes. A rank whose forwards
do not match the phases (a protocol bug) gets an error here, and its peers one from the
group's timeout, rather than collectives that pair the wrong tensors.

With CUDA graphs (actors/dp/group_graphs.py) the step may be a graph step
(:attr:`graph`); a replayed graph takes the phases it holds (:meth:`replay_graph`).
While graphs are captured (:meth:`capturing`) there is no step: every rank records the
same padded batches in the same order, so each collective takes its forward's own size.
"""
from __future__ import annotations

import contextlib
import itertools
from collections import deque
from typing import Callable

import torch

from actors.dp.group import DPGroup
from actors.dp.step_phases import DraftShape, GraphStep, Phase, graph_step, step_phases
from actors.dp.sync import DPSyncResult, dp_sync, pad_int64


class DPAttentionGroup:
    def __init__(self, rank: int, world_size: int, num_target_layers: int,
                 draft: DraftShape | None, timeout_s: float):
        self.rank, self.world_size = rank, world_size
        self.num_target_layers = num_target_layers
        self.draft = draft
        self.timeout_s = timeout_s
        self.group: DPGroup | None = None  # join() sets it
        self.graph_sizes: list[int] | None = None  # the captured batch sizes, once captured
        self.graph: GraphStep | None = None  # the open step's graphs; None: it runs eagerly
        self._capturing = False
        self.pending: deque[Phase] = deque()  # the step's phases not opened yet
        self.phase: Phase | None = None  # the open one
        self._mlp_calls = 0  # in the open phase
        self._lm_head_calls = 0

    def join(self, master_addr: str, master_port: int | None, backend: str = "auto",
             device: torch.device | str | None = None) -> None:
        self.group = DPGroup.init(self.rank, self.world_size, master_addr, master_port, backend,
                                  device=device, timeout_s=self.timeout_s)

    # ---- the step -----------------------------------------------------------------------
    def begin_step(self, row: torch.Tensor) -> DPSyncResult:
        """The step's one sync: every rank's row, and from them the phases to run."""
        if self.pending or self.phase is not None:
            raise RuntimeError("dp_attention: a step began before the last one ended")
        sync = dp_sync(self.group, row)
        self.graph = graph_step(sync, self.graph_sizes, self.draft)
        self.pending = deque(step_phases(sync, self.rank, self.draft, self.graph))
        return sync

    def replay_graph(self, phases: list[Phase], replay: Callable[[], None],
                     runs_python: bool) -> None:
        """Replay a captured graph that holds `phases`: they must be the step's next ones
        (the same on every rank in a graph step), or its captured collectives would pair
        with other sizes on the peers. A CUDA graph runs its forwards without Python, so
        its phases are taken here; the eager stand-in (`runs_python`) runs them as forwards
        that take them one by one, and must have taken exactly these."""
        self._close_phase()
        ahead = list(itertools.islice(self.pending, len(phases)))
        if ahead != phases:
            raise RuntimeError(
                f"dp_attention: rank {self.rank} replays a graph of "
                f"{[(p.name, p.tokens) for p in phases]} where the step runs "
                f"{[(p.name, p.tokens) for p in ahead]}")
        left = len(self.pending) - len(phases)
        if not runs_python:
            for _ in phases:
                self.pending.popleft()
        replay()
        self._close_phase()
        if len(self.pending) != left:
            raise RuntimeError(f"dp_attention: rank {self.rank}'s graph of "
                               f"{[p.name for p in phases]} ran other forwards")

    @contextlib.contextmanager
    def capturing(self):
        """While this rank captures its graphs (all ranks at once, the same sizes in the
        same order): each forward's collectives take its own sizes."""
        if self.pending or self.phase is not None:
            raise RuntimeError("dp_attention: graphs captured inside a step")
        self._capturing = True
        try:
            yield
        finally:
            self._capturing = False

    def open_forward(self, num_tokens: int) -> Phase:
        """The next phase, for a forward of `num_tokens` tokens on this rank."""
        if self._capturing:
            return Phase("capture", num_tokens, 0, num_tokens, 0)
        self._close_phase()
        if not self.pending:
            raise RuntimeError(f"dp_attention: a forward of {num_tokens} tokens beyond the "
                               "step's phases")
        phase = self.pending.popleft()
        if num_tokens != phase.own_tokens:
            raise RuntimeError(f"dp_attention: phase {phase.name} expects {phase.own_tokens} "
                               f"tokens from rank {self.rank}, the forward has {num_tokens}")
        self.phase, self._mlp_calls, self._lm_head_calls = phase, 0, 0
        return phase

    def mlp_tokens(self, num_tokens: int) -> int:
        """The padded size of a tensor-parallel MLP's input in the open phase."""
        if self._capturing:
            return num_tokens
        phase = self._open("an MLP layer")
        if not phase.is_target or num_tokens != phase.own_tokens:
            raise RuntimeError(f"dp_attention: an MLP layer of {num_tokens} tokens in phase "
                               f"{phase.name} ({phase.own_tokens} tokens)")
        self._mlp_calls += 1
        return phase.tokens

    def lm_head_rows(self, num_rows: int) -> int:
        """The padded row count of the open phase's LM-head call."""
        if self._capturing:
            return num_rows
        phase = self._open("the LM head")
        if self._lm_head_calls or num_rows != phase.own_rows:
            raise RuntimeError(f"dp_attention: an LM-head call of {num_rows} rows in phase "
                               f"{phase.name} ({phase.own_rows} rows, one call)")
        self._lm_head_calls += 1
        return phase.rows

    def end_step(self) -> None:
        self._close_phase()
        self.graph = None
        if self.pending:
            raise RuntimeError("dp_attention: the step ended with phases not run: "
                               + ", ".join(p.name for p in self.pending))

    def _open(self, what: str) -> Phase:
        if self.phase is None:
            raise RuntimeError(f"dp_attention: {what} outside a forward")
        return self.phase

    def _close_phase(self) -> None:
        phase = self.phase
        if phase is None:
            return
        self.phase = None
        want = self.num_target_layers if phase.is_target else 0
        if self._mlp_calls != want:
            raise RuntimeError(f"dp_attention: phase {phase.name} ran {self._mlp_calls} "
                               f"tensor-parallel MLP layers, not {want}")

    # ---- padded collectives -------------------------------------------------------------
    def gather_ids(self, ids: torch.Tensor, padded: int) -> torch.Tensor:
        """Every rank's token ids, each padded to `padded` with 0: [W*padded] int64 (C02:
        an int32 producer's ids, or an idle rank's empty batch, go out as int64)."""
        return self.group.all_gather_rows(pad_int64(ids.reshape(-1), padded, 0))

    def gather_rows(self, x: torch.Tensor, padded: int) -> torch.Tensor:
        """Every rank's rows x [n, H], each padded to `padded` with zeros: [W*padded, H]."""
        if x.shape[0] < padded:
            x = torch.cat([x, x.new_zeros(padded - x.shape[0], *x.shape[1:])])
        return self.group.all_gather_rows(x)
