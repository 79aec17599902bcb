"""One request's short prefill chunk as CUDA graphs, padded to a captured token count.

Decode replays graphs, but a prefill ran eagerly: for a 135M model that is some 400 kernel
launches, and on the H200 the host issuing them, not the GPU, set a short prompt's time to
first token. Here a chunk of one request with at most max(sizes) tokens replays as the
graph of the next captured size T:

  target graph  ids[:T] at positions prefix.. -> the last real row's logits [1, V] fp32,
                and the features the draft head reads [T, F]
  (sampling)    eager, as for any batch: the request's own temperature, top-p, coins
  draft graph   (speculation) draft extend over the chunk, ids shifted by one with the
                token after the chunk last -> the next top-k and hidden state

Padded tokens (rows n..T-1) sit after the real ones: causal attention hides them from
every real token, their keys go to slot 0 (reserved) and their outputs are never read.
Attention reads request keys through req_to_token[row, 0:prefix+T], so a chunk runs
padded only when prefix + T fits the row. The graphs read one static input buffer
(ids, row, prefix, real length, next id), filled by one host-to-device copy per chunk.

On CPU the "graphs" are the bodies run on the same static buffers (how tests compare
the padded path to the eager one).
"""
from __future__ import annotations

import logging
import time

import torch

from actors.cuda_graph_runner import EagerGraph, capture_cuda_graph, padded_size
from actors.dp.sync import ForwardMode, draft_extend_ids
from actors.forward_batch import ForwardBatch
from actors.sampler import sample_tokens
from actors.step_plan import StepPlan

log = logging.getLogger("kestrel.worker")


class PrefillGraphs:
    def __init__(self, worker, sizes: list[int], use_cuda_graph: bool):
        self.w = worker
        self.eagle = worker.eagle
        self.sizes = sorted(set(sizes))
        self.use_cuda_graph = use_cuda_graph
        M = self.sizes[-1]
        self.M = M
        # ids [M], then row, prefix, real length, next id: one copy fills them all.
        self.inputs = torch.zeros(M + 4, dtype=torch.int64, device=worker.device)  # [M+4] int64
        self.ids = self.inputs[:M]
        self.row, self.prefix = self.inputs[M:M + 1], self.inputs[M + 1:M + 2]  # [1] int64 each
        self.length, self.next_id = self.inputs[M + 2:M + 3], self.inputs[M + 3:M + 4]
        self.token = torch.zeros(1, dtype=torch.int64, device=worker.device)  # [1] sampled first token
        self._target: dict[int, object] = {}
        self._draft: dict[int, object] = {}

    def size_for(self, plan: StepPlan) -> int | None:
        """The captured size a plan's chunk replays at, or None (eager)."""
        if len(plan.rows) != 1:
            return None
        T = padded_size(self.sizes, plan.extend_lens[0])
        if T is None or plan.prefix_lens[0] + T > self.w.max_context:
            return None
        return T

    # ---- bodies ---------------------------------------------------------------------
    def _batch(self, T: int, mode: ForwardMode, ids: torch.Tensor, hidden_in=None) -> ForwardBatch:
        offs = torch.arange(T, dtype=torch.int64, device=self.inputs.device)  # [T] int64
        positions = self.prefix + offs  # [T] int64
        slots = self.w.req_to_token.req_to_token[self.row, positions]  # [T] int64
        loc = torch.where(offs < self.length, slots, torch.zeros_like(slots))  # padding -> slot 0
        return ForwardBatch(mode, ids, positions, loc, self.row, self.prefix, [T],
                            hidden_in=hidden_in)

    def _target_body(self, T: int):
        w = self.w
        aux_layers = self.eagle.aux_layers if self.eagle else ()
        hidden, aux = w.target.forward(self._batch(T, ForwardMode.EXTEND, self.ids[:T]),
                                       aux_layers=aux_layers)
        last = self.length - 1  # [1] int64
        logits = w.model.compute_logits(hidden[last])  # [1, V] fp32
        feats = self.eagle._features(hidden, aux) if self.eagle else None  # [T, F]
        return logits, feats

    def _draft_body(self, T: int, feats: torch.Tensor):
        e = self.eagle
        last = self.length - 1  # [1] int64
        nxt = torch.where(self.next_id >= 0, self.next_id, self.token)  # [1] int64
        shifted = torch.roll(self.ids[:T], -1).index_copy(0, last, nxt)  # [T] int64
        fb = self._batch(T, ForwardMode.DRAFT_EXTEND, draft_extend_ids(shifted), hidden_in=feats)
        h = e.runner.forward(fb, hidden_in=feats)  # [T, H]
        last_h = h[last]  # [1, H]
        topk_p, topk_index = e.head.topk(last_h, e.K)
        return topk_p, topk_index, last_h

    # ---- capture and replay ---------------------------------------------------------
    def capture(self) -> None:
        """Record both graphs of every size, largest first (smaller ones reuse its pool)."""
        t0 = time.time()
        self.inputs.zero_()
        self.length.fill_(1)  # capture on row 0 (reserved): only slot 0 is written
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graph else None
        stream = torch.cuda.Stream(self.w.device) if self.use_cuda_graph else None
        for T in reversed(self.sizes):
            self._target[T] = self._record(lambda _, T=T: self._target_body(T), pool, stream)
            if self.eagle is not None:
                # The CUDA graph reads the target graph's static features; the eager
                # stand-in reads whatever its last replay produced.
                self._draft[T] = self._record(
                    lambda _, T=T: self._draft_body(T, self._target[T].output[1]), pool, stream)
        if self.use_cuda_graph:
            torch.cuda.synchronize(self.w.device)
        log.info("rank %d: captured prefill graphs for chunks of up to %s tokens in %.1fs%s",
                 self.w.rank, self.sizes, time.time() - t0,
                 "" if self.use_cuda_graph else " (eager stand-in)")

    def _record(self, body, pool, stream):
        if not self.use_cuda_graph:
            return EagerGraph(body, None)
        return capture_cuda_graph(body, None, pool, stream)

    def run(self, plan: StepPlan, T: int) -> list[list[int]]:
        """The plan's one chunk at captured size T (from size_for) -> its output tokens."""
        w = self.w
        n, prefix = plan.extend_lens[0], plan.prefix_lens[0]
        host = torch.zeros(self.M + 4, dtype=torch.int64)  # [M+4] int64, padding ids 0
        host[:n] = torch.as_tensor(plan.input_ids, dtype=torch.int64)
        host[self.M:] = torch.tensor([plan.rows[0], prefix, n, plan.next_ids[0]], dtype=torch.int64)
        self.inputs.copy_(host)
        target = self._target[T]
        target.replay()
        logits, _ = target.output
        tokens = sample_tokens(logits, plan.temperature, plan.top_p, plan.top_k, plan.coins)  # [1]
        done = plan.last_chunk[0]
        seq_len = self.prefix + self.length  # [1] int64
        if self.eagle is not None:
            self.token.copy_(tokens)
            draft = self._draft[T]
            draft.replay()
            topk_p, topk_index, last_h = draft.output
            if done:
                w.future.store(self.row, seq_len, tokens, topk_p, topk_index, last_h)
        elif done:
            w.future.store(self.row, seq_len, tokens)
        return [[int(tokens.item())]] if done else [[]]
