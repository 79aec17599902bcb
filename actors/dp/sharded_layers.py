"""dp_attention's tensor-parallel layers, and `shard_model` that puts them into a loaded
target in place of the dense ones.

Attention (and so the KV cache) stays whole on every rank, over the rank's own requests.
The dense parts are split across the group, as SGLang's DP attention does:
- MLP: gate/up split by columns, down by rows (Megatron). A rank's tokens are not its
  peers', so each MLP gathers every rank's tokens (padded to the phase's size), runs
  its slice of the weights over all of them, and a reduce-scatter both sums the slices'
  partial outputs and hands each rank back its own rows: one all-gather and one
  reduce-scatter per layer, where splitting the down projection by columns instead would
  need a second gather of the 2.7x wider activation.
- Embedding and LM head: split by vocabulary rows (tied models share the one shard). A
  lookup gathers the int64 ids, each rank fills the rows of the ids it holds, and the
  reduce-scatter sums one row and zeros: exact. The LM head gathers the rows to score,
  each rank scores them against its vocabulary slice, and an all-to-all returns each
  rank the whole vocabulary for its own rows: every logit is one dot product, as with
  one rank.
The sums of the down projection's partial outputs are the one place where numerics move
(fp32 rounding of a sum in another order); greedy tokens equal one rank's
(tests/unit/test_dp_attention.py). Norms and attention weights are replicated; so is an
EAGLE head's own layer (one decoder layer: splitting it would add collectives to each of
the S-1 draft steps to save little), while it borrows the target's sharded embedding
and, for EAGLE-1/2, its LM head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from actors.dp.attention_group import DPAttentionGroup
from actors.models.fp8_linear import is_fp8
from kestrel_kernels import layer_ops


def _shard_rows(weight: torch.Tensor, rows: int, start: int) -> torch.Tensor:
    """Rows [start, start + rows) of weight, zero rows past its end; a copy, so the full
    weight can be freed."""
    out = weight.new_zeros(rows, weight.shape[1])
    part = weight[start:start + rows]
    out[:part.shape[0]] = part
    return out


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows [start, start + shard) of the embedding; every shard has `shard`
    rows (zeros past the vocabulary) so the LM head's all-to-all blocks match."""

    def __init__(self, full: torch.Tensor, dp: DPAttentionGroup):
        super().__init__()
        self.vocab_size = full.shape[0]
        self.shard = -(-self.vocab_size // dp.world_size)
        self.start = dp.rank * self.shard
        self.weight = nn.Parameter(_shard_rows(full, self.shard, self.start), requires_grad=False)
        object.__setattr__(self, "dp", dp)  # not a submodule

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """ids [T] (any integer dtype) -> [T, H]. Every model forward starts here, so this
        opens the step's next phase."""
        T = input_ids.numel()
        padded = self.dp.open_forward(T).tokens
        ids = self.dp.gather_ids(input_ids, padded) - self.start  # [W*padded] int64, local
        held = (ids >= 0) & (ids < self.shard)  # [W*padded] bool
        rows = F.embedding(ids.clamp(0, self.shard - 1), self.weight)  # [W*padded, H]
        rows = rows.masked_fill(~held[:, None], 0)
        return self.dp.group.reduce_scatter_rows(rows)[:T]


class VocabParallelLMHead(nn.Module):
    """Logits over the whole vocabulary from each rank's shard: the embedding's (tied) or
    its own rows of lm_head.weight, laid out as the embedding's."""

    def __init__(self, embed: VocabParallelEmbedding, dp: DPAttentionGroup,
                 full: torch.Tensor | None = None):
        super().__init__()
        object.__setattr__(self, "_embed", embed)  # tied: read at call time, never copied
        self.own = None if full is None else nn.Parameter(
            _shard_rows(full, embed.shard, embed.start), requires_grad=False)
        object.__setattr__(self, "dp", dp)

    @property
    def weight(self) -> torch.Tensor:
        return self._embed.weight if self.own is None else self.own

    def forward(self, hidden: torch.Tensor, limit: int | None = None) -> torch.Tensor:
        """hidden [R, H] -> logits [R, V] (V: the vocabulary, or its first `limit` ids)."""
        e, dp = self._embed, self.dp
        R, W = hidden.shape[0], dp.world_size
        padded = dp.lm_head_rows(R)
        V = e.vocab_size if limit is None else min(limit, e.vocab_size)
        n = min(max(V - e.start, 0), e.shard)  # rows of this shard below V
        rows = dp.gather_rows(hidden, padded)  # [W*padded, H]
        local = F.linear(rows, self.weight[:n])  # [W*padded, n]
        if n < e.shard:
            local = F.pad(local, (0, e.shard - n))  # [W*padded, shard]
        got = dp.group.all_to_all_rows(local)  # block j: rank j's vocab slice, my rows
        logits = got.view(W, padded, e.shard).transpose(0, 1).reshape(padded, W * e.shard)
        return logits[:R, :V]


class ParallelMLP(nn.Module):
    """This rank's slice of an MLP: gate/up columns and down rows [lo, hi) of the
    intermediate dimension, run over every rank's tokens."""

    def __init__(self, full: nn.Module, dp: DPAttentionGroup):
        super().__init__()
        I = full.intermediate
        lo, hi = [(int(c[0]), int(c[-1]) + 1) for c in torch.arange(I).tensor_split(dp.world_size)][dp.rank]
        self.intermediate = hi - lo
        gate, up = full.gate_up_proj.weight.split(I)  # [I, H] each
        H = gate.shape[1]
        # Built on meta (no random init to throw away), then given the slices (copies).
        self.gate_up_proj = nn.Linear(H, 2 * self.intermediate, bias=False, device="meta")
        self.down_proj = nn.Linear(self.intermediate, H, bias=False, device="meta")
        self.gate_up_proj.weight = nn.Parameter(torch.cat([gate[lo:hi], up[lo:hi]]),
                                                requires_grad=False)
        self.down_proj.weight = nn.Parameter(full.down_proj.weight[:, lo:hi].clone(),
                                             requires_grad=False)
        object.__setattr__(self, "dp", dp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[0]
        rows = self.dp.gather_rows(x, self.dp.mlp_tokens(T))  # [W*padded, H]
        gate, up = self.gate_up_proj(rows).split(self.intermediate, -1)
        partial = self.down_proj(layer_ops.silu_and_mul(gate, up))  # [W*padded, H], a slice's sum
        return self.dp.group.reduce_scatter_rows(partial)[:T]


def shard_model(model: nn.Module, dp: DPAttentionGroup) -> None:
    """Replace a loaded LlamaForCausalLM's embedding, LM head and MLPs with this rank's
    shards (the full weights are freed when nothing else holds them)."""
    inner = model.model
    if is_fp8(model):
        raise ValueError("parallel.dp_attention does not shard FP8 layers (model.quantization=fp8 "
                         "or an FP8 checkpoint): set parallel.dp_attention=false")
    embed = VocabParallelEmbedding(inner.embed_tokens.weight.detach(), dp)
    untied = None if model.arch.tie_word_embeddings else model.lm_head.weight.detach()
    inner.embed_tokens = embed
    model.lm_head = VocabParallelLMHead(embed, dp, untied)
    for layer in inner.layers:
        layer.mlp = ParallelMLP(layer.mlp, dp)


def weight_bytes(*modules: nn.Module) -> int:
    """Bytes of the parameters and buffers of `modules`, each storage counted once."""
    storages = {}
    for m in modules:
        for t in [*m.parameters(), *m.buffers()]:
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())
