"""Prefill chunks as CUDA graphs: B requests, each padded to T tokens, B x T within a budget.

Decode replays graphs, but a prefill ran eagerly: for a 135M model some 400 kernel launches,
and on the H200 the host issuing them, not the GPU, set the time to first token (17 ms for
a 66-token prompt, 1.5 ms replayed). A prefill step whose B chunks are each at most
max(token_sizes) long replays as the graph of the next captured batch size and the next
captured chunk length T, when the padded size B x T is within `max_tokens`:

  target graph  lane b's ids at [b*T, b*T + n_b), positions prefix_b.. -> each lane's
                last real row's logits [B, V] fp32, and the features the draft head
                reads [B*T, F], into buffers every size shares
  (sampling)    eager, as for any batch: each request's temperature, top-p, coins
  draft graph   (speculation) draft extend over the chunks, ids shifted by one with the
                token after each chunk last -> the next top-k and hidden state

Padding sits after each lane's real tokens, and padded lanes are row 0 (reserved) with one
token: causal attention hides padding from every real token, padded keys go to slot 0
(reserved) and padded outputs are never read. Attention reads lane b's keys through
req_to_token[row_b, 0:prefix_b+T], so a chunk runs padded only when prefix_b + T fits the
row. The graphs read one static input buffer (ids, rows, prefixes, real lengths, next
ids), filled by one host-to-device copy per step.

On CPU the "graphs" are the bodies run on the same static buffers (how tests compare the
padded path to the eager one).
"""
from __future__ import annotations

import logging
import time

import numpy as np
import torch

from actors.graphs.cuda_graph_runner import EagerGraph, capture_cuda_graph, padded_size
from actors.dp.sync import draft_extend_ids
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.worker.host_copy import to_device
from actors.worker.launched_step import Emitted, one_token_each
from actors.protocol.step_plan import StepPlan

log = logging.getLogger("kestrel.worker")


class PrefillGraphs:
    def __init__(self, worker, batch_sizes: list[int], token_sizes: list[int], max_tokens: int,
                 use_cuda_graph: bool):
        self.w = worker
        self.eagle = worker.eagle
        self.token_sizes = sorted(set(token_sizes))
        self.max_tokens = max_tokens
        self.shapes = [(b, t) for b in sorted(set(batch_sizes)) for t in self.token_sizes
                       if b * t <= max_tokens]
        if not self.shapes:
            raise ValueError(f"no prefill graph fits attention.prefill_graph_max_tokens={max_tokens}")
        self.batch_sizes = sorted({b for b, _ in self.shapes})
        self.use_cuda_graph = use_cuda_graph
        dev = worker.device
        M = max(b * t for b, t in self.shapes)
        R = self.batch_sizes[-1]
        self.M, self.R = M, R
        # ids [M], then rows, prefixes, real lengths, next ids [R] each: one copy fills all.
        self.inputs = torch.zeros(M + 4 * R, dtype=torch.int64, device=dev)  # [M+4R] int64
        self.ids = self.inputs[:M]
        self.rows, self.prefix, self.length, self.next_id = self.inputs[M:].view(4, R)  # [R] int64 each
        self.token = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] sampled first tokens
        self.logits = torch.zeros(R, worker.arch.vocab_size, dtype=torch.float32, device=dev)  # [R, V]
        self.feats = None
        if self.eagle is not None:
            self.feats = torch.zeros(M, self.eagle.feature_size, dtype=worker.dtype, device=dev)  # [M, F]
        self._target: dict[tuple[int, int], object] = {}
        self._draft: dict[tuple[int, int], object] = {}

    def shape_for(self, plan: StepPlan) -> tuple[int, int] | None:
        """The captured (batch, chunk length) a plan's chunks replay at, or None (eager)."""
        B = len(plan.rows)
        bs = padded_size(self.batch_sizes, B)
        T = padded_size(self.token_sizes, max(plan.extend_lens)) if B else None
        if bs is None or T is None or bs * T > self.max_tokens:
            return None
        if max(plan.prefix_lens) + T > self.w.max_context:
            return None
        return bs, T

    # ---- bodies ---------------------------------------------------------------------
    def _batch(self, B: int, T: int, mode: ForwardMode, ids: torch.Tensor,
               hidden_in=None) -> ForwardBatch:
        rows, prefix, length = self.rows[:B], self.prefix[:B], self.length[:B]
        offs = torch.arange(T, dtype=torch.int64, device=self.inputs.device)  # [T] int64
        pos = prefix[:, None] + offs[None, :]  # [B, T] int64
        slots = self.w.req_to_token.req_to_token[rows[:, None], pos]  # [B, T] int64
        loc = torch.where(offs[None, :] < length[:, None], slots, torch.zeros_like(slots))
        return ForwardBatch(mode, ids, pos.reshape(-1), loc.reshape(-1), rows, prefix, [T] * B,
                            hidden_in=hidden_in)

    def _last(self, B: int, T: int) -> torch.Tensor:
        """Each lane's last real row in the flattened [B*T] chunk: [B] int64."""
        lanes = torch.arange(B, dtype=torch.int64, device=self.inputs.device)
        return lanes * T + self.length[:B] - 1

    def _target_body(self, B: int, T: int) -> None:
        w = self.w
        fb = self._batch(B, T, ForwardMode.EXTEND, self.ids[:B * T])
        hidden, aux = w.target.forward(fb, aux_layers=self.eagle.aux_layers if self.eagle else ())
        self.logits[:B].copy_(w.model.compute_logits(hidden[self._last(B, T)]))
        if self.eagle is not None:
            self.feats[:B * T].copy_(self.eagle.features(hidden, aux))

    def _draft_body(self, B: int, T: int):
        e = self.eagle
        last = self._last(B, T)
        nxt = torch.where(self.next_id[:B] >= 0, self.next_id[:B], self.token[:B])  # [B] int64
        shifted = self.ids[:B * T].view(B, T).roll(-1, 1).reshape(-1).index_copy(0, last, nxt)
        feats = self.feats[:B * T]
        fb = self._batch(B, T, ForwardMode.DRAFT_EXTEND, draft_extend_ids(shifted), hidden_in=feats)
        h = e.runner.forward(fb, hidden_in=feats)  # [B*T, H]
        last_h = h[last]  # [B, H]
        topk_p, topk_index = e.head.topk(last_h, e.K)
        return topk_p, topk_index, last_h

    # ---- capture and replay ---------------------------------------------------------
    def capture(self) -> None:
        """Record both graphs of every shape, largest first (smaller ones reuse its pool)."""
        t0 = time.time()
        self._fill_padding()
        pool = torch.cuda.graph_pool_handle() if self.use_cuda_graph else None
        stream = torch.cuda.Stream(self.w.device) if self.use_cuda_graph else None
        for B, T in sorted(self.shapes, key=lambda s: -s[0] * s[1]):
            self._target[B, T] = self._record(lambda _, B=B, T=T: self._target_body(B, T), pool, stream, B)
            if self.eagle is not None:
                self._draft[B, T] = self._record(lambda _, B=B, T=T: self._draft_body(B, T), pool, stream, B)
        if self.use_cuda_graph:
            torch.cuda.synchronize(self.w.device)
        log.info("rank %d: captured %d prefill graphs (batches %s x chunks %s, at most %d tokens) "
                 "in %.1fs%s", self.w.rank, len(self._target) + len(self._draft), self.batch_sizes,
                 self.token_sizes, self.max_tokens, time.time() - t0,
                 "" if self.use_cuda_graph else " (eager stand-in)")

    def _fill_padding(self) -> None:
        """Every lane a padded one: row 0, one token, slot 0 (how capture runs, too)."""
        self.inputs.zero_()
        self.length.fill_(1)

    def _record(self, body, pool, stream, batch: int):
        if not self.use_cuda_graph:
            return EagerGraph(body, None)
        return capture_cuda_graph(body, None, pool, stream, batch)

    def run(self, plan: StepPlan, shape: tuple[int, int]) -> Emitted:
        """The plan's chunks at a captured shape (from shape_for) -> their output tokens,
        queued without waiting for the device."""
        w = self.w
        bs, T = shape
        B = len(plan.rows)
        host = np.zeros(self.M + 4 * self.R, dtype=np.int64)  # [M+4R] int64, padding ids 0
        start = 0
        for b, n in enumerate(plan.extend_lens):
            host[b * T:b * T + n] = plan.input_ids[start:start + n]
            start += n
        lanes = host[self.M:].reshape(4, self.R)
        lanes[:, :B] = (plan.rows, plan.prefix_lens, plan.extend_lens, plan.next_ids)
        lanes[2, B:] = 1  # padded lanes: one token on row 0
        self.inputs.copy_(to_device(host, torch.int64, self.inputs.device))
        self._target[bs, T].replay()
        tokens, lps = w.sample(plan, self.rows[:B], self.logits[:B])  # [B] int64
        if self.eagle is not None:  # also for chunks that end no prompt: it writes draft KV
            self.token[:B].copy_(tokens)
            self._draft[bs, T].replay()
        done = [b for b in range(B) if plan.last_chunk[b]]
        if done:
            idx = slice(0, B) if len(done) == B else to_device(done, torch.int64, w.device)
            rows, seq_lens = self.rows[:B][idx], (self.prefix[:B] + self.length[:B])[idx]
            w.record(plan, rows, tokens[idx])
            if self.eagle is not None:
                topk_p, topk_index, last_h = self._draft[bs, T].output
                w.future.store(rows, seq_lens, tokens[idx], topk_p[:B][idx], topk_index[:B][idx],
                               last_h[:B][idx])
            else:
                w.future.store(rows, seq_lens, tokens[idx])
        return one_token_each(plan, tokens, plan.last_chunk, lps)
