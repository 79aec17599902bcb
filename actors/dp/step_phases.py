"""The forwards of one dp_attention step, in order, and their padded sizes.

Under dp_attention every rank runs the same forwards in the same order, because each
one holds collectives (the vocab-parallel embedding and LM head, the tensor-parallel MLP
of the target). A phase is one model forward (its token collectives padded to `tokens`)
and at most one LM-head call after it (rows padded to `rows`). The group's phases follow
from the step's sync rows (one per rank, actors/dp/sync.py): with speculation
    draft decode x (S-1)  -- only when some rank runs a speculative iteration
    target                -- prefill chunks, plain decode or verify
    draft extend          -- after a prefill or a verify
and without it the target forward alone. A rank takes part in the phases its own step
has and runs an empty batch through the others; each padded size is the maximum over
the ranks of their own sizes in that phase.

With CUDA graphs captured, a step whose rows all say `can_run_graph` and whose busy ranks
all run the one mode the graphs hold (plain decode, or a speculative iteration) is a
graph step (:func:`graph_step`): every rank, an idle one too, replays the graphs of one
captured size, the next one at or above the largest rank's batch, so every phase has
that size's shapes on every rank (:func:`graph_phases`). Other steps run eagerly.

Each rank's sizes follow from its row alone:
    EXTEND         [T, B]: target (T tokens, B rows: each chunk's last), draft extend (T, B)
    DECODE         [B, B]: target (B, B)
    TARGET_VERIFY  [B*N, B*N]: draft decode (B*K, B*K) x (S-1), target (B*N, B*N), draft
                   extend (B*N, B)
"""
from __future__ import annotations

from dataclasses import dataclass

from actors.graphs.cuda_graph_runner import padded_size
from actors.dp.sync import DPSyncResult
from actors.worker.forward_batch import ForwardMode

TARGET, DRAFT_EXTEND = "target", "draft_extend"


@dataclass(frozen=True)
class DraftShape:
    """The speculative iteration's sizes (draft.*): S steps, K top-k, N tree nodes."""

    num_steps: int
    topk: int
    num_draft_tokens: int


@dataclass(frozen=True)
class Phase:
    name: str  # "draft_decode.i", "target" or "draft_extend"
    tokens: int  # padded tokens of the forward (max over ranks)
    rows: int  # padded LM-head rows (max over ranks)
    own_tokens: int  # this rank's tokens; 0: it runs an empty batch
    own_rows: int

    @property
    def is_target(self) -> bool:
        """A target forward: its MLP layers are tensor-parallel. Draft forwards have none."""
        return self.name == TARGET


@dataclass(frozen=True)
class GraphStep:
    """A step the group replays as CUDA graphs, all of one captured batch size."""

    mode: ForwardMode  # the busy ranks' one mode: TARGET_VERIFY with a draft, else DECODE
    bs: int  # the captured size every rank replays, its lanes past its own batch padded


def _draft_decode(i: int) -> str:
    return f"draft_decode.{i}"


def is_draft_decode(name: str) -> bool:
    return name.startswith("draft_decode.")


def own_sizes(mode: ForwardMode, num_tokens: int, num_rows: int,
              draft: DraftShape | None) -> dict[str, tuple[int, int]]:
    """One rank's (tokens, rows) per phase it takes part in, from its sync row."""
    if mode == ForwardMode.IDLE:
        return {}
    if mode == ForwardMode.DECODE:
        return {TARGET: (num_tokens, num_rows)}
    if mode == ForwardMode.EXTEND:
        sizes = {TARGET: (num_tokens, num_rows)}
        if draft is not None:
            sizes[DRAFT_EXTEND] = (num_tokens, num_rows)
        return sizes
    if mode == ForwardMode.TARGET_VERIFY:
        if draft is None:
            raise ValueError("a speculative step (TARGET_VERIFY) without draft settings")
        S, K, N = draft.num_steps, draft.topk, draft.num_draft_tokens
        if num_tokens % N:
            raise ValueError(f"a verify of {num_tokens} tokens is not a whole number of "
                             f"{N}-node trees")
        B = num_tokens // N
        sizes = {_draft_decode(i): (B * K, B * K) for i in range(S - 1)}
        sizes[TARGET] = (num_tokens, num_tokens)
        sizes[DRAFT_EXTEND] = (num_tokens, B)
        return sizes
    raise ValueError(f"no dp_attention step starts in mode {mode.name}")


def graph_step(sync: DPSyncResult, sizes: list[int] | None,
               draft: DraftShape | None) -> GraphStep | None:
    """The step's graphs, or None: the group runs it eagerly. Graphs need every rank able
    to replay (can_run_graph is the minimum over the rows: a rank's batch fits a captured
    size and its step is a decode), and one busy mode, the graphs': a prefill's forwards
    have shapes of their own (chunks x chunk length, one LM-head row per chunk) that no
    decode graph shares, so a prefill anywhere makes the step eager."""
    if not sizes or not sync.can_run_graph or sync.all_idle:
        return None
    mode = ForwardMode.TARGET_VERIFY if draft is not None else ForwardMode.DECODE
    if any(m not in (mode, ForwardMode.IDLE) for m in sync.forward_mode_per_rank):
        return None
    per_lane = draft.num_draft_tokens if draft is not None else 1
    # Every rank's batch fits a captured size (its row says so), so the largest does.
    return GraphStep(mode, padded_size(sizes, sync.max_tokens // per_lane))


def graph_phases(graph: GraphStep, draft: DraftShape | None) -> list[Phase]:
    """The phases of a graph step, the same on every rank: each rank's own sizes are the
    padded ones, since every rank replays all `graph.bs` lanes."""
    per_lane = draft.num_draft_tokens if draft is not None else 1
    tokens = graph.bs * per_lane
    return [Phase(name, t, r, t, r)
            for name, (t, r) in own_sizes(graph.mode, tokens, tokens, draft).items()]


def step_phases(sync: DPSyncResult, rank: int, draft: DraftShape | None,
                graph: GraphStep | None = None) -> list[Phase]:
    """The step's phases in order, padded for the group, with `rank`'s own sizes (those of
    `graph`, when the step replays graphs)."""
    if graph is not None:
        return graph_phases(graph, draft)
    per_rank = [own_sizes(m, t, r, draft) for m, t, r in
                zip(sync.forward_mode_per_rank, sync.tokens_per_rank, sync.logprob_tokens_per_rank)]
    names = []
    if ForwardMode.TARGET_VERIFY in sync.forward_mode_per_rank:
        names += [_draft_decode(i) for i in range(draft.num_steps - 1)]
    if not sync.all_idle:
        names.append(TARGET)
        if draft is not None:
            names.append(DRAFT_EXTEND)
    phases = []
    for name in names:
        sizes = [s.get(name, (0, 0)) for s in per_rank]
        own = sizes[rank]
        phases.append(Phase(name, max(t for t, _ in sizes), max(r for _, r in sizes), *own))
    return phases
