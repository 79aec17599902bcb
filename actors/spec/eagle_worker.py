"""One EAGLE speculative iteration (spec v2), docs/design.md, "One speculative iteration".

Per request, with seq_len tokens in KV and the bonus token b (no KV yet):
  draft decode  S-1 draft forwards grow a tree from the carried top-k; step i runs the
                K lane tokens at draft position seq_len+i, writing draft KV into scratch
                slots of the request's window and attending to their own ancestors only.
  build tree    best N-1 candidates + root b; positions seq_len + depth.
  verify        target forward over B*N nodes with the tree mask, KV into the window.
  accept        greedy walk or tree rejection sampling; accepted nodes' target KV is
                moved to the slots of their final positions.
  draft extend  draft forward over N tokens per request (the target's predictions paired
                with the target features of the accepted nodes; rows past the accept
                length are padding), then the row of the last accepted node yields the
                next top-k and hidden state, stored in the future map.

Draft decode, verify and draft extend each have one forward body (`draft_body`,
`verify_body`, `extend_body`) that runs eagerly or is captured by a GraphRunner
(actors/spec/spec_graphs.py); a batch replays when a captured size holds it, padded by the
runner (C04-C08), and runs eagerly above the largest size. Verify and draft-extend inputs
are prepared through the plan stream (C15-C17): on a side stream when
`attention.plan_stream` is on, inline otherwise.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch

from actors.graphs.cuda_graph_runner import GraphBatch, VerifyPath
from actors.dp.sync import draft_extend_ids
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.worker.host_copy import to_device
from actors.worker.launched_step import Emitted, accepted_tokens, mixed_tokens
from actors.sampling.logprobs import MAX_TOP, asked_top, node_logprobs
from actors.worker.kv_cache import TokenToKVPool
from actors.worker.model_runner import ModelRunner
from actors.models.eagle import EagleHead
from actors.graphs.plan_stream import PlanStream, VerifyInputs, prepare_draft_extend_inputs
from actors.sampling.sampler import sampling_flags, truncates
from actors.spec.spec_graphs import SpecGraphs, capture_spec_graphs
from actors.spec.draft_shapes import (PlainStep, eager_step_costs, plain_step_costs, shape_view,
                                      step_costs)
from actors.spec.pending_draft_kv import PendingDraftKV
from actors.spec.step_graph import StepGraph, Variant
from actors.protocol.step_plan import StepPlan, nested_shapes
from configs.schema import KestrelConfig
from kestrel_kernels.sampling import process_logits
from kestrel_kernels.spec_tree import TreeInfo
from kestrel_kernels.spec_ops import (assign_cache_locs, build_tree, expand_level, greedy_verify,
                              organize_draft, tree_sampling_verify)
from kestrel_kernels.token_bitmask import mask_logits_
from kestrel_kernels.verify import nested_accept_lengths, select_last_index

log = logging.getLogger("kestrel.worker")


@dataclasses.dataclass
class Drafted:
    """What the draft part of a graph iteration (EagleWorker.step_draft) leaves for the rest."""
    rows: torch.Tensor  # [bs] int64 request rows, padded lanes at row 0
    valid: torch.Tensor  # [bs] bool, not a padded lane
    seq: torch.Tensor  # [bs] int64 lengths (FILL in padded lanes)
    tree: TreeInfo
    loc: torch.Tensor  # [bs*N] int64 tree node slots
    node_rank: torch.Tensor  # [bs, N-1] int64 each draft node's rank by score (organize_draft)


class PhaseClock:
    """Wall time per phase of a step, synchronizing the device at each mark (benchmarks only)."""

    def __init__(self, enabled: bool, device: torch.device):
        self.enabled, self.device, self.times = enabled, device, {}
        self._t = time.perf_counter() if enabled else 0.0

    def mark(self, name: str) -> None:
        if not self.enabled:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.times[name] = now - self._t
        self._t = now


class EagleWorker:
    def __init__(self, cfg: KestrelConfig, worker, head: EagleHead):
        """`head`: the draft head, loaded for `worker`'s target (RankWorker._load)."""
        from actors.worker.rank_worker import make_backend
        self.cfg = cfg
        self.w = worker
        d = cfg.draft
        self.K, self.S, self.N = d.topk, d.num_steps, d.num_draft_tokens
        self.head = head
        s = self.head.spec
        self.hidden_size = s.hidden_size
        self.aux_layers = self.head.aux_layers
        self.kv_pool = TokenToKVPool(worker.num_slots, 1, s.num_kv_heads, s.head_dim,
                                     worker.kv_dtype, worker.device)  # kv_cache.dtype, as the target's
        scale = s.head_dim ** -0.5
        # C11: the runner's backend is the draft-extend backend; draft decode has its own.
        self.extend_backend = make_backend(cfg.attention.backend, self.kv_pool, worker.req_to_token,
                                           scale, page_size=cfg.kv_cache.page_size,
                                           max_kv_splits=cfg.attention.max_kv_splits)
        # A packed model's draft steps attend with the CPU kernel too (no gather and padding).
        self.decode_backend = make_backend(cfg.attention.backend, self.kv_pool, worker.req_to_token,
                                           scale, page_size=cfg.kv_cache.page_size,
                                           max_kv_splits=cfg.attention.max_kv_splits,
                                           cpu_kernel=worker.cpu_weights == "packed")
        self.runner = ModelRunner(self.head, self.extend_backend)
        self.decode_runner = ModelRunner(self.head, self.decode_backend)
        # What draft extend reads per token: the target's final hidden, or EAGLE-3's layers.
        self.feature_size = worker.arch.hidden_size * max(1, len(self.aux_layers))
        # Verify and draft-extend inputs are prepared here, on a side stream when on (C16/C17).
        self.plan = PlanStream(cfg.attention.plan_stream, worker.device)
        self.verify_path = VerifyPath(worker.target.backend, self._verify_forward, plan=self.plan)
        self.graphs: SpecGraphs | None = None  # capture_graphs() sets them
        self.step_graph: StepGraph | None = None  # and this one, where it can run
        # The shapes a plan may ask for (StepPlan.draft_shape): this worker, then views of it
        # at draft.adaptive_shapes once their step graphs are captured (draft_shapes.py),
        # and each one's measured step cost per captured size (None: not measured).
        self.shapes = [self]
        self.shape_costs: list[list[float]] | None = None
        self.plain_costs: list[float] | None = None  # a plain decode step's (draft.plain_steps)
        self.eager_cost_sizes: list[int] | None = None  # the batch sizes of eager shapes' costs
        self.last_shape = 0  # the shape the last launched iteration ran at
        self.nested_nodes = self.nested_node_counts()
        # Plain steps' draft KV rows not yet written (the CPU: pending_draft_kv.py says why).
        self.pending_kv = PendingDraftKV() if worker.device.type == "cpu" else None
        self.last_timings: dict[str, float] = {}  # per-phase seconds of the last iteration

    def nested_node_counts(self) -> list[int]:
        """Node counts of the configured shapes nested in this one's tree (nested_shapes),
        whose accept lengths each iteration reports beside its own; none under
        dp_attention, where every step takes the configured shape."""
        if self.cfg.parallel.dp_attention:
            return []
        shapes = self.cfg.draft.shapes()
        return [shapes[j][2] for j in nested_shapes(shapes, shapes.index((self.K, self.S, self.N)))]

    def _outputs(self, accept_length: torch.Tensor, predict: torch.Tensor, accept_index: torch.Tensor,
                 node_rank: torch.Tensor) -> torch.Tensor:
        """An iteration's one output for the host -> [B, S+2+J] int64: each row's accept
        length, its S+1 predicted tokens, then the accept lengths of the J nested shapes
        (none computed where there are none: most presets, every CPU default)."""
        parts = [accept_length[:, None], predict]
        if self.nested_nodes:
            parts.append(nested_accept_lengths(accept_index, node_rank, self.nested_nodes))  # [B, J] int64
        return torch.cat(parts, 1)

    def features(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """What the head reads from the target: final hidden (EAGLE-1) or 3 layers (EAGLE-3)."""
        return torch.cat(aux, -1) if self.aux_layers else hidden

    # ---- after a prefill chunk -------------------------------------------------------------
    def extend_after_prefill(self, plan: StepPlan, fb: ForwardBatch, hidden, aux, tokens, done,
                             ends, num_decode: int = 0):
        """Draft extend over a prefill chunk: ids shifted by one (the token after each
        position: the next prompt token, or the sampled first output on the last chunk).
        `ends` [B] are the chunks' last rows, `done` [D] int64 the plan positions of the
        requests whose prompt is complete. A mixed step without speculation (a plain step
        the draft policy chose) puts `num_decode` decode rows first, one-token chunks whose
        next token is the one just sampled: the draft follows them too."""
        w = self.w
        nxt = to_device([-1] * num_decode + list(plan.next_ids), torch.int64, w.device)
        nxt = torch.where(nxt >= 0, nxt, tokens)
        shifted = torch.roll(fb.input_ids, -1)  # a new tensor: fb keeps its ids
        shifted[ends] = nxt
        dfb = ForwardBatch(ForwardMode.DRAFT_EXTEND, draft_extend_ids(shifted), fb.positions,
                           fb.out_cache_loc, fb.req_pool_indices, fb.prefix_lens,
                           [1] * num_decode + list(plan.extend_lens), hidden_in=self.features(hidden, aux))
        h = self.runner.forward(dfb, hidden_in=dfb.hidden_in)  # [T, H]
        last = h[ends]
        topk_p, topk_index = self.head.topk(last, self.K)
        w.future.store(fb.req_pool_indices[done], fb.seq_lens[done], tokens[done],
                       topk_p[done], topk_index[done], last[done])

    def follow_plain_step(self, tokens: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                          feats: torch.Tensor) -> None:
        """After a plain decode step (draft.plain_steps): the draft's KV at each request's
        position, from the token just sampled and the target's features there (`feats` [B, F]),
        as draft extend would have stored it. Without it the draft would attend over a gap
        at its newest position for the rest of the request. Its top-k stays that of the
        last speculative step: the next one drafts from it once. On the CPU the write waits
        for the next step that runs the draft (pending_draft_kv.py, flush_plain_kv)."""
        if self.pending_kv is None:
            self._write_kv(tokens, positions, loc, feats)
        elif self.pending_kv.add(tokens, positions, loc, feats):
            self.flush_plain_kv()

    def flush_plain_kv(self) -> None:
        """Write the draft's KV of the plain steps' rows that wait (before a draft forward)."""
        rows = self.pending_kv.take() if self.pending_kv is not None else None
        if rows is None:
            return
        switch = self.w.model.kernel_switch
        on = switch is not None and switch.on
        if switch is not None:  # the kernels, as an immediate write in the plain step would
            switch.on = True
        self._write_kv(*rows)
        if switch is not None:
            switch.on = on

    def _write_kv(self, tokens, positions, loc, feats) -> None:
        k, v = self.head.kv(draft_extend_ids(tokens), positions, feats)
        self.kv_pool.store(0, loc, k, v)

    # ---- graphs and the plan stream ---------------------------------------------------------
    def capture_graphs(self, sizes: list[int], *, use_cuda_graph: bool | None = None,
                       step_graph: bool | None = None) -> None:
        """Replay verify, draft decode and draft extend for batches up to max(sizes) from now
        on, and whole iterations as one graph (``step_graph``, default
        ``attention.spec_step_graph``) where the backends plan on the device: greedy ones,
        and with ``attention.feature_graphs`` sampled ones too.
        ``use_cuda_graph`` None: CUDA graphs on a GPU; on CPU the runners' eager stand-in,
        which runs the same padded batches (how CPU tests check the wiring)."""
        # Every verify graph (the per-phase runner's and the step graph's verify part, kept
        # for grammar rows) writes its logits here, not into an output of its own: one
        # [bs*N, V] float32 output per size would hold 14 GiB over 27 sizes up to 512 at
        # N=16 with SmolLM2's vocabulary (three times that with Qwen2's). One rank runs
        # one step at a time, and each step reads its logits before the next one's verify
        # is queued behind them on the same stream.
        self.verify_logits = torch.empty(max(sizes) * self.N, self.w.arch.vocab_size, dtype=torch.float32,
                                         device=self.w.device)  # [max_bs*N, V] fp32
        self.graphs = capture_spec_graphs(self, sizes, use_cuda_graph=use_cuda_graph)
        self.verify_path = VerifyPath(self.verify_path.backend, self._verify_forward,
                                      runner=self.graphs.verify, plan=self.plan)
        self.step_graph = None
        if not (self.cfg.attention.spec_step_graph if step_graph is None else step_graph):
            return
        real = self.graphs.verify.use_cuda_graph
        backends = (self.w.target.backend, self.decode_backend, self.extend_backend)
        if real and not all(b.plans_on_device for b in backends):
            log.info("rank %d: no speculative step graph: attention.backend=%s plans on the "
                     "host; one graph per forward", self.w.rank, self.cfg.attention.backend)
            return
        t0 = time.time()
        variants = (Variant(),)
        if self.w.feature_graphs:
            # Greedy, sampled and sampled with truncation, each with and without processing
            # and logprobs (step_graph.py says why these twelve).
            variants = tuple(Variant(processed, logprobs, sampled, filtered)
                             for sampled, filtered in ((False, False), (True, False), (True, True))
                             for processed, logprobs in itertools.product((False, True), repeat=2))
            self.w.counts.ensure()  # the graphs read the counts' tensors: they must exist now
        words = -(-self.w.arch.vocab_size // 32) if self.w.feature_graphs else 0  # grammar masks
        self.step_graph = StepGraph(self, sizes, self.w.device, real, variants, words)
        with torch.inference_mode():
            self.step_graph.capture()
        log.info("rank %d: captured speculative step graphs for batch sizes %s, %d variants "
                 "in %.1fs%s", self.w.rank, self.step_graph.sizes, len(variants),
                 time.time() - t0, "" if real else " (eager stand-in)")
        if not self.cfg.parallel.dp_attention:  # a group steps one shape: the policy is per rank
            self._capture_shapes(sizes, real, variants, words)

    def _capture_shapes(self, sizes: list[int], real: bool, variants: tuple, words: int) -> None:
        """Step graphs for draft.adaptive_shapes, in the configured shape's memory pool, and
        (on a GPU) every shape's step cost per size, for the scheduler's DraftPolicy."""
        t0 = time.time()
        self.shapes = [self]
        for steps, nodes in self.cfg.draft.adaptive_shapes:
            view = shape_view(self, steps, nodes)
            # No grammar parts: a step with grammar rows runs at the configured shape.
            view.step_graph = StepGraph(view, sizes, self.w.device, real, variants)
            with torch.inference_mode():
                view.step_graph.capture(pool=self.step_graph.pool)
            self.shapes.append(view)
        plain = self.cfg.draft.plain_steps
        if len(self.shapes) == 1 and not plain:
            return
        self.shape_costs = self.eager_cost_sizes = self.plain_costs = None
        if real:
            with torch.inference_mode():
                self.shape_costs = [step_costs(shape.step_graph) for shape in self.shapes]
                if plain:
                    self.plain_costs = plain_step_costs(self.w, self.step_graph.sizes)
        log.info("rank %d: adaptive draft shapes %s (topk, steps, nodes)%s captured in %.1fs; "
                 "step ms at sizes %s: %s", self.w.rank,
                 [(s.K, s.S, s.N) for s in self.shapes], " and plain steps" if plain else "",
                 time.time() - t0, sizes,
                 None if self.shape_costs is None else
                 [[round(1000 * c, 2) for c in costs] for costs in
                  self.shape_costs + ([self.plain_costs] if plain else [])])

    def eager_shapes(self, sizes: list[int]) -> None:
        """draft.adaptive_shapes on a rank without step graphs (the CPU): views whose
        iterations run eagerly, and every shape's eager step cost at `sizes`, for the
        scheduler's DraftPolicy."""
        t0 = time.time()
        self.shapes = [self] + [shape_view(self, steps, nodes)
                                for steps, nodes in self.cfg.draft.adaptive_shapes]
        plain = self.cfg.draft.plain_steps
        if len(self.shapes) == 1 and not plain:
            return
        timed = self.shapes + ([PlainStep(self.w)] if plain else [])
        with torch.inference_mode():
            costs = eager_step_costs(timed, sizes, self.w.device, self.w.rank)
        self.shape_costs = costs[:len(self.shapes)]
        self.plain_costs = costs[-1] if plain else None
        self.eager_cost_sizes = sizes
        log.info("rank %d: adaptive draft shapes %s (topk, steps, nodes)%s, eager; step ms at "
                 "batch sizes %s: %s, measured in %.1fs", self.w.rank,
                 [(s.K, s.S, s.N) for s in self.shapes], " and plain steps" if plain else "", sizes,
                 [[round(1000 * c, 1) for c in per_size] for per_size in costs], time.time() - t0)

    # ---- one speculative decode iteration ---------------------------------------------------
    def decode(self, plan: StepPlan) -> Emitted:
        """One iteration for the plan's rows, queued on the device -> the accepted tokens
        of each request, on their way to the host. At the plan's draft shape when that
        shape's step graph holds the step, or eagerly when the shapes have no graphs;
        else at the configured shape, which has every path (per-phase graphs, eager)."""
        clock = PhaseClock(self.cfg.profile_steps, self.w.device)
        self.last_shape = plan.draft_shape
        if plan.draft_shape:
            view = self.shapes[plan.draft_shape]
            g = view.step_graph
            if g is None:  # eager shapes (eager_shapes): any step runs at any of them
                emitted = view._decode(plan, clock)
                self.last_timings = view.last_timings
                return emitted
            g_bs = g.pad_size(len(plan.rows))
            variant = Variant(plan.processing, plan.logprobs is not None, *sampling_flags(plan))
            if g_bs is not None and not self.w.grammars.any(plan.rows) \
                    and self.w.group_graph_size is None \
                    and not view._leaves_step_graph(plan, g, g_bs, variant):
                return view._replay_step(plan, g, g_bs, variant, clock)
        self.last_shape = 0
        return self._decode(plan, clock)

    def _replay_step(self, plan: StepPlan, g: StepGraph, g_bs: int, variant: Variant,
                     clock: PhaseClock) -> Emitted:
        """The iteration as this shape's step graph (parts when grammar rows need masks)."""
        if variant.sampled:  # the first N+1 of the plan's coins: N node coins, then the final one
            g.load_coins(plan.coins[:, :self.N + 1], len(plan.rows), g_bs)
        if self.w.grammars.any(plan.rows):
            out, *lps = self._run_parts(g, plan, variant)
        else:
            out, *lps = g.run(list(plan.rows), variant, g_bs)
        clock.mark("step_graph")
        self.last_timings = clock.times
        # the iteration's one copy to the host
        return accepted_tokens(plan, out, tuple(lps) or None, len(self.nested_nodes))

    def decode_mixed(self, plan: StepPlan) -> Emitted:
        """A mixed step (StepPlan.parts): the decode rows' iteration at the configured shape,
        whose verify forward also runs the prefill chunks (their rows after the trees,
        attending causally), then the chunks' first tokens and draft extend."""
        decode, chunks = plan.parts()
        self.last_shape = 0
        return self._decode(decode, PhaseClock(self.cfg.profile_steps, self.w.device), chunks)

    def _decode(self, plan: StepPlan, clock: PhaseClock, chunks: StepPlan | None = None) -> Emitted:
        """The configured shape's iteration: its step graph where it holds the step, else
        per phase (graphs per forward where captured). With `chunks` (a mixed step's extend
        part) per phase, verify fused with the chunks' forward."""
        w, K, S, N = self.w, self.K, self.S, self.N
        dev = w.device
        if chunks is None:
            g = self.step_graph
            variant = Variant(plan.processing, plan.logprobs is not None, *sampling_flags(plan))
            g_bs = w.graph_size(g, len(plan.rows))  # None: too large (or an eager dp_attention step)
            leaves = self._leaves_step_graph(plan, g, g_bs, variant) if g_bs is not None else "batch_size"
            if not leaves:
                return self._replay_step(plan, g, g_bs, variant, clock)
            if g is not None and leaves != "batch_size":  # graph_size counted a batch too large
                w.eager.note(leaves)
        rows = to_device(plan.rows, torch.int64, dev)  # [B] int64
        B = rows.numel()
        c = w.future.resolve(rows)
        seq = c.seq_lens  # [B] int64
        table = w.req_to_token.req_to_token
        # The draft scratch: (S-1)*K slots per request from seq_len on, inside its window.
        scratch = assign_cache_locs(table, rows, seq, (S - 1) * K)  # [B*(S-1)*K] int64
        batch = GraphBatch(B, c.topk_index.reshape(-1), seq.repeat_interleave(K), scratch, rows,
                           seq, width=K, topk_p=c.topk_p, topk_index=c.topk_index, hidden=c.hidden)
        draft_tokens, parent_node, node_rank = self._draft(batch)
        tree = build_tree(c.bonus, draft_tokens, parent_node, seq)
        clock.mark("draft_decode")
        # -- verify: the batch moves from draft decode to verify on the plan stream (C16/C17)
        verify = VerifyInputs(tree.tokens.reshape(-1), tree.tree_mask, tree.positions.reshape(-1),
                              tree.retrieve_index, tree.first_child, tree.next_sibling)
        if chunks is not None:
            batch = dataclasses.replace(batch, **self._verify_inputs(batch, verify))
            logits, feats, finish_chunks = self._verify_with_chunks(batch, chunks)
        else:
            verify_bs = w.graph_size(self.verify_path.runner, B)
            prepared = self.verify_path.prepare_verify(batch, verify_bs is not None, verify,
                                                       build=self._verify_inputs, graph_bs=verify_bs)
        # Rows with a grammar: the tree goes to the host behind the draft, and is walked
        # there while verify runs (the masks apply to verify's logits, not its inputs).
        tree_copy = w.grammars.copy_tree(plan.rows, tree.tokens, tree.first_child, tree.next_sibling)
        if chunks is None:
            logits, feats = self.verify_path.forward_verify(prepared, verify_bs)
        grammar_masks = w.grammars.tree_masks(tree_copy)  # [B, N, W] int32 or None
        logits = logits.view(B, N, -1)  # [B, N, V] fp32
        loc = batch.out_cache_loc.view(B, N)  # [B, N] int64 verify slots
        clock.mark("verify")
        accept_index, accept_length, predict, logits = self._accept(plan, rows, tree, logits, grammar_masks)
        w.record(plan, rows, predict, accept_length)
        lps = None
        if plan.logprobs is not None:  # before draft extend, which may reuse the logits' buffer
            lps = node_logprobs(logits, accept_index, predict, asked_top(plan.logprobs))
        self._keep_accepted_kv(loc, accept_index)
        # -- draft extend over N rows per request
        topk_p, topk_index, last = self._draft_extend(batch, accept_index, accept_length,
                                                      predict, feats)
        self._carry(rows, seq, accept_length, predict, topk_p, topk_index, last)
        clock.mark("accept_and_draft_extend")
        out = self._outputs(accept_length, predict, accept_index, node_rank)  # [B, S+2+J] int64
        J = len(self.nested_nodes)
        if chunks is not None:
            tokens, emits = finish_chunks()
            clock.mark("chunks")
            self.last_timings = clock.times
            return mixed_tokens(out, tokens, emits, J)
        self.last_timings = clock.times
        return accepted_tokens(plan, out, lps, J)

    def _verify_with_chunks(self, verify: GraphBatch, chunks: StepPlan):
        """One target forward over the trees of `verify` (a verify batch) and the prefill
        chunks of `chunks` after them -> (verify's logits [B*N, V] fp32 and draft features
        [B*N, F], and a function that completes the chunks: their first tokens where a
        prompt ends, their draft extend and future-map entries -> (tokens [Bc] int64, which
        of them are emitted))."""
        w = self.w
        efb = w.extend_batch(chunks)
        B, N = verify.batch_size, verify.width
        BN = B * N
        fb = ForwardBatch(ForwardMode.EXTEND, torch.cat([verify.input_ids, efb.input_ids]),
                          torch.cat([verify.positions, efb.positions]),
                          torch.cat([verify.out_cache_loc, efb.out_cache_loc]),
                          torch.cat([verify.req_pool_indices, efb.req_pool_indices]),
                          torch.cat([verify.seq_lens, efb.prefix_lens]),
                          [N] * B + efb.extend_lens,
                          custom_mask=verify.custom_mask.reshape(B, N, N))  # the trees only
        hidden, aux = w.target.forward(fb, aux_layers=self.aux_layers)  # [B*N + T, H]
        logits = w.model.compute_logits(hidden[:BN])  # [B*N, V] fp32
        feats = self.features(hidden[:BN], [a[:BN] for a in aux])

        def finish() -> tuple[torch.Tensor, list[bool]]:
            hid, hid_aux = hidden[BN:], [a[BN:] for a in aux]
            ends = torch.cumsum(efb.seq_lens - efb.prefix_lens, 0) - 1  # [Bc] int64 last row per chunk
            tokens, _ = w.sample(chunks, efb.req_pool_indices, w.model.compute_logits(hid[ends]))
            done = to_device([i for i, e in enumerate(chunks.last_chunk) if e], torch.int64, w.device)
            w.record(chunks, efb.req_pool_indices[done], tokens[done])
            self.extend_after_prefill(chunks, efb, hid, hid_aux, tokens, done, ends)
            return tokens, list(chunks.last_chunk)

        return logits, feats, finish

    def _leaves_step_graph(self, plan: StepPlan, g: StepGraph, g_bs: int, variant: Variant) -> str:
        """Why this iteration cannot replay as the one step graph at size g_bs (an
        eager_steps reason), or "" when it can."""
        w = self.w
        if not g.holds(g_bs, variant):
            return "variant"
        if plan.processing and w.processing.has_extra(plan.rows):
            return "processing"
        if plan.logprobs is not None and asked_top(plan.logprobs) > MAX_TOP:
            return "logprobs"
        if w.grammars.any(plan.rows) and not (g.holds_parts(g_bs, variant)
                                              and w.grammars.fits(g.masks.shape[-1])):
            return "grammar"
        return ""

    def _run_parts(self, g: StepGraph, plan: StepPlan, variant) -> tuple[torch.Tensor, ...]:
        """An iteration with grammar rows as the step graph's three parts: the tree
        goes to the host behind the draft part, and is walked there while the verify part
        runs; the masks go into the accept part's static buffer."""
        B, grammars = len(plan.rows), self.w.grammars
        d = g.run_draft(list(plan.rows))
        tree_copy = grammars.copy_tree(plan.rows, d.tree.tokens, d.tree.first_child, d.tree.next_sibling)
        g.run_verify(B)
        bs = g.pad_size(B)
        grammars.tree_masks(tree_copy, bs, out=g.masks[:bs])
        return g.run_accept(B, variant)

    def _keep_accepted_kv(self, loc: torch.Tensor, accept_index: torch.Tensor) -> None:
        """Move accepted nodes' target KV from their verify slots ``loc`` [B, N] to the
        slots of their final positions. Without a host sync: lanes that stay put copy their
        slot onto itself (the move gathers every source before it writes). At most N
        nodes are accepted, so lanes from N on are left out: each slot is written once."""
        B, N = loc.shape
        A = min(self.S + 1, N)  # lanes that can hold an accepted node
        acc = accept_index[:, :A]  # [B, A] int64
        j = torch.arange(A, device=loc.device).expand(B, -1)  # [B, A] int64
        moved = (acc >= 0) & (acc != j)  # [B, A] bool
        dst = loc[:, :A]  # [B, A] int64
        src = torch.where(moved, loc.gather(1, acc.clamp(min=0)), dst)  # [B, A] int64
        self.w.kv_pool.move(src.reshape(-1), dst.reshape(-1))

    def _carry(self, rows, seq, accept_length, predict, topk_p, topk_index, last) -> None:
        """What the next iteration of each request resolves: its new length, the bonus
        (its last accepted token's successor), the draft's top-k and hidden state."""
        bonus = predict.gather(1, (accept_length - 1)[:, None])[:, 0]  # [B] int64
        self.w.future.store(rows, seq + accept_length, bonus, topk_p, topk_index, last)

    def step_body(self, rows: torch.Tensor, variant: Variant = Variant(),
                  coins: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """One iteration for ``rows`` [bs] int64 (-1: a padded lane), from the future map
        back into it -> ([bs, S+2+J] int64: the accept length, then the S+1 predicted tokens,
        of which the first accept-length are emitted, then the J nested shapes' accept
        lengths (_outputs); with ``variant.logprobs`` then their
        logprobs: chosen [bs, S+1], top MAX_TOP logprobs and ids [bs, S+1, MAX_TOP]).
        ``variant.processed``: each node's logits get the rows' logit processing along its
        path, and the emitted tokens are counted, as on the eager path. ``variant.sampled``:
        rows that sample (the processing table's temperature) accept by tree rejection
        sampling with their ``coins`` [bs, N+1] float32, as on the eager path.

        The eager path's steps without host reads, so StepGraph records it whole, or in
        its three parts (draft, verify, accept) with the grammar masks put in between.
        Padded lanes use row 0 and slot 0 (both reserved), length FILL and zero draft
        state; row 0's processing is none, it is greedy, and its counts never grow (its
        lanes emit nothing).
        """
        drafted = self.step_draft(rows)
        return self.step_accept(drafted, *self.step_verify(drafted), None, variant, coins)

    def step_draft(self, rows: torch.Tensor) -> Drafted:
        """A graph iteration's draft decode and tree, for ``rows`` as in step_body."""
        w, K, S, N = self.w, self.K, self.S, self.N
        B = rows.numel()
        valid = rows >= 0  # [bs] bool
        rows = rows.clamp(min=0)
        c = w.future.resolve(rows)

        def real(t: torch.Tensor, pad) -> torch.Tensor:
            return torch.where(valid.view(-1, *[1] * (t.dim() - 1)), t, pad)

        fill = self.verify_path.fill
        seq = real(c.seq_lens, fill)  # [bs] int64
        table = w.req_to_token.req_to_token
        scratch = assign_cache_locs(table, rows, seq, (S - 1) * K)  # [bs*(S-1)*K] int64
        topk_index = real(c.topk_index, 0)  # [bs, K] int64
        draft = GraphBatch(B, topk_index.reshape(-1), seq.repeat_interleave(K), scratch, rows,
                           seq, width=K, topk_p=real(c.topk_p, 0), topk_index=topk_index,
                           hidden=real(c.hidden, 0))
        draft_tokens, parent_node, node_rank = self.draft_body(draft)
        tree = build_tree(real(c.bonus, 0), draft_tokens, parent_node, seq)
        loc = assign_cache_locs(table, rows, seq, N)  # [bs*N] int64 tree node slots
        return Drafted(rows, valid, seq, tree, loc, node_rank)

    def step_verify(self, d: Drafted, logits_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's verify forward over the drafted tree -> (logits [bs, N, V] fp32,
        in ``logits_out`` [bs*N, V] when given, draft features [bs*N, F])."""
        B, N = d.tree.tokens.shape
        logits, feats = self.verify_body(GraphBatch(
            B, d.tree.tokens.reshape(-1), d.tree.positions.reshape(-1), d.loc, d.rows, d.seq,
            width=N, custom_mask=d.tree.tree_mask), logits_out)
        return logits.view(B, N, -1), feats

    def step_accept(self, d: Drafted, logits: torch.Tensor, feats: torch.Tensor,
                    masks: torch.Tensor | None, variant: Variant,
                    coins: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """The rest of the iteration after verify: processing, the grammar ``masks`` [bs, N,
        W] int32 (all ones where a row has none), the accept (greedy, and with
        ``variant.sampled`` tree rejection sampling for the rows that sample, with their
        ``coins`` [bs, N+1]), the KV move, draft extend and the future-map store ->
        step_body's outputs."""
        w, S, N = self.w, self.S, self.N
        rows, seq, tree, loc = d.rows, d.seq, d.tree, d.loc
        B = rows.numel()
        if variant.processed:
            logits = w.process(rows, logits, None, tree.tokens, self._path(tree))
        if masks is not None:
            logits = mask_logits_(logits, masks)
        accepted = greedy_verify(tree.tokens, logits.argmax(-1), tree.first_child, tree.next_sibling, S)
        if variant.sampled:
            accepted = self._sampled_accept(rows, tree, logits, coins, variant.filtered, accepted)
        accept_index, accept_length, predict = accepted
        if variant.processed:
            w.counts.record(rows, predict, torch.where(d.valid, accept_length, 0))
        lps = node_logprobs(logits, accept_index, predict, MAX_TOP) if variant.logprobs else ()
        self._keep_accepted_kv(loc.view(B, N), accept_index)
        fb = prepare_draft_extend(rows, seq, loc.view(B, N), accept_index,
                                  draft_extend_ids(predict), feats, N)
        topk_p, topk_index, last = self.extend_body(GraphBatch(
            B, fb.input_ids, fb.positions, loc, rows, seq + N, width=N,
            accept_lens=accept_length, hidden=fb.hidden_in))
        self._carry(rows, seq, accept_length, predict, topk_p, topk_index, last)
        return (self._outputs(accept_length, predict, accept_index, d.node_rank), *lps)  # [bs, S+2+J] int64, ...

    def _sampled_accept(self, rows: torch.Tensor, tree, logits: torch.Tensor, coins: torch.Tensor,
                        filtered: bool, greedy: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Tree rejection sampling of every row of ``rows`` [bs] on its logits [bs, N, V] with
        the processing table's sampling parameters and ``coins`` [bs, N+1], taken where the
        row samples; the ``greedy`` walk's (accept_index, accept_length, predict) elsewhere.
        Both run on every row: which rows sample is on the device only."""
        B, N, V = logits.shape
        temperature, top_p, top_k, min_p = self.w.processing.sampling(rows)  # [B] each
        per_node = lambda x: x[:, None].expand(B, N).reshape(-1)  # [B] -> [B*N]
        probs = process_logits(logits.reshape(B * N, V), per_node(temperature), per_node(top_p),
                               per_node(top_k), per_node(min_p), filtered=filtered).view(B, N, V)  # [B, N, V] float32
        sampled = tree_sampling_verify(tree.tokens, probs, tree.first_child, tree.next_sibling,
                                       self.S, coins[:, :N], coins[:, N])
        hot = temperature > 0  # [B] bool
        return tuple(torch.where(hot.view(B, *[1] * (s.dim() - 1)), s, g) for s, g in zip(sampled, greedy))

    @staticmethod
    def _path(tree) -> torch.Tensor:
        """[B, N, N] bool: node j is on node i's path below the root (processing's path_mask;
        the root is the last emitted token, counted already)."""
        path = tree.tree_mask.clone()
        path[:, :, 0] = False
        return path

    def _draft(self, batch: GraphBatch):
        """Draft decode, replayed when a captured size holds the batch."""
        runner = self.graphs.draft_decode if self.graphs else None
        bs = self.w.graph_size(runner, batch.batch_size)
        if bs is not None:
            return runner.replay(batch, bs=bs)
        return self.draft_body(batch)

    def _verify_inputs(self, batch: GraphBatch, verify: VerifyInputs) -> dict:
        """Verify preparation (plan stream): the draft batch's fields become verify's."""
        N = self.N
        loc = assign_cache_locs(self.w.req_to_token.req_to_token, batch.req_pool_indices,
                                batch.seq_lens, N)  # [B*N] int64 tree node slots
        return {"input_ids": verify.draft_tokens, "positions": verify.positions,
                "out_cache_loc": loc, "custom_mask": verify.tree_mask, "width": N,
                "topk_p": None, "topk_index": None, "hidden": None}

    def _draft_extend(self, verified: GraphBatch, accept_index, accept_length, predict, feats):
        """Draft extend after ``verified`` (the verify batch), its inputs prepared on the plan
        stream (C17) -> (topk_p [B,K], topk_index [B,K], hidden [B,H]) of each request's
        last accepted row."""
        N, B = self.N, verified.batch_size
        rows, seq, loc = verified.req_pool_indices, verified.seq_lens, verified.out_cache_loc
        runner = self.graphs.draft_extend if self.graphs else None
        graph_bs = self.w.graph_size(runner, B)
        use_graph = graph_bs is not None
        ids = draft_extend_ids(predict)  # C01: int64 on the compute stream, before the plan stream
        # Until preparation rebinds them, the batch holds verify's results; its lengths are
        # the forward-side view seq + N (C09: seq itself is never written).
        batch = GraphBatch(B, ids.reshape(-1), verified.positions, loc, rows, seq + N, width=N,
                           accept_lens=accept_length, hidden=feats)

        def build() -> dict:
            fb = prepare_draft_extend(rows, seq, loc.view(B, N), accept_index, ids, feats, N)
            new = {"input_ids": fb.input_ids, "positions": fb.positions, "hidden": fb.hidden_in}
            if use_graph:
                runner.init_replay_metadata(dataclasses.replace(batch, **new), bs=graph_bs)
            return new

        prepare_draft_extend_inputs(self.plan, batch, build)
        if use_graph:
            return runner.replay(batch, bs=graph_bs, metadata_ready=True)
        return self.extend_body(batch)

    # ---- forward bodies: run eagerly, or captured once per graph size ------------------------
    def draft_body(self, b: GraphBatch):
        """S-1 draft forwards growing the tree -> (draft_tokens, parent_node, node_rank),
        [B, N-1] int64 each (organize_draft).

        Lane j of request r starts from the carried top-k token j at position seq_len; step
        i writes scratch slots [i*K, (i+1)*K) and sees its ancestors among the earlier ones.
        """
        K, S, N = self.K, self.S, self.N
        B, H, dev = b.batch_size, self.hidden_size, b.seq_lens.device
        scores, tokens = b.topk_p, b.topk_index  # [B, K]
        lane_flat = torch.arange(K, device=dev).expand(B, K)
        lane_hidden = b.hidden[:, None, :].expand(B, K, H)
        all_scores, all_tokens = [scores], [tokens]
        all_parents = [torch.full((B, K), -1, dtype=torch.int64, device=dev)]
        scratch = b.out_cache_loc.view(B, (S - 1) * K)  # [B, (S-1)K] int64
        anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)  # ancestors among scratch cols
        eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
        offset = K
        for i in range(S - 1):
            cols = (i + 1) * K
            mask = torch.cat([anc, eye], dim=2)  # [B, K, cols]: ancestors + itself
            fb = ForwardBatch(ForwardMode.DECODE, tokens.reshape(-1), b.positions + i,
                              scratch[:, i * K:cols].reshape(-1), b.req_pool_indices, b.seq_lens,
                              [K] * B, new_kv_slots=scratch[:, :cols], custom_mask=mask)
            h = self.decode_runner.forward(fb, hidden_in=lane_hidden.reshape(B * K, H))  # [B*K, H]
            p, idx = self.head.topk(h, K)  # [B*K, K]
            (scores, tokens, lane_flat, parent_lane, cs, ct, cp) = expand_level(
                scores, p.view(B, K, K), idx.view(B, K, K), lane_flat, offset)
            offset += K * K
            all_scores.append(cs)
            all_tokens.append(ct)
            all_parents.append(cp)
            lane_hidden = h.view(B, K, H).gather(1, parent_lane[:, :, None].expand(B, K, H))
            anc = mask.gather(1, parent_lane[:, :, None].expand(B, K, cols))
        return organize_draft(torch.cat(all_scores, 1), torch.cat(all_tokens, 1),
                              torch.cat(all_parents, 1), N)

    def verify_body(self, b: GraphBatch, logits_out: torch.Tensor | None = None):
        """Target forward over the tree -> (logits [B*N, V] fp32, in ``logits_out`` when
        given, draft features [B*N, F])."""
        return self._verify_forward(ForwardBatch(
            ForwardMode.TARGET_VERIFY, b.input_ids, b.positions, b.out_cache_loc,
            b.req_pool_indices, b.seq_lens, [b.width] * b.batch_size, custom_mask=b.custom_mask),
            logits_out)

    def graph_verify_body(self, b: GraphBatch):
        """verify_body for a captured size: its logits in the first rows of verify_logits,
        the one buffer every verify graph writes (capture_graphs says why)."""
        return self.verify_body(b, self.verify_logits[:b.batch_size * b.width])

    def _verify_forward(self, fb: ForwardBatch, logits_out: torch.Tensor | None = None):
        # Eager verify enters here from VerifyPath, which built metadata after DP padding
        # (C15); ModelRunner builds it again: one model entry point for every path, at the
        # cost of a few small metadata ops on eager steps only.
        hidden, aux = self.w.target.forward(fb, aux_layers=self.aux_layers)
        return self.w.model.compute_logits(hidden, logits_out), self.features(hidden, aux)

    def extend_body(self, b: GraphBatch):
        """Draft forward over N rows per request -> (topk_p [B,K], topk_index [B,K], hidden
        [B,H]) at each request's last accepted row."""
        # seq_lens is the view seq + N; padded lanes hold FILL < N, whose prefix is empty.
        prefix = (b.seq_lens - b.width).clamp(min=0)  # [B] int64
        fb = ForwardBatch(ForwardMode.DRAFT_EXTEND, b.input_ids, b.positions, b.out_cache_loc,
                          b.req_pool_indices, prefix, [b.width] * b.batch_size, hidden_in=b.hidden)
        h = self.runner.forward(fb, hidden_in=fb.hidden_in)  # [B*N, H]
        last = h[select_last_index(b.accept_lens, b.width)]  # [B, H]
        topk_p, topk_index = self.head.topk(last, self.K)
        return topk_p, topk_index, last

    def _accept(self, plan: StepPlan, rows, tree, logits, grammar_masks=None):
        S = self.S
        B, N = tree.tokens.shape
        if plan.processing:  # each node processed with the counts along its own path
            logits = self.w.process(rows, logits, plan.rows, tree.tokens, self._path(tree))
        if grammar_masks is not None:  # each node's grammar state after its path
            logits = mask_logits_(logits, grammar_masks)
        accept_index, accept_length, predict = greedy_verify(
            tree.tokens, logits.argmax(-1), tree.first_child, tree.next_sibling, S)
        hot = [i for i, t in enumerate(plan.temperature) if t > 0]
        if hot:
            dev = logits.device
            idx = to_device(hot, torch.int64, dev)
            rep = lambda vals, dt: to_device([vals[i] for i in hot], dt, dev).repeat_interleave(N)
            probs = process_logits(logits[idx].reshape(len(hot) * N, -1),
                                   rep(plan.temperature, torch.float32), rep(plan.top_p, torch.float32),
                                   rep(plan.top_k, torch.int64),
                                   None if plan.min_p is None else rep(plan.min_p, torch.float32),
                                   filtered=truncates(hot, plan.top_p, plan.top_k, plan.min_p)).view(len(hot), N, -1)
            coins = to_device(plan.coins[hot], torch.float32, dev)  # [b, N+1]: N node coins, then the final coin
            ai, al, pr = tree_sampling_verify(tree.tokens[idx], probs, tree.first_child[idx],
                                              tree.next_sibling[idx], S, coins[:, :N], coins[:, N])
            accept_index[idx], accept_length[idx], predict[idx] = ai, al, pr
        return accept_index, accept_length, predict, logits


def prepare_draft_extend(rows: torch.Tensor, seq_lens: torch.Tensor, loc: torch.Tensor,
                         accept_index: torch.Tensor, predict: torch.Tensor,
                         feats: torch.Tensor, N: int) -> ForwardBatch:
    """The draft-extend forward batch: N rows per request at positions seq_len + [0, N).

    Row j < accept_length pairs the target's prediction at accepted node j (the token
    after it) with that node's target feature; later rows are padding whose draft KV
    lands beyond the new length and is overwritten before it is ever read. Reads
    `seq_lens` and never writes it (C09): the view's lengths are seq_lens + N.
    """
    B, dev = rows.numel(), rows.device
    width = min(N, accept_index.shape[1])
    src = torch.zeros(B, N, dtype=torch.int64, device=dev)  # [B, N] verify row per extend row
    src[:, :width] = accept_index[:, :width].clamp(min=0)
    src = src + torch.arange(B, device=dev)[:, None] * N
    ids = torch.zeros(B, N, dtype=torch.int64, device=dev)  # [B, N] int64
    ids[:, :width] = predict[:, :width].clamp(min=0)
    positions = (seq_lens[:, None] + torch.arange(N, device=dev)).reshape(-1)  # [B*N] int64
    return ForwardBatch(ForwardMode.DRAFT_EXTEND, draft_extend_ids(ids.reshape(-1)), positions,
                        loc.reshape(-1), rows, seq_lens, [N] * B,
                        hidden_in=feats[src.reshape(-1)])
