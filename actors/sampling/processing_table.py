"""Per request row, on the device: the logit processing its request asked for (penalties,
logit bias, the stop ids min_tokens bans, bad words; kestrel_kernels/penalties.py), and how it
samples (temperature, top-p, top-k, min-p; kestrel_kernels/sampling.py).

Written once when a request is admitted (plan.processing_resets, in stream order behind
the steps queued before), and read by row at every step: nothing is built on the host per
step, and the CUDA graphs of decode and of the speculative iteration read the same
tensors. The scheduler writes every row whose request processes or samples (and clears a
row after such a request), so a row's temperature here is > 0 exactly when the plans of
its request say so. Bias, stop ids and bad words sit in tables of fixed width
(configs/schema.py, ProcessingConfig); what a request has beyond them stays here on the
host, and a step with such a row takes the eager path, which appends it (`has_extra`).
Rows never written (row 0, the padded lanes' row) process nothing and are greedy.
"""
from __future__ import annotations

import numpy as np
import torch

from actors.worker.host_copy import to_device
from actors.sampling.output_counts import TAIL
from actors.protocol.step_plan import RowProcessing
from configs.schema import ProcessingConfig
from kestrel_kernels.penalties import Processing


def _tables(p: RowProcessing) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """A request's entries, whole: bias ids [M] int64 and values [M] float32, stop ids [S]
    int64, bad words' last ids [W] int64 and their prefixes [W, TAIL] int64 (right-aligned,
    -1 padded)."""
    words = np.full((len(p.bad_words), 1 + TAIL), -1, dtype=np.int64)  # [W, 1 + TAIL]
    for k, w in enumerate(p.bad_words):
        words[k, 1 + TAIL - len(w):] = w
    return (np.asarray(p.bias_tokens, dtype=np.int64), np.asarray(p.bias_values, dtype=np.float32),
            np.asarray(p.stop_ids, dtype=np.int64), words[:, -1], words[:, :TAIL])


def _padded(rows: list[np.ndarray], width: int, fill, dtype) -> np.ndarray:
    """Arrays of up to `width` leading entries each -> [len(rows), width, ...] padded."""
    out = np.full((len(rows), width, *rows[0].shape[1:]), fill, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, :len(r)] = r
    return out


class ProcessingTable:
    def __init__(self, num_rows: int, widths: ProcessingConfig, device: torch.device):
        R, dev = num_rows, device
        self.widths, self.device = widths, device
        self.presence = torch.zeros(R, dtype=torch.float32, device=dev)  # [R] float32
        self.frequency = torch.zeros(R, dtype=torch.float32, device=dev)  # [R] float32
        self.repetition = torch.ones(R, dtype=torch.float32, device=dev)  # [R] float32
        self.min_tokens = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] int64
        self.bias_token = torch.full((R, widths.logit_bias), -1, dtype=torch.int64, device=dev)  # [R, MB]
        self.bias_value = torch.zeros(R, widths.logit_bias, dtype=torch.float32, device=dev)  # [R, MB]
        self.stop_token = torch.full((R, widths.stop_ids), -1, dtype=torch.int64, device=dev)  # [R, MS]
        self.bad_last = torch.full((R, widths.bad_words), -1, dtype=torch.int64, device=dev)  # [R, MW]
        self.bad_prefix = torch.full((R, widths.bad_words, TAIL), -1, dtype=torch.int64, device=dev)  # [R, MW, TAIL]
        self.temperature = torch.zeros(R, dtype=torch.float32, device=dev)  # [R] float32, <= 0: greedy
        self.top_p = torch.ones(R, dtype=torch.float32, device=dev)  # [R] float32
        self.top_k = torch.zeros(R, dtype=torch.int64, device=dev)  # [R] int64, <= 0: no limit
        self.min_p = torch.zeros(R, dtype=torch.float32, device=dev)  # [R] float32
        # row -> the entries past the widths: bias ids, bias values, stop ids, bad last, bad prefix
        self.extra: dict[int, tuple[np.ndarray, ...]] = {}

    def reset(self, resets: list[tuple[int, RowProcessing | None]]) -> None:
        """Write the rows' entries, a few copies for all of them (a burst of admissions
        costs no more launches than one); a row given twice keeps its last."""
        last = dict(resets)
        rows = to_device(list(last), torch.int64, self.device)  # [n] int64
        ps = [p or RowProcessing() for p in last.values()]
        f32 = lambda vals: to_device(np.asarray(vals, dtype=np.float32), torch.float32, self.device)
        self.presence[rows] = f32([p.presence for p in ps])
        self.frequency[rows] = f32([p.frequency for p in ps])
        self.repetition[rows] = f32([p.repetition for p in ps])
        self.min_tokens[rows] = to_device([p.min_tokens for p in ps], torch.int64, self.device)
        self.temperature[rows] = f32([p.temperature for p in ps])
        self.top_p[rows] = f32([p.top_p for p in ps])
        self.top_k[rows] = to_device([p.top_k for p in ps], torch.int64, self.device)
        self.min_p[rows] = f32([p.min_p for p in ps])
        entries = [_tables(p) for p in ps]
        w = self.widths
        for k, (table, width, fill) in enumerate(((self.bias_token, w.logit_bias, -1),
                                                  (self.bias_value, w.logit_bias, 0),
                                                  (self.stop_token, w.stop_ids, -1),
                                                  (self.bad_last, w.bad_words, -1),
                                                  (self.bad_prefix, w.bad_words, -1))):
            host = _padded([e[k][:width] for e in entries], width, fill, entries[0][k].dtype)
            table[rows] = to_device(host, table.dtype, self.device)
        for row, (bias_tok, bias_val, stops, last_ids, prefix) in zip(last, entries):
            self.extra.pop(row, None)
            if len(bias_tok) > w.logit_bias or len(stops) > w.stop_ids or len(last_ids) > w.bad_words:
                self.extra[row] = (bias_tok[w.logit_bias:], bias_val[w.logit_bias:], stops[w.stop_ids:],
                                   last_ids[w.bad_words:], prefix[w.bad_words:])

    def has_extra(self, rows: list[int]) -> bool:
        """Whether a row of `rows` has entries past the table widths (eager steps only)."""
        return bool(self.extra) and any(r in self.extra for r in rows)

    def sampling(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Request rows [B] int64 -> (temperature [B] float32, top_p [B] float32, top_k [B]
        int64, min_p [B] float32), process_logits' arguments."""
        return self.temperature[rows], self.top_p[rows], self.top_k[rows], self.min_p[rows]

    def gather(self, rows: torch.Tensor, plan_rows: list[int] | None = None) -> Processing:
        """The processing of request rows [B] int64; with the plan's rows on the host (the
        eager path), their extra entries appended as more columns."""
        p = Processing(self.presence[rows], self.frequency[rows], self.repetition[rows],
                       self.min_tokens[rows], self.bias_token[rows], self.bias_value[rows],
                       self.stop_token[rows], self.bad_last[rows], self.bad_prefix[rows])
        if plan_rows is None or not self.has_extra(plan_rows):
            return p
        empty = tuple(e[:0] for e in next(iter(self.extra.values())))
        extras = [self.extra.get(r, empty) for r in plan_rows]
        cols = []
        for k, (fill, dtype) in enumerate(((-1, torch.int64), (0, torch.float32), (-1, torch.int64),
                                           (-1, torch.int64), (-1, torch.int64))):
            parts = [e[k] for e in extras]
            host = _padded(parts, max(len(x) for x in parts), fill, parts[0].dtype)
            cols.append(to_device(host, dtype, self.device))
        cat = lambda a, b: torch.cat([a, b], 1)
        return Processing(p.presence, p.frequency, p.repetition, p.min_tokens,
                          cat(p.bias_token, cols[0]), cat(p.bias_value, cols[1]),
                          cat(p.stop_token, cols[2]), cat(p.bad_last, cols[3]),
                          cat(p.bad_prefix, cols[4]))
