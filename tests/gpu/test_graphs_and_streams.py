"""Real CUDA graphs, streams and events for the padding and plan-stream rules (C04-C08,
C15-C17): graph replay equals eager at raw sizes that need padding and sizes that do not,
padded lanes are clean after every replay, and the plan stream on gives the same results
as off over many random iterations (with delays that expose a missing wait)."""

from __future__ import annotations

import random

import pytest
import torch

from actors.graphs.cuda_graph_runner import GraphBatch, GraphKind, GraphRunner, VerifyPath
from actors.graphs.plan_stream import PlanStream, VerifyInputs, prepare_verify_inputs

DEV = "cuda"
V, H, P = 97, 32, 512  # vocab, hidden, position table
K, N = 2, 4  # draft-decode lanes, verify / draft-extend width
SIZES = [1, 2, 4, 8]
FILL = 1
SLEEP = 20_000_000  # GPU cycles (~10 ms): long enough that a missing wait reads stale data


class TinyBackend:
    """Graph-capable backend stand-in: replay metadata = per-lane key counts in a static
    buffer that the captured forward reads, so stale or wrong metadata changes outputs."""

    def __init__(self):
        self.kv_len = None
        self.calls = 0

    def get_cuda_graph_seq_len_fill_value(self):
        return FILL

    def init_cuda_graph_state(self, max_bs, max_num_tokens):
        self.kv_len = torch.zeros(max_bs, dtype=torch.float32, device=DEV)  # [max_bs] fp32

    def init_forward_metadata_capture_cuda_graph(self, bs, num_tokens, req_pool_indices, seq_lens, **kw):
        self.kv_len[:bs].copy_(seq_lens)

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum,
                                                seq_lens_cpu, extend_lens=None, **kw):
        self.calls += 1
        if seq_lens_cpu is not None and seq_lens_sum is not None:
            assert seq_lens_sum == int(seq_lens_cpu.sum())  # C04: sum matches padded lens
        self.kv_len[:bs].copy_(seq_lens)


class TinyModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Parameter(torch.randn(V, H, generator=g))
        self.pos = torch.nn.Parameter(torch.randn(P, H, generator=g) * 0.1)
        self.lin = torch.nn.Linear(H, V)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(V, H, generator=g) * 0.2)
            self.lin.bias.copy_(torch.randn(V, generator=g) * 0.1)


def body(m: TinyModel, b: GraphBatch, kv: torch.Tensor, W: int):
    """The forward math over one (raw or padded) batch; kv [bs] fp32 is the metadata."""
    bs = b.batch_size
    h = m.emb[b.input_ids] + m.pos[b.positions % P]  # [bs*W, H]
    h = h * (1 + kv[:, None].expand(bs, W).reshape(-1, 1) / 64)
    if b.topk_p is not None:  # draft decode: carried top-k and hidden, per lane
        lane = (b.topk_p[:, :, None] * m.emb[b.topk_index]).sum(1) + b.hidden  # [bs, H]
        h = h + lane[:, None, :].expand(bs, W, H).reshape(bs * W, H)
    elif b.hidden is not None:  # draft extend: per-token features
        h = h + b.hidden
    if b.accept_lens is not None:
        h = h + b.accept_lens.float()[:, None].expand(bs, W).reshape(-1, 1)
    if b.custom_mask is not None:
        h = h + b.custom_mask.sum(-1).reshape(-1, 1).float()
    return m.lin(h), kv * 2  # [bs*W, V] per token, [bs] per lane


KINDS = {
    GraphKind.TARGET_DECODE: (1, {}),
    GraphKind.TARGET_VERIFY: (N, {}),
    GraphKind.DRAFT_DECODE: (K, dict(topk=K, hidden_size=H)),
    GraphKind.DRAFT_EXTEND: (N, dict(hidden_size=H)),
}


def random_batch(kind: GraphKind, bs: int, g: torch.Generator) -> GraphBatch:
    W, _ = KINDS[kind]
    ri = lambda hi, *shape: torch.randint(0, hi, shape, generator=g, device=DEV)
    seq = ri(200, bs) + W + 1  # [bs] int64
    extra = {}
    if kind == GraphKind.TARGET_VERIFY:
        extra["custom_mask"] = ri(2, bs, W, W).bool()  # [bs, N, N]
    if kind == GraphKind.DRAFT_DECODE:
        extra["topk_p"] = torch.rand(bs, K, generator=g, device=DEV)  # [bs, K]
        extra["topk_index"] = ri(V, bs, K)  # [bs, K]
        extra["hidden"] = torch.randn(bs, H, generator=g, device=DEV)  # [bs, H]
    if kind == GraphKind.DRAFT_EXTEND:
        extra["hidden"] = torch.randn(bs * W, H, generator=g, device=DEV)  # [bs*N, H]
        extra["accept_lens"] = ri(W, bs) + 1  # [bs]
    pos = (seq[:, None] + torch.arange(W, device=DEV)).reshape(-1)  # [bs*W]
    return GraphBatch(bs, ri(V, bs * W), pos, ri(1000, bs * W) + 1, ri(16, bs), seq, seq.cpu(),
                      int(seq.sum()), width=W, **extra)


@pytest.fixture(scope="module")
def model():
    return TinyModel().to(DEV)


def make_runner(kind, model):
    W, kw = KINDS[kind]
    backend = TinyBackend()
    runner = GraphRunner(kind, SIZES, backend, width=W, device=DEV, **kw)
    assert runner.use_cuda_graph
    runner.capture(lambda view: body(model, view, backend.kv_len[:view.batch_size], W))
    return runner, backend


@torch.no_grad()
@pytest.mark.parametrize("kind", list(KINDS), ids=lambda k: k.value)
def test_graph_replay_equals_eager(kind, model):
    W, _ = KINDS[kind]
    runner, backend = make_runner(kind, model)
    g = torch.Generator(device=DEV).manual_seed(1)
    order = [1, 2, 3, 4, 5, 7, 8, 8, 3, 6, 1, 4, 2, 5]  # padded (3,5,6,7) and exact sizes
    random.Random(0).shuffle(order)
    for raw in order:
        batch = random_batch(kind, raw, g)
        want_tok, want_req = body(model, batch, batch.seq_lens.float(), W)
        seq_obj, total = batch.seq_lens, batch.seq_lens_sum
        got_tok, got_req = runner.replay(batch)
        torch.cuda.synchronize()
        assert got_tok.shape == want_tok.shape and got_req.shape == want_req.shape
        torch.testing.assert_close(got_tok, want_tok, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got_req, want_req)
        # C04/C05: the caller's batch is its own again.
        assert batch.batch_size == raw and batch.seq_lens is seq_obj and batch.seq_lens_sum == total
        # C06: the static padded lanes hold the padding values, nothing older.
        bs = runner.pad_size(raw)
        assert (runner.seq_lens[raw:bs] == FILL).all()
        assert (runner.req_pool_indices[raw:bs] == 0).all()
        assert (runner.positions[raw * W:bs * W] == 0).all()
        assert (runner.out_cache_loc[raw * W:bs * W] == 0).all()
        if runner.hidden is not None:
            rows = W if kind == GraphKind.DRAFT_EXTEND else 1
            assert (runner.hidden[raw * rows:bs * rows] == 0).all()
    assert backend.calls == len(order)


@torch.no_grad()
def test_graph_restores_batch_when_metadata_raises(model):
    runner, backend = make_runner(GraphKind.TARGET_DECODE, model)
    batch = random_batch(GraphKind.TARGET_DECODE, 3, torch.Generator(device=DEV).manual_seed(2))
    ids, total = batch.input_ids, batch.seq_lens_sum

    def boom(*a, **k):
        raise RuntimeError("metadata failed")

    backend.init_forward_metadata_replay_cuda_graph = boom
    with pytest.raises(RuntimeError):
        runner.replay(batch)
    assert batch.batch_size == 3 and batch.input_ids is ids and batch.seq_lens_sum == total


# ------------------------------------------------------------------------- plan stream
class NoEventWait(PlanStream):
    """Broken on purpose: the plan stream does not wait for the inputs."""

    def prepare(self, fn, *, inputs_written_on=None):
        compute = self.compute_stream()
        with torch.cuda.stream(self.stream):
            out = fn()
        compute.wait_stream(self.stream)
        return out


class NoComputeWait(PlanStream):
    """Broken on purpose: the compute stream does not wait for the preparation."""

    def prepare(self, fn, *, inputs_written_on=None):
        self._event.record(self.compute_stream())
        self.stream.wait_event(self._event)
        with torch.cuda.stream(self.stream):
            return fn()


@torch.no_grad()
def run_steps(plan: PlanStream, iters: int, seed: int, compute_sleep: int, plan_sleep: int):
    """Verify-like steps: compute writes inputs, the plan stream builds new ids / slots /
    positions from them, compute consumes those. Returns every step's result on the host."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    B, R, L = 6, 16, 256
    table = torch.arange(R * L, device=DEV).reshape(R, L)  # [R, L] int64 req_to_token
    old = torch.zeros(B * N, dtype=torch.int64, device=DEV)
    batch = GraphBatch(B, old, old.clone(), old.clone(), torch.zeros(B, dtype=torch.int64, device=DEV),
                       torch.zeros(B, dtype=torch.int64, device=DEV), width=N)
    results = []
    for _ in range(iters):
        torch.cuda._sleep(compute_sleep)  # the draft forwards take a while
        batch.seq_lens = torch.randint(1, L - N, (B,), generator=g, device=DEV)  # [B]
        batch.req_pool_indices = torch.randint(0, R, (B,), generator=g, device=DEV)  # [B]
        draft = torch.randint(0, V, (B * N,), generator=g, device=DEV)  # [B*N]
        z = torch.zeros(B, N, dtype=torch.int64, device=DEV)
        verify = VerifyInputs(draft, torch.ones(B, N, N, dtype=torch.bool, device=DEV),
                              (batch.seq_lens[:, None] + torch.arange(N, device=DEV)).reshape(-1), z, z, z)

        def build():
            torch.cuda._sleep(plan_sleep)  # metadata work takes a while
            # The modulos change nothing when the inputs are ready; when a broken variant
            # reads them too early they keep stale values from indexing out of bounds.
            cols = (batch.seq_lens % (L - N))[:, None] + torch.arange(N, device=DEV)  # [B, N]
            rows = batch.req_pool_indices % R  # [B]
            return {"input_ids": verify.draft_tokens * 3 + 1,
                    "out_cache_loc": table[rows[:, None], cols].reshape(-1),
                    "positions": cols.reshape(-1)}

        prepare_verify_inputs(plan, batch, verify, build)
        # The forward on the compute stream reads what the plan stream made.
        res = batch.input_ids * 1_000_003 + batch.out_cache_loc * 7 + batch.positions
        results.append(res.cpu())
    return results


def test_plan_stream_matches_inline():
    off = run_steps(PlanStream(False, DEV), 150, 5, SLEEP // 20, SLEEP // 20)
    on = run_steps(PlanStream(True, DEV), 150, 5, SLEEP // 20, SLEEP // 20)
    assert all(torch.equal(a, b) for a, b in zip(off, on))
    on_slow = run_steps(PlanStream(True, DEV), 20, 5, SLEEP, SLEEP)
    assert all(torch.equal(a, b) for a, b in zip(off, on_slow))


@pytest.mark.parametrize("broken,compute_sleep,plan_sleep",
                         [(NoEventWait, SLEEP, 0), (NoComputeWait, 0, SLEEP)],
                         ids=["plan-does-not-wait", "compute-does-not-wait"])
def test_missing_wait_is_detected(broken, compute_sleep, plan_sleep):
    """The comparison above can fail: drop one wait and results go wrong."""
    ref = run_steps(PlanStream(False, DEV), 10, 9, 0, 0)
    bad = run_steps(broken(True, DEV), 10, 9, compute_sleep, plan_sleep)
    torch.cuda.synchronize()
    assert not all(torch.equal(a, b) for a, b in zip(ref, bad))


@torch.no_grad()
def test_graph_verify_with_plan_stream_matches_inline(model):
    """C15 + C17 on the GPU: replay metadata built on the plan stream, graph replay on the
    compute stream, equal to the same path with the plan stream off and to eager."""
    outs = {}
    for enabled in (False, True):
        runner, backend = make_runner(GraphKind.TARGET_VERIFY, model)
        path = VerifyPath(backend, lambda fb: None, runner=runner, plan=PlanStream(enabled, DEV))
        g = torch.Generator(device=DEV).manual_seed(3)
        rng = random.Random(4)
        outs[enabled] = []
        for _ in range(60):
            batch = random_batch(GraphKind.TARGET_VERIFY, rng.choice([1, 3, 4, 5, 8]), g)
            torch.cuda._sleep(SLEEP // 20)
            draft = torch.randint(0, V, (batch.batch_size * N,), generator=g, device=DEV)
            z = torch.zeros(batch.batch_size, N, dtype=torch.int64, device=DEV)
            verify = VerifyInputs(draft, batch.custom_mask, batch.positions, z, z, z)
            prepared = path.prepare_verify(batch, True, verify,
                                           build=lambda b, v: {"input_ids": v.draft_tokens + 0})
            tok, _ = path.forward_verify(prepared, batch.batch_size)
            want, _ = body(model, batch, batch.seq_lens.float(), N)
            torch.testing.assert_close(tok, want, rtol=1e-4, atol=1e-4)
            outs[enabled].append(tok.clone().cpu())
    for a, b in zip(outs[False], outs[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
