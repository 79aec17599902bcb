"""The scheduler: owns requests, their lengths and KV slots; turns them into step plans.

One Scheduler drives one rank's worker. Each step is either an extend (chunked prefill of
waiting requests, prefill first as SGLang does) or a decode of every running request
(plain or speculative); with scheduler.decode_between_chunks, a decode runs between two
chunks of one prompt while requests decode. `schedule()` builds a StepPlan, the worker executes it, and
`process_output()` commits lengths and emits tokens. Nothing here touches a model.

Ownership (contract C10): `kv_allocated_len` is written only by `_grow_kv` and
`_release_kv`, `kv_committed_len` only by `process_output` and `_release_kv`.
"""
from __future__ import annotations

import itertools
import logging
import time
from collections import deque

import numpy as np
import torch

from actors.worker.kv_cache import RowAllocator, SlotAllocator, kv_ahead, max_request_slots
from actors.protocol.messages import RequestOutput
from actors.protocol.step_plan import PLAIN_STEP, RowProcessing, StepOutput, StepPlan, coins_per_request
from configs.schema import KestrelConfig
from serve_app.engine.draft_policy import DraftPolicy, moving_period
from serve_app.engine.radix_cache import RadixCache
from serve_app.engine.request import CoinStream, Request, text_ids

log = logging.getLogger("kestrel.scheduler")


def output_room(num_prompt_tokens: int, max_model_len: int) -> int:
    """The most tokens a request may generate after a prompt this long: what the model's
    context leaves (the HTTP front end's default max_tokens, the scheduler's cap)."""
    return max_model_len - num_prompt_tokens


class PromptRejected(ValueError):
    """A prompt that cannot run: empty (`num_tokens` 0), or longer than `limit`, which
    leaves room for one output token. The HTTP front end words its own answer from it."""

    def __init__(self, message: str, num_tokens: int, limit: int):
        super().__init__(message)
        self.num_tokens, self.limit = num_tokens, limit


def check_prompt(prompt_ids: list[int], max_model_len: int) -> None:
    """PromptRejected if a prompt cannot run. The one check of a prompt: the HTTP front
    end, the engine client and the scheduler each call it."""
    limit = max_model_len - 1  # output_room(limit, max_model_len) == 1
    if not prompt_ids:
        raise PromptRejected("the prompt is empty", 0, limit)
    if len(prompt_ids) > limit:
        raise PromptRejected(f"the prompt has {len(prompt_ids)} tokens; this model accepts "
                             f"at most {limit} (model.max_model_len={max_model_len})",
                             len(prompt_ids), limit)


def row_processing(req: Request) -> RowProcessing:
    """A request's logit processing and sampling, as its rank keeps them for the request's row."""
    p = req.params
    return RowProcessing(
        p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens,
        np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)),
        np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)),
        np.asarray(sorted(req.stop_ids) if p.min_tokens else [], dtype=np.int64),
        [list(w) for w in p.bad_words], p.temperature, p.top_p, p.top_k, p.min_p)


class Scheduler:
    def __init__(self, cfg: KestrelConfig, worker_info: dict, eos_token_ids: list[int],
                 detokenizer_factory=None):
        self.cfg = cfg
        self.spec = cfg.draft.enabled
        self.page = cfg.kv_cache.page_size
        self.window = worker_info["window"]
        self.max_context = worker_info["max_context"]
        self.max_model_len = cfg.model.max_model_len
        self.slots = SlotAllocator(worker_info["num_slots"], self.page)
        self.rows = RowAllocator(worker_info["num_rows"])
        self.cache = RadixCache(self.slots, self.page, enabled=cfg.kv_cache.prefix_caching)
        self.eos = frozenset(eos_token_ids)
        self.detokenizer_factory = detokenizer_factory  # req -> its TextStream; None: no text
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prefill not finished
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.step_id = 0
        self._held_steps = 0  # decode steps run while admissible requests waited
        # The last extend left a prompt with chunks to go (scheduler.decode_between_chunks).
        self._chunks_left = False
        # step id -> its requests, in plan order, with the admission each was planned under
        self._inflight: dict[int, list[tuple[Request, int]]] = {}
        # decode step id -> whether each of its decode rows drafted from a stale top-k, as
        # planned (a later plain step may mark it before the output); only where the draft
        # policy may take plain steps (draft.plain_steps)
        self._stale: dict[int, list[bool]] = {}
        # req_to_token updates not yet sent: they ride on the next plan that is dispatched,
        # whichever it is (an admission can happen in an extend plan that is then dropped).
        self._kv_writes: list[tuple[int, int, torch.Tensor]] = []
        self._count_resets: list[tuple[int, np.ndarray | None, np.ndarray]] = []  # the same way
        self._grammar_resets: list[tuple[int, str | None, np.ndarray]] = []  # the same way
        self._grammar_rows: set[int] = set()  # rows whose worker holds a grammar matcher
        self._processing_resets: list[tuple[int, RowProcessing | None]] = []  # the same way
        self._processing_rows: set[int] = set()  # rows whose worker holds a request's processing or sampling
        # The grammar vocabulary (set_grammar_vocab): requests with a grammar need it first,
        # and the first plan with one carries it to the worker unless the worker holds it.
        self.grammar_ready = False
        self._vocab_to_send: str | None = None
        self.coins_per_request = coins_per_request(cfg)
        # The draft shape per decode step, where the rank measured its shapes' costs.
        self.draft_policy = DraftPolicy.from_worker(cfg.draft.shapes(), worker_info,
                                                    cfg.draft.measured_periods) if self.spec else None
        self._last_output = 0.0  # perf_counter when the last step's output was committed
        # Seconds a prefill step took through the step loop while requests decoded, a
        # moving average (scheduler.prefill_by_cost); 0: none measured yet.
        self.extend_period = 0.0
        self.stats = {"prompt_tokens_computed": 0, "prompt_tokens_cached": 0, "preemptions": 0}
        self.mix = cfg.scheduler.mixed_steps and not self._why_not_mixed(cfg)
        if self.slots.capacity < max_request_slots(self.max_model_len, self.window, self.page):
            raise ValueError(f"kv_cache.num_slots={worker_info['num_slots']} cannot hold one "
                             f"request of model.max_model_len={self.max_model_len}")

    @staticmethod
    def _why_not_mixed(cfg: KestrelConfig) -> str:
        """Why scheduler.mixed_steps does not apply to this config, logged; "" where it does."""
        why = ("parallel.dp_attention steps its ranks' phases in lockstep" if cfg.parallel.dp_attention
               else "attention.backend=flashinfer has no verify tree beside causal chunks"
               if cfg.attention.backend == "flashinfer" and cfg.draft.enabled else "")
        if why and cfg.scheduler.mixed_steps:
            log.info("scheduler.mixed_steps does not apply (%s): prefill and decode steps alternate", why)
        return why

    # ---- requests in and out ------------------------------------------------------------
    def set_grammar_vocab(self, vocab_json: str | None) -> None:
        """The tokenizer as xgrammar knows it (serve_app/text/grammar.py): needed before any
        request with a grammar; the next plan with a grammar carries it to the worker. None:
        the worker holds it already (a served replica sends it to its ranks at start-up),
        so no plan carries its 1.6 MB through this loop."""
        if not self.grammar_ready:
            self.grammar_ready, self._vocab_to_send = True, vocab_json

    def add_request(self, req: Request) -> None:
        check_prompt(req.prompt_ids, self.max_model_len)
        p = req.params
        if p.grammar is not None and not self.grammar_ready:
            raise ValueError("a grammar needs the grammar vocabulary (set_grammar_vocab) first")
        req.stop_ids = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos)
        req.max_output = min(p.max_tokens, output_room(len(req.prompt_ids), self.max_model_len))
        if p.temperature > 0:
            seed = p.seed if p.seed is not None else torch.seed()
            req.coin_stream = CoinStream(seed, self.coins_per_request)
        if self.detokenizer_factory is not None:
            req.text_stream = self.detokenizer_factory(req)
        req.quiet = req.on_output is None and (req.text_stream is None or not req.text_stream.has_stops)
        self.requests[req.rid] = req
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """Cancel a request (client gone): its KV is freed at once."""
        return self.finish(rid, "abort")

    def finish(self, rid: str, reason: str) -> bool:
        """End a request from outside the step loop, its KV freed at once: "abort" (the
        client went away; its stream gets a last, empty output) or "stop" (whoever turns
        its tokens into text saw a stop string)."""
        req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        self._finish(req, reason)
        return True

    def abort_all(self) -> None:
        """Cancel every request (a deadline passed). The queue goes in one piece: aborting
        queued requests one by one costs a scan of the queue each."""
        waiting, self.waiting = self.waiting, deque()
        for req in [*waiting, *self.prefilling, *self.running]:
            self._finish(req, "abort")

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_requests(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    def load(self) -> tuple[int, int]:
        """(requests held, KV slots in use): what a new request weighs ranks by under
        dp_attention, the fewest requests first."""
        return self.num_requests, self.slots.capacity - self.kv_free_slots()

    def kv_free_slots(self) -> int:
        """Free slots counting what the prefix cache could give back."""
        return self.slots.free_slots + self.cache.evictable_slots

    # ---- KV bookkeeping -------------------------------------------------------------------
    def _take_pages(self, n: int) -> list[int] | None:
        """Pages for `n` slots, evicting from the prefix cache what is missing."""
        if n > self.slots.free_slots:
            self.cache.evict(n - self.slots.free_slots)
        return self.slots.take_pages(n)

    def _kv_target(self, need: int) -> int:
        """The allocated length that covers `need` slots: page-rounded, within the row."""
        return min(self.slots.round_up(need), self.max_context)

    def _grow_kv(self, req: Request, need: int, new: torch.Tensor | None = None) -> bool:
        """Make sure the row holds `need` slots (page-rounded). Allocation is monotonic.
        `new`: the slots to add, when the caller allocated them already (for a batch)."""
        need = self._kv_target(need)
        delta = need - req.kv_allocated_len
        if delta <= 0:
            return True
        if new is None:
            pages = self._take_pages(delta)
            if pages is None:
                return False
            new = self.slots.slots_of([pages])[0]
        self._kv_writes.append((req.row, req.kv_allocated_len, new))
        req.slot_pieces.append(new)
        req.kv_allocated_len = need
        return True

    def release_ranges(self, committed: int, allocated: int) -> tuple[range, range]:
        """(committed part, over-allocated tail) of a row, in slot positions (C13): the
        tail starts at the page boundary after the last committed token."""
        end = min(self.slots.round_up(committed), allocated)
        return range(0, end), range(end, allocated)

    def _release_kv(self, req: Request) -> None:
        """Give the KV back: the tail is freed; of the committed part the valid full pages
        go to the prefix cache (which frees its duplicates) and the rest is freed."""
        if req.row is None:
            return
        committed, tail = self.release_ranges(req.kv_committed_len, req.kv_allocated_len)
        self.slots.free(req.slots[tail.start:tail.stop])
        valid = min(req.kv_committed_len, len(req.all_ids))
        kept = 0
        if self.cache.enabled and valid > 0:
            self.cache.insert(req.all_ids[:valid], req.slots[:valid])
            kept = self.cache.aligned(valid)
        self.slots.free(req.slots[kept:committed.stop])
        self.cache.unlock(req.cache_node)
        req.cache_node = None
        self.rows.free(req.row)
        req.row = None
        req.slots = torch.zeros(0, dtype=torch.int64)
        req.kv_allocated_len = 0
        req.kv_committed_len = 0
        req.prefilled = req.scheduled = 0

    # ---- scheduling ----------------------------------------------------------------------
    def schedule(self) -> StepPlan | None:
        if not self.has_work:
            return None
        self.step_id += 1
        plan = None
        if self._can_mix():
            plan = self._schedule_mixed()
        elif not (self._chunks_left and self.running and self.cfg.scheduler.decode_between_chunks):
            plan = self._schedule_extend()
        plan = plan or self._schedule_decode()
        if plan is None and self.waiting:
            plan = self._schedule_extend()  # decode preempted everyone: prefill them again
        if plan is not None:
            plan.kv_writes = [(row, start, slots.numpy()) for row, start, slots in self._kv_writes]
            self._kv_writes = []
            plan.count_resets, self._count_resets = self._count_resets, []
            plan.grammar_resets, self._grammar_resets = self._grammar_resets, []
            plan.processing_resets, self._processing_resets = self._processing_resets, []
            if plan.grammar_resets and self._vocab_to_send is not None:
                plan.grammar_vocab, self._vocab_to_send = self._vocab_to_send, None
            self._chunks_left = plan.mode == "extend" and any(
                r.scheduled < len(r.fill_ids) for r in self.prefilling)
            if plan.step_id in self._stale:  # a decode (or mixed) step that may be plain
                # A plain step keeps the draft's top-k; any other refreshes it (a mixed plain
                # step's draft extend covers its decode rows).
                stale = plan.mode == "decode" and plan.draft_shape == PLAIN_STEP
                for req in self.running:
                    req.draft_stale = stale
        return plan

    def _can_mix(self) -> bool:
        """Whether this step may carry prefill chunks beside the running decodes
        (scheduler.mixed_steps): requests decode and prompts wait, and no request involved
        asks for logprobs or a grammar (those steps alternate, as without mixing)."""
        if not (self.mix and self.running) or self._grammar_rows:
            return False
        if not self.waiting and all(r.scheduled >= len(r.fill_ids) for r in self.prefilling):
            return False
        if any(r.params.logprobs is not None for r in self.running):
            return False
        return not any(r.params.logprobs is not None or r.params.grammar is not None
                       or r.params.prompt_logprobs is not None
                       for r in itertools.chain(self.prefilling, self.waiting))

    def _schedule_mixed(self) -> StepPlan | None:
        """The running requests' decode, and prefill chunks for the waiting ones in the same
        step (its target forward): a prompt arriving no longer pauses the streams. The chunks
        take up to chunked_prefill_size tokens beside the decode rows."""
        decode = self._schedule_decode()
        if decode is None:  # the decode preempted everyone
            return None
        decoding = self._inflight.pop(self.step_id)
        extend = self._schedule_extend()
        if extend is None:
            self._inflight[self.step_id] = decoding
            return decode
        both = decoding + self._inflight.pop(self.step_id)
        self._inflight[self.step_id] = both
        d, e = decode, extend
        plan = StepPlan(self.step_id, "mixed", d.rows + e.rows, num_decode=len(d.rows),
                        use_spec=d.use_spec, draft_shape=d.draft_shape,
                        coins=np.concatenate([d.coins, e.coins]),
                        input_ids=e.input_ids, prefix_lens=e.prefix_lens, extend_lens=e.extend_lens,
                        last_chunk=e.last_chunk, next_ids=e.next_ids)
        self._add_sampling([r for r, _ in both], plan)
        return plan

    def _admit(self, req: Request) -> bool:
        row = self.rows.alloc()
        if row is None:
            return False
        req.row = row
        req.admissions += 1
        req.fill_ids = req.all_ids
        # Prompt logprobs come from running every prompt position: no cached prefix then.
        m = self.cache.match_prefix([] if self._needs_prompt_logprobs(req) else req.fill_ids)
        self.cache.lock(m.node)
        req.cache_node = m.node
        req.slots = m.slots.clone()
        req.prefilled = req.scheduled = m.length
        req.kv_allocated_len = m.length  # the matched pages are whole pages
        req.kv_committed_len = m.length
        req.cached_tokens += m.length
        if req.num_preemptions == 0:  # readmitted, the match also holds its own outputs
            req.prompt_cached = min(m.length, len(req.prompt_ids))
        self.stats["prompt_tokens_cached"] += m.length
        if m.length:
            self._kv_writes.append((row, 0, m.slots))
        p = req.params
        if p.needs_counts:  # from its outputs so far: a preempted request brings them back
            prompt = np.asarray(req.prompt_ids, dtype=np.int64) if p.repetition_penalty != 1.0 else None
            self._count_resets.append((row, prompt, np.asarray(req.output_ids, dtype=np.int64)))
        # The row's table entry: its processing and its sampling, which the sampled graphs
        # read by row (a greedy row after a sampled request must be cleared, or it samples).
        keeps = p.processes_logits or p.temperature > 0
        if keeps or row in self._processing_rows:
            self._processing_resets.append((row, row_processing(req) if keeps else None))
            if keeps:
                self._processing_rows.add(row)
            else:
                self._processing_rows.discard(row)
        if p.grammar is not None or row in self._grammar_rows:
            self._grammar_resets.append((row, p.grammar, np.asarray(req.output_ids, dtype=np.int64)))
            if p.grammar is not None:
                self._grammar_rows.add(row)
            else:
                self._grammar_rows.discard(row)
        return True

    @staticmethod
    def _needs_prompt_logprobs(req: Request) -> bool:
        return req.params.prompt_logprobs is not None and len(req.prompt_logprobs) < len(req.prompt_ids) - 1

    def _prefill_due(self) -> bool:
        """Whether new requests should be admitted now (scheduler.prefill_min_batch): once
        that many can be (scheduler.prefill_by_cost: once their waits outweigh the pause),
        or the delay has passed. Requests that arrive one by one while others decode (a
        burst of clients over HTTP) are prefilled in a few steps, not one each, every one of
        which pauses all decoding."""
        sc = self.cfg.scheduler
        if not self.waiting or not self.running or self.prefilling \
                or self._held_steps >= sc.prefill_max_delay_steps:
            return True  # (with nobody waiting, no delay accrues)
        free = sc.max_running_requests - len(self.running)
        if sc.prefill_by_cost:  # the waits held against the pause of every decoding request
            now = time.time()
            held = sum(now - r.arrival for r in itertools.islice(self.waiting, max(free, 0)))
            return held >= len(self.running) * self.extend_period
        return min(len(self.waiting), free) >= sc.prefill_min_batch

    def _schedule_extend(self) -> StepPlan | None:
        if not self._prefill_due():
            self._held_steps += 1
            return None
        self._held_steps = 0
        plan = StepPlan(self.step_id, "extend", [])
        limit = self.cfg.scheduler.max_running_requests
        while self.waiting and len(self.running) + len(self.prefilling) < limit:
            if not self._admit(self.waiting[0]):
                break
            self.prefilling.append(self.waiting.popleft())
        chosen = self._fill_chunks(plan)
        in_flight = any(r.scheduled > r.prefilled for r in self.prefilling)
        if not chosen and len(self.prefilling) > 1 and not self.running and not in_flight:
            # Prefilling requests block each other's KV: keep the oldest, requeue the rest
            # (their computed KV stays in the prefix cache), and try again.
            for req in reversed(self.prefilling[1:]):
                self._release_kv(req)
                self.waiting.appendleft(req)
            del self.prefilling[1:]
            chosen = self._fill_chunks(plan)
        if not chosen:
            return None
        # Only a chunk that ends its prompt samples: a request's coins do not depend on how
        # its prompt was chunked (which depends on what else was prefilling), so a seed
        # gives the same text under any load.
        plan.coins = self._coins(chosen, plan.last_chunk)
        self._inflight[plan.step_id] = [(r, r.admissions) for r in chosen]
        return plan

    def _fill_chunks(self, plan: StepPlan) -> list[Request]:
        budget = self.cfg.scheduler.chunked_prefill_size
        chosen: list[Request] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            start = req.scheduled  # a chunk may still be in flight (pipelined steps)
            chunk = min(len(req.fill_ids) - start, budget)
            if chunk == 0:
                continue
            if not self._grow_kv(req, start + chunk):
                break  # out of KV: wait for running requests to finish (or be preempted)
            chosen.append(req)
            budget -= chunk
            req.scheduled += chunk
            last = start + chunk == len(req.fill_ids)
            plan.rows.append(req.row)
            plan.input_ids.extend(req.fill_ids[start:start + chunk])
            plan.prefix_lens.append(start)
            plan.extend_lens.append(chunk)
            plan.last_chunk.append(last)
            plan.next_ids.append(-1 if last else req.fill_ids[start + chunk])
        self._add_sampling(chosen, plan)
        if any(self._needs_prompt_logprobs(r) for r in chosen):
            plan.prompt_logprobs = [r.params.prompt_logprobs if self._needs_prompt_logprobs(r) else -1
                                    for r in chosen]
        return chosen

    def _schedule_decode(self) -> StepPlan | None:
        self._grow_running(kv_ahead(self.window))
        running = self.running
        if not running:
            return None
        plan = StepPlan(self.step_id, "decode", [r.row for r in running], use_spec=self.spec)
        if self.draft_policy is not None:
            if self.draft_policy.plain is not None:
                self._stale[plan.step_id] = [r.draft_stale for r in running]
            plan.draft_shape = self.draft_policy.choose(len(running))
            if plan.draft_shape == self.draft_policy.plain:  # draft.plain_steps
                # Not with a grammar, whose rows the rank masks per speculative tree.
                plan.use_spec = bool(self._grammar_rows)
                plan.draft_shape = 0 if plan.use_spec else PLAIN_STEP
        self._add_sampling(running, plan)
        plan.coins = self._coins(running)
        self._inflight[plan.step_id] = [(r, r.admissions) for r in running]
        return plan

    def _grow_running(self, ahead: int) -> None:
        """Reserve KV `ahead` of every running request's committed length. When the KV
        runs out, the newest running request is preempted until the rest fit."""
        running = self.running
        grown: list[tuple[Request, int, list[int]]] = []  # (request, target length, new pages)
        i = 0
        while i < len(running):
            req = running[i]
            need = req.kv_committed_len + ahead
            if need <= req.kv_allocated_len:  # most rows: a page lasts several steps
                i += 1
                continue
            target = self._kv_target(need)
            delta = target - req.kv_allocated_len
            pages = self._take_pages(delta) if delta > 0 else []
            if pages is not None:
                if pages:
                    grown.append((req, target, pages))
                i += 1
                continue
            # Preempted requests come from the back: the rows grown so far stay.
            victim = running[-1]
            self._preempt(victim)
            if victim is req:
                continue
        if grown:
            new = self.slots.slots_of([pages for _, _, pages in grown])
            for (req, target, _), slots in zip(grown, new):
                self._grow_kv(req, target, slots)

    def _preempt(self, req: Request) -> None:
        """Out of KV: free this request's KV; it re-prefills its tokens later (lossless)."""
        self.running.remove(req)
        self._release_kv(req)
        req.num_preemptions += 1
        self.stats["preemptions"] += 1
        self.waiting.appendleft(req)
        log.info("preempted %s (%d tokens) for lack of KV", req.rid, len(req.all_ids))

    def _add_sampling(self, reqs: list[Request], plan: StepPlan) -> None:
        params = [r.params for r in reqs]
        plan.temperature += [p.temperature for p in params]
        plan.top_p += [p.top_p for p in params]
        plan.top_k += [p.top_k for p in params]
        plan.processing = any(p.processes_logits for p in params)
        if any(p.min_p for p in params):
            plan.min_p = np.asarray([p.min_p for p in params], dtype=np.float32)
        if any(p.logprobs is not None for p in params):
            plan.logprobs = [-1 if p.logprobs is None else p.logprobs for p in params]

    def _coins(self, reqs: list[Request], draw: list[bool] | None = None) -> np.ndarray:
        """Each sampled request's next coins (those `draw` marks, when given); zeros else."""
        coins = np.zeros((len(reqs), self.coins_per_request), dtype=np.float32)  # [B, C]
        for i, req in enumerate(reqs):
            if req.coin_stream is not None and (draw is None or draw[i]):
                coins[i] = req.coin_stream.next()
        return coins

    # ---- results ---------------------------------------------------------------------------
    def process_output(self, plan: StepPlan, out: StepOutput) -> list[RequestOutput]:
        reqs = self._inflight.pop(plan.step_id)
        decoding = bool(self.running)  # before this step's prompts join them
        events: list[RequestOutput] = []
        # Rows before `first_chunk` decoded, the rest ran prefill chunks (chunk i - first_chunk).
        first_chunk = {"extend": 0, "mixed": plan.num_decode}.get(plan.mode, len(plan.rows))
        stale = self._stale.pop(plan.step_id, None)
        if first_chunk and self.draft_policy is not None:
            learn = range(first_chunk)
            if stale is not None:  # leave out the rows that drafted from a stale top-k
                learn = [i for i, s, (req, admission) in zip(learn, stale, reqs)
                         if not s and req.admissions == admission]
            self.draft_policy.observe(out.draft_shape, [len(out.tokens[i]) for i in learn])
            if out.nested_accepts is not None:
                self.draft_policy.observe_nested(out.draft_shape, [out.nested_accepts[i] for i in learn])
        lps = out.logprobs
        for i, ((req, admission), toks) in enumerate(zip(reqs, out.tokens)):
            if req.finished or req.admissions != admission or req.row != plan.rows[i]:
                continue  # aborted, preempted or requeued since the plan was made
            if i >= first_chunk:
                c = i - first_chunk
                if out.prompt_logprobs is not None and out.prompt_logprobs[c] is not None:
                    # Entry j is prompt token j + 1's; a chunk from position p predicts
                    # tokens p + 1 on (a recomputed prefill rewrites what it covers).
                    p = plan.prefix_lens[c]
                    req.prompt_logprobs[p:] = out.prompt_logprobs[c][:max(0, len(req.prompt_ids) - 1 - p)]
                req.prefilled += plan.extend_lens[c]
                req.kv_committed_len = req.prefilled
                computed = plan.extend_lens[c]
                req.computed_prompt_tokens += computed
                self.stats["prompt_tokens_computed"] += computed
                if not plan.last_chunk[c]:
                    continue
                self.prefilling.remove(req)
                self.running.append(req)
                accepted = []
            else:
                req.kv_committed_len += len(toks)
                accepted = [len(toks)] if self.spec else []
                req.accept_lengths += accepted
                # The common decode case, without building an output nobody gets: no
                # stream, text deferred to the end (see _emit), and the request goes on.
                if (req.quiet and req.first_token_time is not None and req.stop_ids.isdisjoint(toks)
                        and len(req.output_ids) + len(toks) < req.max_output):
                    req.output_ids += toks
                    if lps is not None and lps[i] is not None:
                        req.token_logprobs += lps[i]
                    continue
            ev = self._emit(req, toks, accepted, lps[i] if lps is not None else None)
            if ev is not None:
                events.append(ev)
        self._observe_period(plan, out, decoding)
        return events

    def _observe_period(self, plan: StepPlan, out: StepOutput, decoding: bool) -> None:
        """How long a step took through the whole step loop, from the last step's output
        committed to this one's: a decode step's teaches the draft policy, a prefill step's
        while others decoded (`decoding`) is the pause that scheduler.prefill_by_cost weighs."""
        if self.draft_policy is None and not self.cfg.scheduler.prefill_by_cost:
            return
        now, last = time.perf_counter(), self._last_output
        self._last_output = now
        if not last:
            return
        if plan.mode == "decode" and self.draft_policy is not None:
            self.draft_policy.observe_period(out.draft_shape, len(plan.rows), now - last)
        elif plan.mode == "extend" and decoding:
            self.extend_period = moving_period(self.extend_period, now - last)

    def _emit(self, req: Request, toks: list[int], accepted: list[int],
              logprobs: list | None = None) -> RequestOutput | None:
        if req.first_token_time is None and toks:
            req.first_token_time = time.time()
        new_ids: list[int] = []
        reason = None
        stop_token = False  # the last token ended the request and is not part of the text
        for t in toks:
            req.output_ids.append(t)
            new_ids.append(t)
            if t in req.stop_ids:
                reason, stop_token = "stop", True
            elif len(req.output_ids) >= req.max_output:  # max_tokens, or the model's context
                reason = "length"
            if reason:
                break
        text = ""
        # Nobody reads the text before the end, and no stop string can cut it short:
        # detokenize once when the request finishes instead of at every step.
        # (The finishing output then carries the whole text.)
        deferred = req.text_stream is not None and req.quiet
        if req.text_stream is not None and (reason or not deferred):
            ids = req.output_ids if deferred else new_ids
            text, stopped = req.text_stream.feed(text_ids(ids, stop_token), final=bool(reason))
            if stopped:
                reason = "stop"
            req.text += text
        if reason:
            self._finish(req, reason)
        if logprobs is not None:
            logprobs = logprobs[:len(new_ids)]
            req.token_logprobs += logprobs
        if req.on_output is None and not reason:
            return None
        out = RequestOutput(rid=req.rid, new_token_ids=new_ids, new_text=text, finished=reason is not None,
                            finish_reason=reason, num_prompt_tokens=len(req.prompt_ids),
                            num_output_tokens=len(req.output_ids), accept_lengths=accepted,
                            cached_tokens=req.prompt_cached, logprobs=logprobs)
        if req.params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            out.prompt_logprobs = [None] + req.prompt_logprobs
            req.prompt_logprobs_sent = True
        if req.on_output is not None:
            req.on_output(out)
        return out

    def _finish(self, req: Request, reason: str) -> None:
        req.finished = True
        req.finish_reason = reason
        for q in (self.running, self.prefilling):
            if req in q:
                q.remove(req)
        if req.row is None and req in self.waiting:  # only rowless requests wait: skip the scan
            self.waiting.remove(req)
        self._release_kv(req)
        self.requests.pop(req.rid, None)
        if reason == "abort" and req.on_output is not None:
            req.on_output(RequestOutput(rid=req.rid, new_token_ids=[], new_text="", finished=True,
                                        finish_reason="abort", num_prompt_tokens=len(req.prompt_ids),
                                        num_output_tokens=len(req.output_ids)))
