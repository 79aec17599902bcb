"""C06: replay a full batch of 4, then a batch of 2 padded to 4: every padded lane holds
the padding value and nothing of the first replay survives; outputs are cut to the raw
batch. Checked for every graph kind, from what the (fake) graph and the backend read."""

from __future__ import annotations

import pytest
import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner

FILL = 3  # not 0/1, so a missed fill cannot pass by accident
K, H, N, SLOTS = 2, 3, 3, 4


class RecordingBackend:
    def __init__(self):
        self.calls: list[dict] = []

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return FILL

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum,
                                                seq_lens_cpu, extend_lens=None, **kw):
        self.calls.append(dict(bs=bs, seq_lens=seq_lens.clone(), seq_lens_cpu=seq_lens_cpu.clone(),
                               req_pool_indices=req_pool_indices.clone()))


# kind -> (width, slots per request, runner kwargs, optional inputs it needs)
KINDS = {
    GraphKind.TARGET_DECODE: (1, 1, {}, ()),
    GraphKind.TARGET_VERIFY: (N, N, {}, ("custom_mask",)),
    GraphKind.DRAFT_DECODE: (K, SLOTS, dict(topk=K, hidden_size=H), ("topk_p", "topk_index", "hidden")),
    GraphKind.DRAFT_EXTEND: (N, N, dict(hidden_size=H), ("accept_lens", "hidden")),
}


def _batch(kind: GraphKind, bs: int, v: int) -> GraphBatch:
    """A batch whose every value is v (or derived from v) so stale lanes are visible."""
    W, L, _, needs = KINDS[kind]
    full = lambda *shape, dtype=torch.int64: torch.full(shape, v, dtype=dtype)
    extra = {}
    if "custom_mask" in needs:
        extra["custom_mask"] = torch.ones(bs, W, W, dtype=torch.bool)  # [bs, N, N] bool
    if "topk_p" in needs:
        extra["topk_p"] = full(bs, K, dtype=torch.float32)  # [bs, K]
        extra["topk_index"] = full(bs, K)  # [bs, K]
    if "hidden" in needs:
        rows = bs * W if kind == GraphKind.DRAFT_EXTEND else bs
        extra["hidden"] = full(rows, H, dtype=torch.float32)  # [rows, H]
    if "accept_lens" in needs:
        extra["accept_lens"] = torch.ones(bs, dtype=torch.int64)  # [bs]
    return GraphBatch(bs, full(bs * W), full(bs * W), full(bs * L), full(bs), full(bs),
                      full(bs), v * bs, width=W, **extra)


class SeeingForward:
    """The fake graph body: remembers every static input it was replayed on."""

    def __init__(self):
        self.seen: list[dict] = []

    def __call__(self, view: GraphBatch):
        names = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens",
                 "seq_lens_cpu", "accept_lens", "topk_p", "topk_index", "hidden", "custom_mask")
        self.seen.append({n: getattr(view, n).clone() for n in names if getattr(view, n) is not None})
        per_token = view.input_ids + view.positions  # [bs*W]
        per_req = view.seq_lens + view.req_pool_indices  # [bs]
        return per_token, per_req


PAD = {"input_ids": 0, "positions": 0, "out_cache_loc": 0, "req_pool_indices": 0,
       "seq_lens": FILL, "seq_lens_cpu": FILL, "topk_p": 0, "topk_index": 0, "hidden": 0,
       "custom_mask": False}


@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.value)
def test_padded_lanes_rewritten_every_replay(kind):
    W, L, kw, _ = KINDS[kind]
    backend, fwd = RecordingBackend(), SeeingForward()
    runner = GraphRunner(kind, [4], backend, width=W, slots_per_req=L, **kw)
    runner.capture(fwd)

    runner.replay(_batch(kind, 4, 77))  # fills all four lanes with 77s
    out_tok, out_req = runner.replay(_batch(kind, 2, 5))  # 2 lanes of 5s + 2 padded lanes

    seen = fwd.seen[-1]
    rows_per_lane = {"input_ids": W, "positions": W, "out_cache_loc": L,
                     "hidden": W if kind == GraphKind.DRAFT_EXTEND else 1}
    for name, t in seen.items():
        r = rows_per_lane.get(name, 1)
        raw, pad = t[:2 * r], t[2 * r:]
        assert pad.shape[0] == 2 * r, name
        if name == "accept_lens":
            assert (pad == W).all(), f"{name} padded lanes: {pad.tolist()}"
            assert (raw == 1).all()
            continue
        assert (pad == PAD[name]).all(), f"{name} padded lanes hold {pad.tolist()}"
        if name != "custom_mask":
            assert (raw == 5).all(), f"{name} raw lanes hold {raw.tolist()}"
        assert not (t == 77).any(), f"{name} kept a value of the first replay"

    call = backend.calls[-1]
    assert call["bs"] == 4
    assert call["seq_lens"].tolist() == [5, 5, FILL, FILL]
    assert call["seq_lens_cpu"].tolist() == [5, 5, FILL, FILL]
    assert call["req_pool_indices"].tolist() == [5, 5, 0, 0]

    # Outputs come back for the raw batch only.
    assert out_tok.shape[0] == 2 * W and out_tok.tolist() == [10] * (2 * W)
    assert out_req.tolist() == [10, 10]


def test_shrinking_twice_still_clean():
    """4 -> 3 -> 1 lanes: each replay rewrites exactly the lanes it pads."""
    W, L, kw, _ = KINDS[GraphKind.DRAFT_DECODE]
    fwd = SeeingForward()
    runner = GraphRunner(GraphKind.DRAFT_DECODE, [4], RecordingBackend(), width=W,
                         slots_per_req=L, **kw)
    runner.capture(fwd)
    for bs, v in ((4, 77), (3, 66), (1, 5)):
        runner.replay(_batch(GraphKind.DRAFT_DECODE, bs, v))
        seen = fwd.seen[-1]
        assert seen["seq_lens"].tolist() == [v] * bs + [FILL] * (4 - bs)
        assert seen["hidden"][bs:].eq(0).all() and seen["topk_index"][bs:].eq(0).all()
        assert seen["out_cache_loc"].tolist() == [v] * (bs * L) + [0] * ((4 - bs) * L)
