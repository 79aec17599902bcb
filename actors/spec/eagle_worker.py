"""One EAGLE speculative iteration (spec v2), DESIGN.md section 3.

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
"""
from __future__ import annotations

import time

import torch

from actors.dp.sync import ForwardMode, draft_extend_ids
from actors.forward_batch import ForwardBatch
from actors.kv_cache import TokenToKVPool
from actors.model_runner import ModelRunner
from actors.models.eagle import load_eagle_head, resolve_draft_path
from actors.step_plan import StepPlan
from configs.schema import KestrelConfig
from kernels.sampling import process_logits
from kernels.spec_tree import build_tree, expand_level, organize_draft
from kernels.verify import greedy_verify, select_last_index, tree_sampling_verify


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
    def __init__(self, cfg: KestrelConfig, worker):
        from actors.rank_worker import make_backend
        self.cfg = cfg
        self.w = worker
        d = cfg.draft
        self.K, self.S, self.N = d.topk, d.num_steps, d.num_draft_tokens
        self.head = load_eagle_head(resolve_draft_path(d.path, cfg.model.path), worker.model,
                                    d.arch, worker.dtype, worker.device, seed=cfg.seed)
        s = self.head.spec
        self.hidden_size = s.hidden_size
        self.aux_layers = self.head.aux_layers
        self.kv_pool = TokenToKVPool(worker.num_slots, 1, s.num_kv_heads, s.head_dim,
                                     worker.dtype, worker.device)
        scale = s.head_dim ** -0.5
        # C11: the runner's backend is the draft-extend backend; draft decode has its own.
        self.extend_backend = make_backend(cfg.attention.backend, self.kv_pool, worker.req_to_token, scale)
        self.decode_backend = make_backend(cfg.attention.backend, self.kv_pool, worker.req_to_token, scale)
        self.runner = ModelRunner(self.head, self.extend_backend)
        self.decode_runner = ModelRunner(self.head, self.decode_backend)
        self.last_timings: dict[str, float] = {}  # per-phase seconds of the last iteration

    def _features(self, hidden: torch.Tensor, aux: list[torch.Tensor]) -> torch.Tensor:
        """What the head reads from the target: final hidden (EAGLE-1) or 3 layers (EAGLE-3)."""
        return torch.cat(aux, -1) if self.aux_layers else hidden

    # ---- after a prefill chunk -------------------------------------------------------------
    def extend_after_prefill(self, plan: StepPlan, fb: ForwardBatch, hidden, aux, tokens, done,
                             ends):
        """Draft extend over a prefill chunk: ids shifted by one (the token after each
        position: the next prompt token, or the sampled first output on the last chunk).
        `ends` [B] are the chunks' last rows, `done` the requests whose prompt is complete."""
        w = self.w
        nxt = torch.tensor(plan.next_ids, dtype=torch.int64, device=w.device)
        nxt = torch.where(nxt >= 0, nxt, tokens)
        shifted = torch.roll(fb.input_ids, -1)  # a new tensor: fb keeps its ids
        shifted[ends] = nxt
        dfb = ForwardBatch(ForwardMode.DRAFT_EXTEND, draft_extend_ids(shifted), fb.positions,
                           fb.out_cache_loc, fb.req_pool_indices, fb.prefix_lens,
                           list(plan.extend_lens), hidden_in=self._features(hidden, aux))
        h = self.runner.forward(dfb, hidden_in=dfb.hidden_in)  # [T, H]
        last = h[ends]
        topk_p, topk_index = self.head.topk(last, self.K)
        w.future.store(fb.req_pool_indices[done], fb.seq_lens[done], tokens[done],
                       topk_p[done], topk_index[done], last[done])

    # ---- one speculative decode iteration ---------------------------------------------------
    def decode(self, plan: StepPlan) -> list[list[int]]:
        w, K, S, N = self.w, self.K, self.S, self.N
        dev = w.device
        rows = torch.tensor(plan.rows, dtype=torch.int64, device=dev)  # [B] int64
        B = rows.numel()
        c = w.future.resolve(rows)
        seq = c.seq_lens  # [B] int64
        table = w.req_to_token.req_to_token
        clock = PhaseClock(self.cfg.profile_steps, w.device)
        draft_tokens, parent_node = self._draft(rows, seq, c)
        tree = build_tree(c.bonus, draft_tokens, parent_node, seq)
        clock.mark("draft_decode")
        # -- verify
        loc = table[rows[:, None], seq[:, None] + torch.arange(N, device=dev)]  # [B, N] int64
        vfb = ForwardBatch(ForwardMode.TARGET_VERIFY, tree.tokens.reshape(-1),
                           tree.positions.reshape(-1), loc.reshape(-1), rows, seq, [N] * B,
                           custom_mask=tree.tree_mask)
        hidden, aux = w.target.forward(vfb, aux_layers=self.aux_layers)
        logits = w.model.compute_logits(hidden).view(B, N, -1)  # [B, N, V] fp32
        clock.mark("verify")
        accept_index, accept_length, predict = self._accept(plan, tree, logits)
        # -- move accepted target KV to the slots of their final positions
        j = torch.arange(S + 1, device=dev).expand(B, -1)
        moved = (accept_index >= 0) & (accept_index != j)
        if bool(moved.any()):
            b_idx = torch.arange(B, device=dev)[:, None].expand(B, S + 1)[moved]
            w.kv_pool.move(loc[b_idx, accept_index[moved]], loc[b_idx, j[moved]])
        # -- draft extend over N rows per request
        efb = prepare_draft_extend(rows, seq, loc, accept_index, predict,
                                   self._features(hidden, aux), N)
        h = self.runner.forward(efb, hidden_in=efb.hidden_in)  # [B*N, H]
        last = h[select_last_index(accept_length, N)]  # [B, H]
        topk_p, topk_index = self.head.topk(last, K)
        bonus = predict.gather(1, (accept_length - 1)[:, None])[:, 0]
        w.future.store(rows, seq + accept_length, bonus, topk_p, topk_index, last)
        clock.mark("accept_and_draft_extend")
        self.last_timings = clock.times
        pl, al = predict.tolist(), accept_length.tolist()
        return [pl[b][:al[b]] for b in range(B)]

    def _draft(self, rows, seq, c):
        """S-1 draft forwards growing the tree; returns (draft_tokens [B,N-1], parent_node)."""
        w, K, S, N = self.w, self.K, self.S, self.N
        dev = w.device
        B, H = rows.numel(), self.hidden_size
        scores, tokens = c.topk_p, c.topk_index  # [B, K]
        lane_flat = torch.arange(K, device=dev).expand(B, K)
        lane_hidden = c.hidden[:, None, :].expand(B, K, H)
        all_scores, all_tokens = [scores], [tokens]
        all_parents = [torch.full((B, K), -1, dtype=torch.int64, device=dev)]
        scratch_w = (S - 1) * K
        scratch = w.req_to_token.req_to_token[
            rows[:, None], seq[:, None] + torch.arange(scratch_w, device=dev)]  # [B, (S-1)K]
        anc = torch.zeros(B, K, 0, dtype=torch.bool, device=dev)  # ancestors among scratch cols
        eye = torch.eye(K, dtype=torch.bool, device=dev).expand(B, K, K)
        offset = K
        for i in range(S - 1):
            cols = (i + 1) * K
            mask = torch.cat([anc, eye], dim=2)  # [B, K, cols]: ancestors + itself
            fb = ForwardBatch(ForwardMode.DECODE, tokens.reshape(-1),
                              (seq + i).repeat_interleave(K), scratch[:, i * K:cols].reshape(-1),
                              rows, seq, [K] * B, new_kv_slots=scratch[:, :cols], custom_mask=mask)
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

    def _accept(self, plan: StepPlan, tree, logits):
        S = self.S
        B, N = tree.tokens.shape
        accept_index, accept_length, predict = greedy_verify(
            tree.tokens, logits.argmax(-1), tree.first_child, tree.next_sibling, S)
        hot = [i for i, t in enumerate(plan.temperature) if t > 0]
        if hot:
            dev = logits.device
            idx = torch.tensor(hot, dtype=torch.int64, device=dev)
            rep = lambda vals, dt: torch.tensor([vals[i] for i in hot], dtype=dt, device=dev).repeat_interleave(N)
            probs = process_logits(logits[idx].reshape(len(hot) * N, -1),
                                   rep(plan.temperature, torch.float32), rep(plan.top_p, torch.float32),
                                   rep(plan.top_k, torch.int64)).view(len(hot), N, -1)
            coins = plan.coins[idx].to(dev)  # [b, N+1]: N node coins, then the final coin
            ai, al, pr = tree_sampling_verify(tree.tokens[idx], probs, tree.first_child[idx],
                                              tree.next_sibling[idx], S, coins[:, :N], coins[:, N])
            accept_index[idx], accept_length[idx], predict[idx] = ai, al, pr
        return accept_index, accept_length, predict


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
