"""What dp_attention tests run inside each rank process (tests/local_dp_engine.py `hook`):
each takes the rank, patches what it must, and returns the callable whose value the
rank reports when the engine stops."""
from __future__ import annotations

import torch
import torch.distributed as dist

from actors.dp.attention_group import DPAttentionGroup
from actors.dp.sync import make_sync_row
from actors.worker.forward_batch import ForwardMode

COLLECTIVES = ("all_gather", "all_gather_single", "reduce_scatter_single", "all_to_all_single")
BIG = 2**40 + 3  # requests a rank claims in the last sync of the seed scenario
GRAPH_SIZES = [1, 2, 4]  # captured batch sizes of the graph tests (the stand-in's)


def record_steps(rank: int):
    """Every step's sync as this rank saw it: (forward mode per rank, tokens per rank)."""
    steps = []
    begin = DPAttentionGroup.begin_step

    def recording(self, row):
        sync = begin(self, row)
        steps.append(([int(m) for m in sync.forward_mode_per_rank], list(sync.tokens_per_rank)))
        return sync

    DPAttentionGroup.begin_step = recording
    return lambda: {"steps": steps}


def seed_scenario(rank: int):
    """The seed's DP bug: rank 0's verify produces int32 tokens (as a GPU kernel may); every
    tensor either rank hands to torch.distributed is recorded (name, dtype, shape). At the
    end both ranks run the engine's own step sync once more, rank 0 claiming BIG
    requests of a speculative step, rank 1 idle, and report the phases they derived."""
    steps = record_steps(rank)
    seen = []
    for name in COLLECTIVES:
        fn = getattr(dist, name)

        def wrapped(*args, __name=name, __fn=fn, **kwargs):
            seen.extend((__name, t.dtype, tuple(t.shape)) for t in [*args, *kwargs.values()]
                        if isinstance(t, torch.Tensor))
            seen.extend((__name, t.dtype, tuple(t.shape)) for a in args if isinstance(a, list)
                        for t in a)
            return __fn(*args, **kwargs)

        setattr(dist, name, wrapped)
    int32_outputs = [0]
    if rank == 0:
        import actors.spec.eagle_worker as ew
        verify = ew.greedy_verify

        def int32_verify(*args, **kwargs):
            accept_index, accept_length, predict = verify(*args, **kwargs)
            int32_outputs[0] += 1
            return accept_index, accept_length, predict.to(torch.int32)

        ew.greedy_verify = int32_verify
    groups = []
    init = DPAttentionGroup.__init__

    def keep(self, *args, **kwargs):
        init(self, *args, **kwargs)
        groups.append(self)

    DPAttentionGroup.__init__ = keep

    def report():
        dp = groups[0]
        n = dp.draft.num_draft_tokens
        row = (make_sync_row(BIG * n, BIG * n, False, False, ForwardMode.TARGET_VERIFY) if rank == 0
               else make_sync_row(0, 0, True, False, ForwardMode.IDLE))
        dp.begin_step(row)
        phases = [(p.name, p.tokens, p.rows, p.own_tokens) for p in dp.pending]
        dp.pending.clear()
        return {**steps(), "collectives": seen, "int32_outputs": int32_outputs[0],
                "big_phases": phases}

    return report


def idle_rank_skips_its_collectives(rank: int):
    """The seed's other DP bug on rank 1: an idle rank that runs no forward (and does not
    notice), so its peers' collectives have no partner."""
    if rank == 1:
        from actors.dp.lockstep_worker import LockstepWorker
        LockstepWorker._run_idle_phases = lambda self: None
        DPAttentionGroup.end_step = lambda self: self.pending.clear()
    return None


def stand_in_graphs(rank: int):
    """Graphs on, as the CPU's eager stand-in (GRAPH_SIZES), captured once the group
    forms; every step recorded as this rank saw it: its own row's can_run_graph, the
    group's modes and tokens per rank, the graph size chosen (None: eager), and the
    (phase, padded tokens) of each graph this rank replayed."""
    from actors.dp.lockstep_worker import LockstepWorker
    join = LockstepWorker.join

    def join_and_capture(self, *args, **kwargs):
        join(self, *args, **kwargs)
        self.capture_graphs(GRAPH_SIZES, use_cuda_graph=False)

    LockstepWorker.join = join_and_capture
    return record_graph_steps(rank)


def record_graph_steps(rank: int):
    """Per step: can_run_graph of this rank's row, modes and tokens per rank, the group's
    graph size (None: eager), the phases of each graph this rank replayed."""
    steps = []
    begin, replay = DPAttentionGroup.begin_step, DPAttentionGroup.replay_graph

    def recording(self, row):
        sync = begin(self, row)
        steps.append({"can_run_graph": int(row[2]), "modes": [int(m) for m in sync.forward_mode_per_rank],
                      "tokens": list(sync.tokens_per_rank),
                      "graph_bs": None if self.graph is None else self.graph.bs, "replays": []})
        return sync

    def recording_replay(self, phases, run, runs_python):
        steps[-1]["replays"].append([(p.name, p.tokens) for p in phases])
        return replay(self, phases, run, runs_python)

    DPAttentionGroup.begin_step = recording
    DPAttentionGroup.replay_graph = recording_replay
    return lambda: {"graph_steps": steps}


def own_gpu(rank: int):
    """GPU `rank` for this rank's process (a RankActor gets its own from Ray), and its
    graph steps recorded (record_graph_steps)."""
    torch.cuda.set_device(rank)
    return record_graph_steps(rank)


def seed_scenario_with_graphs(rank: int):
    """The seed scenario (below) with the stand-in graphs on."""
    graphs = stand_in_graphs(rank)
    seed = seed_scenario(rank)
    return lambda: {**seed(), **graphs()}


def late_ready(rank: int):
    """A GPU's timing on the CPU, where a step has run when `launch` returns: a launched
    step says it is ready only 30 ms after its launch, or once a later step's grammar
    masks have read its tokens, so the step channel launches the next plan first.
    Reports the plans with grammar rows that were launched before the step ahead of them
    had finished, and the steps answered from inside a later step's launch (the
    channel's early answer, RankWorker.on_steps_back)."""
    import time

    from actors.dp.lockstep_worker import LockstepWorker
    from actors.worker.launched_step import LaunchedStep
    launch, finish, ready = LockstepWorker.launch, LockstepWorker.finish, LaunchedStep.ready
    unfinished, ahead, inside = [], [0], [0]  # steps launched and not finished, in launch order
    launching_now = [False]

    def launching(self, plan):
        grammar = bool(plan.grammar_resets) or self.worker.grammars.any(plan.rows)
        ahead[0] += grammar and bool(unfinished)
        launching_now[0] = True
        try:
            step = launch(self, plan)
        finally:
            launching_now[0] = False
        step.ready_at = time.monotonic() + 0.03
        unfinished.append(step)
        return step

    def finishing(self, step):
        unfinished.remove(step)
        inside[0] += launching_now[0]
        return finish(self, step)

    LockstepWorker.launch, LockstepWorker.finish = launching, finishing
    LaunchedStep.ready = lambda self: ((time.monotonic() >= self.ready_at or self.tokens_read)
                                       and ready(self))
    return lambda: {"grammar_ahead": ahead[0], "answered_inside_launch": inside[0]}
