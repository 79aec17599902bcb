"""EAGLE head trainer (EAGLE-3 with training-time test, EAGLE-1/2) and `kestrel train-draft`.

The target is frozen and runs inside every training step (bf16 on GPU, fp32 on CPU): it
yields the head's input features and its own next-token distribution, which the head
learns to match (soft cross-entropy; the data tokens are the target's outputs anyway).

Pairing, as the engine drafts (docs/design.md, "One speculative iteration"; actors/spec/eagle_worker.py): draft
position p reads token t[p+1] with the target feature f[p] (EAGLE-1: final normed hidden;
EAGLE-3: the residual streams entering aux_layers, concatenated); its output hidden h0[p]
predicts t[p+2], i.e. should match the target's distribution at position p+1.

Training-time test (TTT) unrolls the head on its own outputs as draft decode does. Step k
(k >= 1) continues the chain that started at p: its input is token t[p+1+k] with the
head's step-(k-1) output h_{k-1}[p] in place of a target feature, at RoPE position p+k;
it is scored against the target's distribution at p+1+k. Its query attends to the step-0
keys at positions <= p (what draft extend left in the draft KV cache) plus the keys of
its own chain's steps 1..k (its ancestors in the draft tree, and itself): a causal block
followed by k diagonal blocks (training/ttt_attention.py). This is exactly what the
engine's draft decode sees along the accepted path, positions included. Step k's loss has
weight step_decay**k.

EAGLE-1/2 adds feature regression: smooth-L1 of h_k[p] against the target's feature at
p+1+k, plus the token loss weighted 0.5. The EAGLE paper's 0.1 measured lower acceptance
on SmolLM2-135M (MT-bench tree accept 2.95 against 3.13, docs/benchmarks.md, 2026-11-30).
"""
from __future__ import annotations

import argparse
import json
import logging
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from actors.models.eagle import EagleHead, EagleSpec, read_eagle_spec, read_head_state
from actors.models.llama import LlamaForCausalLM
from training.categories import CATEGORIES, DEFAULT_MIX, parse_mix
from training.legs import LEG_HEAD, POSITION
from training.soft_ce import soft_ce
from training.ttt_attention import CausalAttention, TTTAttention, ttt_attention, ttt_attention_dense
from training.vocab import DraftVocab

log = logging.getLogger("kestrel.training")
# Steps of a learning-rate ramp after a start without the optimizer's moments (a run
# continued from an exported head): Adam's first updates are the size of the learning rate
# in every weight, whatever the gradient's size.
REWARM_STEPS = 100


def unroll(head: EagleHead, ids: torch.Tensor, feat: torch.Tensor, steps: int,
           amp: bool = False, attend=ttt_attention) -> list[torch.Tensor]:
    """The head's outputs h_k [B*T, H] for k < steps over right-padded ids [B, T], from
    target features feat [B*T, F] (see the module docstring for the pairing)."""
    B, T = ids.shape
    dev = ids.device
    pos = torch.arange(T, device=dev).repeat(B)  # [B*T] int64
    attn = TTTAttention(B, T, attend)
    h_in, out = feat, []
    for k in range(steps):
        step_ids = torch.zeros_like(ids)  # [B, T] int64: t[p+1+k] at chain p, 0 past the end
        step_ids[:, :max(T - 1 - k, 0)] = ids[:, 1 + k:]
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=amp):
            h = head(step_ids.reshape(-1), pos + k, attn, h_in)  # [B*T, H]
        out.append(h)
        h_in = h  # the next step reads the head's own output, as draft decode does
    return out


# ---- configuration ----------------------------------------------------------------------------
@dataclass
class TrainConfig:
    arch: str = "eagle3"  # "eagle3" | "eagle" (EAGLE-1/2)
    epochs: float = 4.0
    batch_size: int = 32  # sequences per batch, at most
    max_batch_tokens: int = 16384  # padded tokens per batch, at most
    max_len: int = 2048  # longer samples are cut
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * this
    warmup_ratio: float = 0.05
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    ttt_steps: int | None = None  # unrolled steps; None = 7 for EAGLE-3, 3 for EAGLE-1/2
    step_decay: float = 0.8  # weight of step k's loss: step_decay ** k
    # "diagonal": the causal block and each query's own chain (training/ttt_attention.py;
    # materializes [B, H, T, T] scores a step); "dense": one masked SDPA over every step's
    # keys (no scores held, work growing with the step)
    ttt_attention: str = "diagonal"
    feature_weight: float = 1.0  # EAGLE-1/2 smooth-L1 on features
    token_weight: float = 0.5  # EAGLE-1/2 token loss
    hard_targets: bool = False  # train on the target's argmax instead of its distribution
    # EAGLE-3: "rms" divides each captured feature dimension by its RMS over the first
    # batches (a small target's residual streams carry a few dimensions far larger than
    # the rest, which then set the fc's updates); folded into the fc at the end.
    feature_scale: str = "none"
    seed: int = 0
    log_every: int = 10
    save_every: int = 200  # optimizer steps between checkpoints (0: only at the end)
    time_budget_s: float | None = None  # cut the schedule to fit (measured after a few steps)
    max_steps: int | None = None  # the schedule's length at most (epochs permitting)

    def steps_unrolled(self) -> int:
        return self.ttt_steps if self.ttt_steps else (7 if self.arch == "eagle3" else 3)


@dataclass
class TrainResult:
    head: EagleHead
    steps: int
    seconds: float
    history: list[dict] = field(default_factory=list)


def make_spec(target_arch, arch: str, vocab: DraftVocab | None,
              aux_layers: tuple[int, ...] | None = None, intermediate_size: int | None = None) -> EagleSpec:
    """The head's shape; for EAGLE-3 `aux_layers` picks the captured residual streams (i:
    the stream entering layer i, num_layers: the last layer's output before the final norm);
    `intermediate_size` the MLP's width (default the target's)."""
    s = EagleSpec.for_target(target_arch, arch, vocab.size if vocab is not None else None)
    if intermediate_size is not None:
        if intermediate_size < 1:
            raise ValueError(f"--intermediate-size must be positive, not {intermediate_size}")
        s.intermediate_size = intermediate_size
    if arch == "eagle3":
        L = target_arch.num_layers
        if aux_layers:
            if len(aux_layers) != 3 or not all(0 <= i <= L for i in aux_layers):
                raise ValueError(f"--aux-layers takes three layers in 0..{L}, not {list(aux_layers)}")
            s.aux_layers = tuple(aux_layers)
        else:
            # (2, L//2, L-3) leaves 0..L for targets of fewer than 3 layers (tiny test models).
            s.aux_layers = tuple(min(max(i, 0), L) for i in s.aux_layers)
    elif aux_layers:
        raise ValueError("--aux-layers is an EAGLE-3 option (EAGLE-1 reads the final hidden state)")
    return s


@torch.no_grad()
def init_head(spec: EagleSpec, target: LlamaForCausalLM, vocab: DraftVocab | None,
              seed: int = 0, lm_head_from_target: bool = False) -> EagleHead:
    """A new head in fp32 on the target's device, nn.Linear's default init.

    lm_head_from_target (EAGLE-3) starts the norm and LM head from the target's final norm
    and LM-head rows. It is off by default: with a random hidden state those weights give
    large, confidently wrong logits (CE ~16 nats on SmolLM2). Fitting 6 SmolLM2 samples
    for 30 steps on CPU, a random start reached 87/82/78% top-1 on steps 0/1/2, the
    copied one 67/38/28%."""
    dev = next(target.parameters()).device
    torch.manual_seed(seed)
    head = EagleHead(spec, target)  # nn.Linear default init
    if spec.arch == "eagle3":
        if vocab is None:
            raise ValueError("EAGLE-3 needs a draft vocabulary")
        head.d2t.copy_(vocab.d2t)
    if spec.arch == "eagle3" and lm_head_from_target:
        head.lm_head.weight.copy_(target.lm_head.weight[vocab.token_ids.to(dev)].float().cpu())
        head.norm.weight.copy_(target.model.norm.weight.float().cpu())
    return head.to(dev)


_MLP_IN = ("mlp.gate_proj.weight", "mlp.up_proj.weight")  # [I, H]: a row per MLP channel
_MLP_OUT = "mlp.down_proj.weight"  # [H, I]: a column per MLP channel


@torch.no_grad()
def widen_mlp(state: dict[str, torch.Tensor], head: EagleHead) -> dict[str, torch.Tensor]:
    """An exported head's state (published names) for `head`, whose MLP may be wider: the
    narrower head's channels first, the new gate/up rows as `head` initialised them and the
    new down columns zero, so the widened head computes what the narrower one did and
    training grows into the added channels. A state as wide as the head is returned as is."""
    # By suffix: EAGLE-1 folders publish layers.0.*, the head's own names are model.layers.0.*
    own = {suffix: t for name, t in head.state_for_export().items()
           for suffix in (*_MLP_IN, _MLP_OUT) if name.endswith(suffix)}
    out = dict(state)
    for name, t in state.items():
        suffix = next((x for x in own if name.endswith(x)), None)
        if suffix is not None:
            mine = own[suffix]
            ch_dim = 0 if suffix in _MLP_IN else 1
            have, want = t.shape[ch_dim], mine.shape[ch_dim]
            if have > want:
                raise ValueError(f"{name}: the head to start from has {have} MLP channels, this run's "
                                 f"--intermediate-size is {want}: it can widen a head, not narrow it")
            if have < want:
                grown = mine.detach().to(device=t.device, dtype=t.dtype, copy=True)
                if ch_dim == 1:
                    grown.zero_()
                grown.narrow(ch_dim, 0, have).copy_(t)
                out[name] = grown
    return out


# ---- batches ----------------------------------------------------------------------------------
def make_batches(lengths: list[int], batch_size: int, max_tokens: int, rng: random.Random) -> list[list[int]]:
    """Index batches of similar lengths (little padding), in a random order.

    Shuffle, sort inside windows of 64 batches (so epochs differ), then cut greedily while
    count * longest stays within max_tokens and count within batch_size.
    """
    order = list(range(len(lengths)))
    rng.shuffle(order)
    window = max(1, batch_size * 64)
    batches: list[list[int]] = []
    for w in range(0, len(order), window):
        chunk = sorted(order[w:w + window], key=lambda i: lengths[i])
        cur: list[int] = []
        longest = 0
        for i in chunk:
            L = max(longest, lengths[i])
            if cur and (len(cur) + 1 > batch_size or (len(cur) + 1) * L > max_tokens):
                batches.append(cur)
                cur, L = [], lengths[i]
            cur.append(i)
            longest = L
        if cur:
            batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(samples: list[dict], idx: list[int], max_len: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> ids [B, T] int64 (0-padded), loss_mask [B, T] bool, lens [B] int64; T a multiple of 8."""
    rows = [samples[i] for i in idx]
    lens = [min(len(r["input_ids"]), max_len) for r in rows]
    T = max(8, -(-max(lens) // 8) * 8)
    ids = torch.zeros(len(rows), T, dtype=torch.int64)  # [B, T] int64
    mask = torch.zeros(len(rows), T, dtype=torch.bool)  # [B, T] bool
    for b, (r, n) in enumerate(zip(rows, lens)):
        ids[b, :n] = torch.tensor(r["input_ids"][:n], dtype=torch.int64)
        mask[b, :n] = torch.tensor(r["loss_mask"][:n], dtype=torch.bool)
    return ids.to(device), mask.to(device), torch.tensor(lens, dtype=torch.int64, device=device)


# ---- the trainer ------------------------------------------------------------------------------
class StepBudget:
    """How many steps fit a wall-clock budget, re-measured every ``every`` steps.

    The first ``warmup`` steps pay for kernel compilation and caching and are left out of
    the rate; batches differ in length, so the rate is the mean over all steps since, not
    one early sample (a 10-step sample once stopped a run at 47% of its budget).
    """

    def __init__(self, seconds: float, warmup: int = 10, every: int = 10, clock=time.monotonic):
        self.seconds, self.warmup, self.every, self.clock = seconds, warmup, every, clock
        self.t0 = clock()
        self.t_warm: float | None = None
        self.logged = False

    def fit(self, done: int, step: int, planned: int) -> int | None:
        """After ``done`` steps of this run (global ``step``): the total step count that
        fits (at most ``planned``, at least ``step``), or None when not re-measured now."""
        if done == self.warmup:
            self.t_warm = self.clock()
        if self.t_warm is None or done < 2 * self.warmup or done % self.every:
            return None
        now = self.clock()
        per_step = max(1e-9, (now - self.t_warm) / (done - self.warmup))
        fits = max(step, min(planned, step + int((self.seconds - (now - self.t0)) / per_step)))
        if fits < planned and not self.logged:
            log.warning("time budget: about %d of %d steps fit (%.3fs/step; re-measured as "
                        "training goes)", fits, planned, per_step)
            self.logged = True
        return fits


class Trainer:
    def __init__(self, target: LlamaForCausalLM, head: EagleHead, cfg: TrainConfig,
                 vocab: DraftVocab | None = None):
        self.target = target.eval().requires_grad_(False)
        self.head = head
        self.cfg = cfg
        self.eagle3 = head.eagle3
        self.device = next(target.parameters()).device
        # bf16 autocast on GPU; the CPU path stays fp32 (reference numerics, and CPU
        # autocast would only slow it down).
        self.amp = self.device.type == "cuda"
        self.K = cfg.steps_unrolled()
        if self.eagle3:
            vocab = vocab or _vocab_of(head)
            self.draft_ids = vocab.token_ids.to(self.device)  # [Vd] int64 target id of draft id
            self.t2d = vocab.t2d.to(self.device)  # [V] bool
        # The token loss's LM head: EAGLE-3's own (trained), else the target's (frozen).
        if head.max_token_id is not None:
            raise ValueError("a head is trained over the whole vocabulary (draft.max_token_id is a serving cut)")
        self.lm_weight = head.lm_head.weight if self.eagle3 else target.lm_head.weight  # [Vd|V, H]
        self.logit_dtype = torch.bfloat16 if self.amp else torch.float32
        params = [p for p in head.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas,
                                     weight_decay=cfg.weight_decay)
        if cfg.feature_scale not in ("none", "rms"):
            raise ValueError(f"feature_scale {cfg.feature_scale!r}: none or rms")
        if cfg.feature_scale != "none" and not self.eagle3:
            raise ValueError("feature_scale is an EAGLE-3 option")
        self.feat_scale: torch.Tensor | None = None  # [3H] fp32: what features are divided by
        self.step = 0
        self.total_steps = 1
        self.warm_steps = 1
        # (step, cosine progress there): where the decay continues from after a re-plan
        self.sched: tuple[int, float] = (1, 0.0)
        # (first step, length) of a learning-rate ramp after a start without Adam's moments
        self.rewarm: tuple[int, int] = (0, 0)
        # where the run stands as last checkpointed: what a leg writes beside its exported head
        self.position: dict = {}

    def features(self, ids: torch.Tensor):
        """The frozen target over a [B, T] batch -> (its final hidden [B*T, H], the head's
        input features [B*T, 3H] for EAGLE-3 (scaled), else the final hidden)."""
        B, T = ids.shape
        pos = torch.arange(T, device=ids.device).repeat(B)  # [B*T] int64
        hidden, aux = self.target(ids.reshape(-1), pos, CausalAttention(B, T), self.head.aux_layers)
        if not self.eagle3:
            return hidden, hidden
        feat = torch.cat(aux, -1)  # [B*T, 3H]
        return hidden, feat if self.feat_scale is None else feat / self.feat_scale

    @torch.no_grad()
    def calibrate_feature_scale(self, samples: list[dict], batches: list[list[int]]) -> None:
        """feature_scale=rms: each feature dimension's RMS over these batches' tokens (the
        first token of each sequence left out: its residual stream is an outlier of its own)."""
        self.feat_scale = None
        sq, n = None, 0
        for idx in batches:
            ids, _, lens = collate(samples, idx, self.cfg.max_len, self.device)
            _, feat = self.features(ids)
            keep = torch.arange(ids.shape[1], device=ids.device)[None, :] < lens[:, None]  # [B, T] bool
            keep[:, 0] = False
            f = feat.float()[keep.reshape(-1)]  # [N, 3H]
            sq = f.square().sum(0) if sq is None else sq + f.square().sum(0)
            n += f.shape[0]
        self.feat_scale = (sq / max(n, 1)).sqrt().clamp(min=1e-6)  # [3H] fp32
        log.info("feature scale (RMS per captured layer): %s",
                 [round(float(x.square().mean().sqrt()), 3) for x in self.feat_scale.chunk(3)])

    @torch.no_grad()
    def fold_feature_scale(self) -> None:
        """Move the scale into the fc's columns, so the head takes the target's features as
        they are (the engine's input) and computes what it computed on scaled ones."""
        if self.feat_scale is None:
            return
        w = self.head.fc.weight  # [H, 3H]
        w.copy_((w.float() / self.feat_scale[None, :]).to(w.dtype))
        self.feat_scale = None

    @torch.no_grad()
    def start_from_head(self, folder: Path, data_key: str) -> tuple[int, int]:
        """Weights from an exported head folder. Where the folder holds a leg's POSITION for
        this data (the leg's machine, and with it the checkpoint, was lost), the run also
        continues from that step, schedule, feature scale and data position; the optimizer's
        moments start afresh behind a ramp of REWARM_STEPS. Without one it is a head to
        fine-tune: the run starts at step 0. -> (epoch, batch) where the batch stream goes on.
        An exported fc has the feature scale folded in: unfold_feature_scale undoes it once
        the scale is known."""
        state = widen_mlp(read_head_state(folder), self.head)
        theirs = read_eagle_spec(folder, self.target.arch)
        if (theirs.arch, theirs.aux_layers) != (self.head.spec.arch, self.head.spec.aux_layers):
            raise ValueError(f"{folder}: the head is {theirs.arch} reading layers {theirs.aux_layers}, this run "
                             f"trains {self.head.spec.arch} reading {self.head.spec.aux_layers} (--arch, --aux-layers)")
        if self.eagle3 and not torch.equal(state["d2t"].long().cpu(), self.head.d2t.long().cpu()):
            raise ValueError(f"{folder}: the head has another draft vocabulary")
        self.head.load_checkpoint_state(state)
        pos_file = folder / POSITION
        if not pos_file.exists():
            log.info("starting from the head in %s (fine-tuning it: no %s)", folder, POSITION)
            return 0, 0
        pos = json.loads(pos_file.read_text())
        if pos["arch"] != self.head.spec.arch:
            raise ValueError(f"{pos_file}: the head is {pos['arch']}, this run trains {self.head.spec.arch}")
        if pos["data_key"] != data_key:
            raise ValueError(f"{pos_file}: the head was trained on other data (continuing it needs the "
                             "same --data files, or OUT/data, and the same --max-len and --seed)")
        self.step, self.total_steps = pos["step"], pos["total_steps"]
        self.warm_steps, self.sched = pos["warm_steps"], tuple(pos["sched"])
        if pos["feat_scale"] is not None:
            self.feat_scale = torch.tensor(pos["feat_scale"], dtype=torch.float32, device=self.device)  # [3H]
        self.rewarm = (self.step, REWARM_STEPS)
        log.info("continuing from the head in %s at step %d of %d (epoch %d, batch %d), the optimizer's "
                 "moments afresh", folder, self.step, self.total_steps, pos["epoch"], pos["batch"])
        return pos["epoch"], pos["batch"]

    @torch.no_grad()
    def unfold_feature_scale(self) -> None:
        """fold_feature_scale undone: the fc takes scaled features again."""
        w = self.head.fc.weight  # [H, 3H]
        w.copy_((w.float() * self.feat_scale[None, :]).to(w.dtype))

    # -- one batch ------------------------------------------------------------------------------
    def losses(self, ids: torch.Tensor, loss_mask: torch.Tensor, lens: torch.Tensor):
        """ids/loss_mask [B, T], lens [B] -> (weighted loss, per-step [loss, correct, count])."""
        B, T = ids.shape
        dev = ids.device
        valid = torch.arange(T, device=dev)[None, :] < lens[:, None]  # [B, T] bool
        # pred[b, q]: the target's prediction at q is for t[q+1], an assistant token.
        pred = torch.zeros_like(loss_mask)
        pred[:, :-1] = loss_mask[:, 1:] & valid[:, 1:]
        with torch.no_grad():
            hidden, feat = self.features(ids)  # [B*T, H], [B*T, 3H] or [B*T, H]
            q_rows = pred.reshape(-1).nonzero().squeeze(1)  # [M] int64 flat supervised positions
            t_logits = self.target.compute_logits(hidden[q_rows])  # [M, V] fp32
            t_top = t_logits.argmax(-1)  # [M] int64 target's greedy token
            if self.eagle3:
                in_vocab = self.t2d[t_top]  # [M] bool: the draft can propose it at all
                t_logits = t_logits[:, self.draft_ids]  # [M, Vd]: renormalised over the draft vocab
            else:
                in_vocab = torch.ones_like(t_top, dtype=torch.bool)
            if self.cfg.hard_targets:
                t_probs = F.one_hot(t_logits.argmax(-1), t_logits.shape[-1]).float()
            else:
                t_probs = torch.softmax(t_logits, -1)  # [M, Vd|V] fp32
            del t_logits
            row_of = torch.full((B * T,), -1, dtype=torch.int64, device=dev)  # flat q -> row in M
            row_of[q_rows] = torch.arange(q_rows.numel(), device=dev)
            row_of = row_of.view(B, T)
            t_feat = hidden.float() if not self.eagle3 else None  # [B*T, H] regression targets

        total = torch.zeros((), device=dev)
        stats = []
        attend = ttt_attention_dense if self.cfg.ttt_attention == "dense" else ttt_attention
        for k, h in enumerate(unroll(self.head, ids, feat, self.K, self.amp, attend)):
            # chain p at step k is scored against the target's row for q = p+1+k
            rows = torch.full_like(row_of, -1)
            rows[:, :max(T - 1 - k, 0)] = row_of[:, 1 + k:]
            chains = (rows.reshape(-1) >= 0).nonzero().squeeze(1)  # [Mk] int64 flat chain p
            r = rows.reshape(-1)[chains]  # [Mk] int64 rows of the target tensors
            with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=self.amp):
                x = self.head.norm(h[chains]) if self.eagle3 else h[chains]  # [Mk, H] the LM head's input
            w = in_vocab[r].float()  # [Mk]
            n = w.sum().clamp(min=1.0)
            loss_k, guess = soft_ce(x, self.lm_weight, t_probs, r, w / n, self.logit_dtype)  # guess [Mk]
            if not self.eagle3:
                reg = F.smooth_l1_loss(h[chains].float(), t_feat[chains + 1 + k], reduction="none").mean(-1)
                loss_k = self.cfg.feature_weight * (reg * w).sum() / n + self.cfg.token_weight * loss_k
            total = total + (self.cfg.step_decay ** k) * loss_k
            with torch.no_grad():
                if self.eagle3:
                    guess = self.draft_ids[guess]
                correct = (guess == t_top[r]).sum()
            stats.append((loss_k.detach(), correct, torch.tensor(r.numel(), device=dev)))
        return total, stats

    # -- schedule -------------------------------------------------------------------------------
    def set_schedule(self, total: int, from_step: int | None = None) -> None:
        """The schedule's length in steps: linear warm-up, then cosine decay to its end. A
        re-plan mid-run (from_step: a time budget's new estimate) keeps the warm-up and
        continues the decay from its progress at that step, so the learning rate neither
        jumps nor rises again."""
        if from_step is None:
            self.warm_steps = max(1, int(self.cfg.warmup_ratio * total))
            self.sched = (self.warm_steps, 0.0)
        elif from_step > self.warm_steps:
            self.sched = (from_step, self._progress(from_step))
        self.total_steps = total

    def _progress(self, step: int) -> float:
        s0, t0 = self.sched
        return min(1.0, t0 + (1 - t0) * (step - s0) / max(1, self.total_steps - s0))

    def lr_at(self, step: int) -> float:
        c = self.cfg
        if step < self.warm_steps:
            lr = c.lr * (step + 1) / self.warm_steps
        else:
            t = self._progress(step)
            lr = c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))
        s0, n = self.rewarm
        return lr * (step - s0 + 1) / n if s0 <= step < s0 + n else lr

    def train_step(self, ids, loss_mask, lens) -> tuple[float, list[tuple[float, int, int]]]:
        self.head.train()
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        loss, stats = self.losses(ids, loss_mask, lens)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.step += 1
        return float(loss.detach()), [(float(l), int(c), int(n)) for l, c, n in stats]

    @torch.no_grad()
    def evaluate(self, samples: list[dict], batch_size: int | None = None) -> dict:
        """Held-out loss and per-step top-1 agreement with the target (a proxy; the engine's
        accept length is the real measure)."""
        if not samples:
            return {}
        self.head.eval()
        c = self.cfg
        lengths = [min(len(s["input_ids"]), c.max_len) for s in samples]
        loss_sum, n_batches = 0.0, 0
        correct = [0] * self.K
        count = [0] * self.K
        for idx in make_batches(lengths, batch_size or c.batch_size, c.max_batch_tokens, random.Random(0)):
            loss, stats = self.losses(*collate(samples, idx, c.max_len, self.device))
            loss_sum += float(loss)
            n_batches += 1
            for k, (_, cr, n) in enumerate(stats):
                correct[k] += int(cr)
                count[k] += int(n)
        return {"loss": loss_sum / max(n_batches, 1),
                "acc": [round(cr / max(n, 1), 4) for cr, n in zip(correct, count)]}

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self, path: Path, epoch: int, batch: int, history: list[dict], data_key: str = "") -> None:
        """The checkpoint (head, optimizer, step and schedule length, data position) and,
        beside it, progress.json: what a driver of training legs reads without torch."""
        path.parent.mkdir(parents=True, exist_ok=True)
        self.position = {"arch": self.head.spec.arch, "step": self.step, "total_steps": self.total_steps,
                         "epoch": epoch, "batch": batch, "data_key": data_key,
                         "warm_steps": self.warm_steps, "sched": list(self.sched),
                         "feat_scale": None if self.feat_scale is None else self.feat_scale.tolist()}
        tmp = path.with_suffix(".tmp")
        torch.save({"head": self.head.state_dict(), "opt": self.opt.state_dict(), "step": self.step,
                    "total_steps": self.total_steps, "epoch": epoch, "batch": batch,
                    "arch": self.head.spec.arch, "cfg": asdict(self.cfg), "history": history,
                    "data_key": data_key, "feat_scale": self.feat_scale,
                    "warm_steps": self.warm_steps, "sched": self.sched, "rewarm": self.rewarm,
                    "draft_ids": self.draft_ids.cpu() if self.eagle3 else None}, tmp)
        tmp.replace(path)  # never a torn checkpoint
        prog = path.parent / "progress.json"
        prog.with_suffix(".tmp").write_text(json.dumps(
            {"step": self.step, "total_steps": self.total_steps, "epoch": epoch, "batch": batch,
             "done": self.step >= self.total_steps, "loss": history[-1]["loss"] if history else None}))
        prog.with_suffix(".tmp").replace(prog)

    def load(self, path: Path, data_key: str = "") -> dict:
        st = torch.load(path, map_location=self.device, weights_only=False)
        if st["arch"] != self.head.spec.arch:
            raise ValueError(f"{path}: checkpoint is {st['arch']}, this run trains {self.head.spec.arch}")
        if self.eagle3 and not torch.equal(st["draft_ids"].to(self.device), self.draft_ids):
            raise ValueError(f"{path}: checkpoint has another draft vocabulary (different data or --draft-vocab)")
        if data_key and st.get("data_key") and st["data_key"] != data_key:
            raise ValueError(f"{path}: checkpoint was trained on other data (resume needs the same "
                             "--data files, or OUT/data, and the same --max-len)")
        self.head.load_state_dict(st["head"])
        self.opt.load_state_dict(st["opt"])
        self.step, self.total_steps = st["step"], st["total_steps"]
        if "sched" in st:
            self.warm_steps, self.sched = st["warm_steps"], tuple(st["sched"])
        else:
            self.set_schedule(self.total_steps)
        self.rewarm = tuple(st.get("rewarm", (0, 0)))
        fs = st.get("feat_scale")
        self.feat_scale = None if fs is None else fs.to(self.device)
        return st

    # -- the loop -------------------------------------------------------------------------------
    def fit(self, samples: list[dict], state_path: Path | None = None, resume: bool = False,
            progress: bool = True, stop_at: int | None = None, leg_steps: int | None = None,
            leg_seconds: float | None = None, init_head: Path | None = None) -> TrainResult:
        """Train over `samples` for cfg.epochs (at most cfg.max_steps). With state_path,
        checkpoints every cfg.save_every steps and at the end; `resume` continues from it
        (same data and settings: the batch order of every epoch is fixed by the seed, and
        the checkpoint holds the position in it). stop_at ends the run early after that
        many steps, checkpointed, as an interruption would. A leg ends after leg_steps
        steps, or before leg_seconds would be passed, checkpointed; the schedule stays the
        whole run's, so the next leg (resume) continues it. init_head, where no checkpoint is
        resumed: an exported head to start from (start_from_head)."""
        from tqdm import tqdm
        c = self.cfg
        if not samples:
            raise ValueError("no training samples")
        lengths = [min(len(s["input_ids"]), c.max_len) for s in samples]
        first_epoch = make_batches(lengths, c.batch_size, c.max_batch_tokens, random.Random(c.seed))
        planned = max(1, int(math.ceil(len(first_epoch) * c.epochs)))
        if c.max_steps:
            planned = min(planned, c.max_steps)
        data_key = _data_key(lengths, c.seed)
        history: list[dict] = []
        epoch, next_batch = 0, 0  # where the batch stream continues
        resumed = resume and state_path is not None and state_path.exists()
        if resumed:
            st = self.load(state_path, data_key)
            epoch, next_batch, history = st["epoch"], st["batch"], st["history"]
            log.info("resumed from %s at step %d (epoch %d, batch %d)", state_path, self.step,
                     epoch, next_batch)
        elif init_head is not None:
            epoch, next_batch = self.start_from_head(init_head, data_key)
        if c.feature_scale == "rms" and self.feat_scale is None:
            self.calibrate_feature_scale(samples, first_epoch[:8])
        if init_head is not None and not resumed and self.feat_scale is not None:
            self.unfold_feature_scale()
        continued = resumed or self.step > 0
        if not continued:
            self.set_schedule(planned)
        elif planned != self.total_steps:  # a continued run with another length: decay from here
            self.set_schedule(planned, from_step=self.step)
        bar = tqdm(total=self.total_steps, initial=self.step, desc=f"train {self.head.spec.arch}",
                   unit="step", file=sys.stderr, disable=not progress)
        t0 = time.monotonic()
        first_step = self.step
        budget = StepBudget(c.time_budget_s) if c.time_budget_s is not None else None
        window: list[tuple[float, list]] = []
        batches = make_batches(lengths, c.batch_size, c.max_batch_tokens, random.Random(c.seed + epoch))
        leg_end = None if leg_steps is None else self.step + leg_steps
        while self.step < self.total_steps and (stop_at is None or self.step < stop_at):
            done = self.step - first_step
            if leg_end is not None and self.step >= leg_end:
                break
            # stop while one more step (at the mean rate, 1.5x for a long batch) still fits
            if leg_seconds is not None and done and \
                    (time.monotonic() - t0) * (done + 1.5) / done > leg_seconds:
                break
            if next_batch >= len(batches):
                epoch, next_batch = epoch + 1, 0
                batches = make_batches(lengths, c.batch_size, c.max_batch_tokens, random.Random(c.seed + epoch))
            idx = batches[next_batch]
            next_batch += 1
            loss, stats = self.train_step(*collate(samples, idx, c.max_len, self.device))
            window.append((loss, stats))
            fits = budget.fit(self.step - first_step, self.step, planned) if budget else None
            if fits is not None and fits != self.total_steps:
                self.set_schedule(fits, from_step=self.step)
                bar.total = fits
            bar.update(1)
            if self.step % c.log_every == 0 or self.step == self.total_steps:
                rec = _summarise(window, self.step, self.lr_at(self.step - 1))
                history.append(rec)
                window = []
                bar.set_postfix(loss=f"{rec['loss']:.3f}",
                                acc="/".join(f"{a * 100:.0f}" for a in rec["acc"]), refresh=False)
            if state_path is not None and c.save_every and self.step % c.save_every == 0:
                self.save(state_path, epoch, next_batch, history, data_key)
        bar.close()
        if window:
            history.append(_summarise(window, self.step, self.lr_at(self.step - 1)))
        if state_path is not None:
            self.save(state_path, epoch, next_batch, history, data_key)
        if self.step < self.total_steps:
            log.info("leg ends at step %d of %d (epoch %d, batch %d)", self.step, self.total_steps,
                     epoch, next_batch)
        return TrainResult(self.head, self.step, time.monotonic() - t0, history)


def _data_key(lengths: list[int], seed: int) -> str:
    """Identifies the training set as the batch order sees it: a resumed run's data
    position means nothing on other data."""
    import hashlib
    return hashlib.sha1(json.dumps([seed, lengths]).encode()).hexdigest()[:16]


def _summarise(window: list[tuple[float, list]], step: int, lr: float) -> dict:
    K = len(window[0][1])
    corr = [sum(s[k][1] for _, s in window) for k in range(K)]
    cnt = [sum(s[k][2] for _, s in window) for k in range(K)]
    return {"step": step, "lr": lr, "loss": sum(l for l, _ in window) / len(window),
            "step_loss": [round(sum(s[k][0] for _, s in window) / len(window), 4) for k in range(K)],
            "acc": [round(cr / max(n, 1), 4) for cr, n in zip(corr, cnt)]}


def _vocab_of(head: EagleHead) -> DraftVocab:
    from training.vocab import from_d2t
    return from_d2t(head.d2t, head._target.arch.vocab_size)


# ---- CLI ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kestrel train-draft",
        description="Generate data with the target (Magpie), train an EAGLE head, export it in the "
                    "SGLang/EAGLE format and measure its acceptance with the engine.")
    a = p.add_argument
    a("--config", default=None, help="YAML preset for the engine (data generation and evaluation)")
    a("--set", action="append", metavar="KEY=VALUE", help="config override (repeatable)")
    a("--target", default=None, help="target model: .gguf or HF folder (default: the config's model)")
    a("--arch", choices=["eagle3", "eagle"], default="eagle3")
    a("--out", required=True, help="output folder: the head (config.json, *.safetensors), report.json, "
                                   "data/ and train_state/")
    a("--device", choices=["cuda", "cpu"], default=None, help="default: the config's device")
    a("--seed", type=int, default=0)
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", default=None, metavar="JSONL",
                   help="training JSONL files (input_ids + loss_mask) instead of generating; several are joined")
    g.add_argument("--eval-data", nargs="+", default=None, metavar="JSONL",
                   help="held-out JSONL files (default: split off --data)")
    g.add_argument("--samples", type=int, default=2000, help="conversations to generate (train + held-out)")
    g.add_argument("--user-prompts", default=None, help="JSONL of prompts answered first (prompt/messages/turns)")
    g.add_argument("--max-prompt-tokens", type=int, default=128)
    g.add_argument("--max-response-tokens", type=int, default=384)
    g.add_argument("--greedy-fraction", type=float, default=0.5, help="responses decoded greedily; the rest sampled")
    g.add_argument("--response-temperature", type=float, default=0.8)
    g.add_argument("--prompt-temperature", type=float, default=1.0)
    g.add_argument("--eval-fraction", type=float, default=0.05)
    g.add_argument("--gen-batch", type=int, default=None,
                   help="concurrent requests while generating (default: 256 on cuda, the config's on cpu)")
    g.add_argument("--gen-time-budget", type=float, default=None, help="seconds for data generation, at most")
    g.add_argument("--data-only", action="store_true",
                   help="stop after writing OUT/data (train several heads on it with --data/--eval-data)")
    g.add_argument("--category-mix", default=DEFAULT_MIX, metavar="CAT=W,...",
                   help=f"share of generated prompts per category, of {', '.join(CATEGORIES)} "
                        f"(magpie: unseeded; default {DEFAULT_MIX})")
    g.add_argument("--eval-only-prompts", nargs="*", default=[], metavar="JSONL",
                   help="evaluation prompt sets kept out of the data, besides MT-bench (always): "
                        "exact and near duplicates of their prompts are dropped")
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=float, default=4.0)
    t.add_argument("--batch-size", type=int, default=32, help="sequences per batch, at most")
    t.add_argument("--max-batch-tokens", type=int, default=16384, help="padded tokens per batch, at most")
    t.add_argument("--max-len", type=int, default=2048)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup-ratio", type=float, default=0.05)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--grad-clip", type=float, default=0.5)
    t.add_argument("--ttt-steps", type=int, default=None, help="unrolled steps (default 7 eagle3, 3 eagle)")
    t.add_argument("--ttt-attention", choices=("diagonal", "dense"), default="diagonal",
                   help="the unrolled steps' attention: the causal block and the diagonals (scores "
                        "[B, H, T, T] held a step), or one masked SDPA (none held, more work)")
    t.add_argument("--step-decay", type=float, default=0.8)
    t.add_argument("--feature-weight", type=float, default=TrainConfig.feature_weight,
                   help="EAGLE-1/2: weight of the feature regression")
    t.add_argument("--token-weight", type=float, default=TrainConfig.token_weight,
                   help="EAGLE-1/2: weight of the token loss")
    t.add_argument("--draft-vocab", type=int, default=8192, help="EAGLE-3 draft vocabulary size")
    t.add_argument("--intermediate-size", type=int, default=None,
                   help="the head's MLP width (default the target's); an --init-head of the target's "
                        "width is widened into it, computing what it did")
    t.add_argument("--aux-layers", type=int, nargs=3, default=None, metavar="I",
                   help="EAGLE-3: the target's residual streams the head reads (i: entering layer i; "
                        "the layer count: the last layer's output); default 2, L/2, L-3")
    t.add_argument("--feature-scale", choices=("none", "rms"), default="none",
                   help="EAGLE-3: divide each feature dimension by its RMS in training (folded into the fc)")
    t.add_argument("--hard-targets", action="store_true", help="match the target's argmax, not its distribution")
    t.add_argument("--lm-head-init", choices=["random", "target"], default="random",
                   help="EAGLE-3: start the LM head and norm at random (default) or from the target's")
    t.add_argument("--save-every", type=int, default=200)
    t.add_argument("--resume", action="store_true",
                   help="continue from OUT/train_state (and reuse OUT/data), or where there is none, from "
                        f"the head the last leg exported (OUT/{LEG_HEAD}, carried back onto a new machine)")
    t.add_argument("--init-head", default=None, metavar="DIR",
                   help="start from an exported head's weights (a shipped head to fine-tune; with a "
                        f"leg's {POSITION} beside them, the run continues from that step)")
    t.add_argument("--train-time-budget", type=float, default=None,
                   help="seconds for training, at most: the schedule is cut to fit (one-leg runs)")
    t.add_argument("--max-steps", type=int, default=None, help="optimizer steps of the whole run, at most")
    t.add_argument("--leg-time-budget", type=float, default=None,
                   help="end this leg before this many seconds of training, checkpointed, without "
                        "shortening the schedule; --resume continues it (python -m training.legs)")
    t.add_argument("--leg-steps", type=int, default=None, help="end this leg after this many steps")
    t.add_argument("--export-dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    e = p.add_argument_group("evaluation")
    e.add_argument("--no-eval", action="store_true")
    e.add_argument("--eval-samples", type=int, default=64, help="held-out prompts run through the engine")
    e.add_argument("--eval-prompts", nargs="+", default=[], metavar="JSONL",
                   help="also evaluate on each of these prompt files (JSONL: prompt/messages/turns)")
    e.add_argument("--eval-max-tokens", type=int, default=256)
    e.add_argument("--eval-batch", type=int, default=None, help="concurrent eval requests (default: the config's)")
    return p


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]  # `kestrel train-draft -- --arch ...`: argparse REMAINDER keeps the "--"
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    from actors.models.loader import build_model, default_model_path
    from configs.schema import ConfigError, load_config
    from serve_app.engine.llm_engine import release_device_memory
    from training.data import (category_coverage, format_coverage, generate_dataset, join_samples,
                               load_jsonl, save_jsonl)

    try:
        mix = parse_mix(args.category_mix)
        cfg = load_config(args.config, list(args.set or []))
        if args.target:
            cfg.model.path = args.target
        if args.device:
            cfg.device = args.device
    except (ConfigError, ValueError) as e:
        sys.exit(f"kestrel train-draft: {e}")
    device = cfg.resolved_device()
    target_path = cfg.model.path or default_model_path()
    cfg.model.path = target_path
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data_dir, state_path = out / "data", out / "train_state" / "state.pt"
    report: dict = {"arch": args.arch, "target": target_path, "device": device,
                    "args": {k: v for k, v in vars(args).items()}, "seconds": {}}
    t_all = time.monotonic()
    tokenizer = None

    def get_tokenizer():
        nonlocal tokenizer
        if tokenizer is None:
            from serve_app.text.tokenizer import load_tokenizer
            tokenizer = load_tokenizer(target_path)
        return tokenizer

    # 1. data ------------------------------------------------------------------------------
    t0 = time.monotonic()
    if args.data:
        parts = [load_jsonl(f) for f in args.data]
        if args.eval_data:
            held = [r for f in args.eval_data for r in load_jsonl(f)]
            train = join_samples(parts, held)
        else:
            train = join_samples(parts)
            rng = random.Random(args.seed)
            rng.shuffle(train)
            n_eval = min(len(train) - 1, max(1, round(len(train) * args.eval_fraction))) if len(train) > 1 else 0
            held, train = train[:n_eval], train[n_eval:]
        report["data"] = {"source": args.data, "train": len(train), "eval": len(held),
                          "categories": category_coverage(train, held)}
        log.info("coverage by category:\n%s", format_coverage(report["data"]["categories"]))
    elif args.resume and (data_dir / "train.jsonl").exists():
        train, held = load_jsonl(data_dir / "train.jsonl"), load_jsonl(data_dir / "eval.jsonl")
        report["data"] = json.loads((data_dir / "stats.json").read_text()) if (data_dir / "stats.json").exists() else {}
        log.info("reusing %s (%d train, %d held-out samples)", data_dir, len(train), len(held))
    else:
        from serve_app.engine.llm_engine import LLMEngine
        from training.contamination import ContaminationFilter, build_index
        from training.data import read_prompt_rows
        gen_cfg = cfg.model_copy(deep=True)
        gen_cfg.draft.enabled = False
        gen_cfg.scheduler.max_running_requests = args.gen_batch or (
            256 if device == "cuda" else cfg.scheduler.max_running_requests)
        # Throughput over first-token latency: admit finished requests' successors in
        # batches, so an eager prefill step is paid once per eighth of the batch (not by
        # cost: every queued request has waited since the start, so each would go at once).
        gen_cfg.scheduler.prefill_min_batch = max(gen_cfg.scheduler.prefill_min_batch,
                                                  gen_cfg.scheduler.max_running_requests // 8)
        gen_cfg.scheduler.prefill_by_cost = False
        engine = LLMEngine(gen_cfg, tokenizer=get_tokenizer())
        rows = read_prompt_rows(args.user_prompts) if args.user_prompts else []
        ds = generate_dataset(engine, tokenizer, args.samples, args.max_prompt_tokens,
                              args.max_response_tokens, user_prompts=[p for p, _ in rows],
                              user_categories=[c for _, c in rows], category_mix=mix,
                              contamination=ContaminationFilter(build_index(args.eval_only_prompts)),
                              greedy_fraction=args.greedy_fraction,
                              prompt_temperature=args.prompt_temperature,
                              response_temperature=args.response_temperature,
                              eval_fraction=args.eval_fraction, seed=args.seed,
                              time_budget_s=args.gen_time_budget)
        del engine
        release_device_memory()
        train, held = ds.train, ds.eval
        save_jsonl(train, data_dir / "train.jsonl")
        save_jsonl(held, data_dir / "eval.jsonl")
        (data_dir / "stats.json").write_text(json.dumps(ds.stats, indent=2))
        report["data"] = ds.stats
        log.info("data: %s", ds.stats)
    report["seconds"]["data"] = round(time.monotonic() - t0, 1)
    if not train:
        sys.exit("kestrel train-draft: no training samples")
    if args.data_only:
        (out / "report.json").write_text(json.dumps(report, indent=2))
        return report

    # 2. target, vocabulary, head -------------------------------------------------------------
    t0 = time.monotonic()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    target, tarch = build_model(target_path, dtype, device)
    init_from = Path(args.init_head) if args.init_head else None
    if init_from is None and args.resume and not state_path.exists() and (out / LEG_HEAD / POSITION).exists():
        init_from = out / LEG_HEAD
        log.info("no checkpoint in %s: continuing from the head the last leg exported", state_path.parent)
    init_state = read_head_state(init_from) if init_from is not None else None
    vocab = None
    if args.arch == "eagle3":
        from training.vocab import build_draft_vocab, count_assistant_tokens, coverage, from_d2t
        size = min(args.draft_vocab, tarch.vocab_size)
        if init_state is not None:  # the head's own vocabulary: its LM head's rows are those ids
            vocab = from_d2t(init_state["d2t"].long(), tarch.vocab_size)
        else:
            vocab = build_draft_vocab(train, tarch.vocab_size, size, always_include=tarch.eos_token_ids)
        train_cov = coverage(count_assistant_tokens(train), vocab.t2d) if init_from else vocab.coverage
        report["draft_vocab"] = {"size": vocab.size, "train_coverage": round(train_cov, 5),
                                 "eval_coverage": round(coverage(count_assistant_tokens(held), vocab.t2d), 5)}
        log.info("draft vocabulary: %s", report["draft_vocab"])
    tc = TrainConfig(arch=args.arch, epochs=args.epochs, batch_size=args.batch_size,
                     max_batch_tokens=args.max_batch_tokens, max_len=args.max_len, lr=args.lr,
                     warmup_ratio=args.warmup_ratio, weight_decay=args.weight_decay,
                     grad_clip=args.grad_clip, ttt_steps=args.ttt_steps, ttt_attention=args.ttt_attention,
                     step_decay=args.step_decay,
                     feature_weight=args.feature_weight, token_weight=args.token_weight,
                     hard_targets=args.hard_targets, feature_scale=args.feature_scale,
                     seed=args.seed, save_every=args.save_every,
                     time_budget_s=args.train_time_budget, max_steps=args.max_steps)
    head = init_head(make_spec(tarch, args.arch, vocab, args.aux_layers, args.intermediate_size), target, vocab,
                     seed=args.seed, lm_head_from_target=args.lm_head_init == "target")
    trainer = Trainer(target, head, tc, vocab)
    # measured once, by the first leg: later legs start from a trained head
    before_path = state_path.parent / "heldout_before.json"
    if args.resume and before_path.exists():
        before = json.loads(before_path.read_text())
    else:
        if init_state is not None:  # the head fine-tuned or continued, not a fresh one
            # (its fc as exported, with any feature scale folded in: the target's features as they are)
            trainer.head.load_checkpoint_state(widen_mlp(init_state, trainer.head))
        before = trainer.evaluate(held)
        before_path.parent.mkdir(parents=True, exist_ok=True)
        before_path.write_text(json.dumps(before))

    # 3. train ------------------------------------------------------------------------------
    res = trainer.fit(train, state_path, resume=args.resume, leg_steps=args.leg_steps,
                      leg_seconds=args.leg_time_budget, init_head=init_from)
    finished = trainer.step >= trainer.total_steps
    position = trainer.position  # taken before the fold below: it holds the scale apart
    # The exported head and the measures below take raw features; the checkpoint fit wrote
    # keeps the scale apart, for the next leg.
    trainer.fold_feature_scale()
    from training.export import export_head
    report["train"] = {"config": asdict(tc), "steps": res.steps, "total_steps": trainer.total_steps,
                       "finished": finished, "seconds": round(res.seconds, 1),
                       "heldout_before": before, "history": res.history}
    if not finished:
        # A leg: the checkpoint is what the next leg resumes from; the head as it stands is
        # exported too, small enough to carry off a machine that may be gone before the
        # next leg, and usable as a head in its own right.
        files = export_head(res.head, out / LEG_HEAD, getattr(torch, args.export_dtype))
        (out / LEG_HEAD / POSITION).write_text(json.dumps(position))
        report["leg_head"] = {"step": trainer.step, "files": [f.name for f in files]}
        report["seconds"]["train"] = round(time.monotonic() - t0, 1)
        report["seconds"]["total"] = round(time.monotonic() - t_all, 1)
        (out / "leg_report.json").write_text(json.dumps(report, indent=2))
        log.info("leg done: step %d of %d; continue with --resume", trainer.step, trainer.total_steps)
        return report
    after = trainer.evaluate(held)
    report["train"]["heldout_after"] = after
    log.info("held-out: before %s, after %s", before, after)
    report["seconds"]["train"] = round(time.monotonic() - t0, 1)

    # 4. export -----------------------------------------------------------------------------
    files = export_head(res.head, out, getattr(torch, args.export_dtype))
    report["export"] = {"files": [f.name for f in files],
                        "bytes": {f.name: f.stat().st_size for f in files}}
    del trainer, res, head, target
    release_device_memory()
    if device.startswith("cuda"):  # the engines below count what this process still holds as weights
        log.info("after training this process holds %.2f GiB in tensors, %.2f GiB reserved",
                 torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30)

    # 5. acceptance with the real engine --------------------------------------------------------
    if not args.no_eval:
        from training.evaluate import eval_acceptance
        t0 = time.monotonic()
        ev_cfg = cfg.model_copy(deep=True)
        if args.eval_batch:
            ev_cfg.scheduler.max_running_requests = args.eval_batch
        ev_cfg.model.max_model_len = max(ev_cfg.model.max_model_len,
                                         max((s["prompt_len"] for s in held), default=0) + args.eval_max_tokens + 1)
        prompts = [s["input_ids"][:s["prompt_len"]] for s in held[:args.eval_samples]]
        report["acceptance"] = {}
        if prompts:
            cats = [s.get("category") or s.get("source") for s in held[:args.eval_samples]]
            report["acceptance"]["heldout"] = eval_acceptance(
                ev_cfg, str(out), prompts, tokenizer=tokenizer, categories=cats,
                max_tokens=args.eval_max_tokens)
        from training.evaluate import read_eval_prompts
        for path in args.eval_prompts:
            tok = get_tokenizer()
            extra, cats = read_eval_prompts(path, tok)
            report["acceptance"][Path(path).stem] = eval_acceptance(
                ev_cfg, str(out), extra, tokenizer=tok, categories=cats, max_tokens=args.eval_max_tokens)
        report["seconds"]["eval"] = round(time.monotonic() - t0, 1)
    report["seconds"]["total"] = round(time.monotonic() - t_all, 1)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    _print_summary(report, out)
    return report


def _print_summary(report: dict, out: Path) -> None:
    lines = [f"head written to {out} ({report['arch']}); report: {out / 'report.json'}"]
    if "draft_vocab" in report:
        dv = report["draft_vocab"]
        lines.append(f"draft vocab {dv['size']}: coverage {dv['train_coverage']:.3f} train, "
                     f"{dv['eval_coverage']:.3f} held-out")
    after = report.get("train", {}).get("heldout_after")
    if after:
        lines.append("held-out top-1 per step: " + " ".join(f"{a:.3f}" for a in after["acc"]))
    from training.evaluate import category_table
    for split, res in report.get("acceptance", {}).items():
        for name, row in res["settings"].items():
            if "mean_accept_length" in row:
                lines.append(f"{split} {name}: accept length {row['mean_accept_length']}, "
                             f"{row['tokens_per_s']} tok/s (x{row.get('speedup_vs_no_spec', '?')})")
        table = category_table(res)
        if table:
            lines.append(f"{split}: mean accept length per category\n{table}")
    lines.append("seconds: " + json.dumps(report["seconds"]))
    print("\n".join(lines), file=sys.stderr)


if __name__ == "__main__":
    main()
