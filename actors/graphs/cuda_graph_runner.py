"""CUDA-graph runners: pad a raw batch to a captured size, replay, slice back (docs/design.md, "CUDA graphs").

One :class:`GraphRunner` serves one forward kind (:class:`GraphKind`): target decode (1
token per request), target verify (N), draft decode (K lanes, carried top-k + hidden) or
draft extend (N, per-token target features + accept counts). It owns one set of static
input buffers sized for the largest captured batch; the graph of size ``bs`` reads the
first ``bs`` lanes of each. On CUDA each size is a ``torch.cuda.CUDAGraph`` captured into
one memory pool shared by all sizes; elsewhere a graph is the forward called eagerly on
the same padded static buffers, so CPU tests exercise the same padding path.

Contracts (docs/spec_v2_contracts.md):

- C04/C07/C08: the backend's replay hook sees the padded batch size, padded ``seq_lens``
  (FILL in padded lanes) and ``seq_lens_sum = raw + (bs - raw) * FILL``; verify and draft
  extend also see extend length N in every lane, draft extend accept count N in padded
  lanes. Outputs are sliced back to the raw batch.
- C05: the caller's batch carries the padded view only while the replay runs and gets
  its own values back afterwards, also when the replay raises; a ``seq_lens_sum`` of
  None stays None and no sum is derived from it.
- C06: every replay rewrites every padded lane (FILL in ``seq_lens``, 0 in request rows,
  positions, ids, top-k and hidden, slot 0 in ``out_cache_loc``, no mask bits), so no
  value of an earlier replay survives.
- C15: :class:`VerifyPath` - non-graph verify builds attention metadata in the forward,
  after DP padding; the graph path builds it once while preparing and never again.
"""
from __future__ import annotations

import bisect
import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

import torch

from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.graphs.capture_progress import PROGRESS
from actors.graphs.plan_stream import PlanStream, VerifyInputs, prepare_verify_inputs

__all__ = [
    "GraphKind",
    "GraphBatch",
    "GraphBackend",
    "MetadataInForward",
    "graph_backend",
    "GraphRunner",
    "pad_graph_batch",
    "EagerGraph",
    "capture_cuda_graph",
    "padded_size",
    "PreparedVerify",
    "VerifyPath",
]


class GraphKind(enum.Enum):
    TARGET_DECODE = "target_decode"
    TARGET_VERIFY = "target_verify"
    DRAFT_DECODE = "draft_decode"
    DRAFT_EXTEND = "draft_extend"

    @property
    def mode(self) -> ForwardMode:
        return {
            GraphKind.TARGET_DECODE: ForwardMode.DECODE,
            GraphKind.TARGET_VERIFY: ForwardMode.TARGET_VERIFY,
            GraphKind.DRAFT_DECODE: ForwardMode.DECODE,
            GraphKind.DRAFT_EXTEND: ForwardMode.DRAFT_EXTEND,
        }[self]


@dataclass
class GraphBatch:
    """What a graph runner reads from one raw batch (B requests, W tokens each).

    This is the per-forward object of docs/design.md, "Where state lives": the runner may point its fields at
    padded static buffers while a replay runs and puts the caller's objects back after.
    """

    batch_size: int  # raw B (0 for an idle DP rank)
    input_ids: torch.Tensor  # [B*W] integer
    positions: torch.Tensor  # [B*W] integer
    out_cache_loc: torch.Tensor  # [B*L] integer, L slots per request (L = W except draft decode)
    req_pool_indices: torch.Tensor  # [B] integer, rows of req_to_token
    seq_lens: torch.Tensor  # [B] integer, keys per request as the kind defines them
    seq_lens_cpu: torch.Tensor | None = None  # [B] int64 host copy of seq_lens
    seq_lens_sum: int | None = None  # sum of seq_lens, None when the caller did not compute it
    width: int = 1  # W: tokens per request (1 decode, N verify / draft extend, K draft decode)
    accept_lens: torch.Tensor | None = None  # [B] integer, draft extend: accepted tokens
    topk_p: torch.Tensor | None = None  # [B, K] float, draft decode: carried top-k probs
    topk_index: torch.Tensor | None = None  # [B, K] integer, draft decode: carried top-k ids
    hidden: torch.Tensor | None = None  # [B, H] draft decode / [B*W, H] draft extend
    custom_mask: torch.Tensor | None = None  # [B, W, E] bool, target verify tree mask


# The fields a replay points at static buffers (and restores afterwards).
_SWAPPED = ("batch_size", "input_ids", "positions", "out_cache_loc", "req_pool_indices",
            "seq_lens", "seq_lens_cpu", "seq_lens_sum", "accept_lens", "topk_p",
            "topk_index", "hidden", "custom_mask")
# Optional inputs each kind needs (an absent one would leave stale static lanes).
_KIND_INPUTS = {
    GraphKind.TARGET_DECODE: (),
    GraphKind.TARGET_VERIFY: ("custom_mask",),
    GraphKind.DRAFT_DECODE: ("topk_p", "topk_index", "hidden"),
    GraphKind.DRAFT_EXTEND: ("accept_lens", "hidden"),
}
_OPTIONAL = ("accept_lens", "topk_p", "topk_index", "hidden", "custom_mask")


class GraphBackend(Protocol):
    """The attention-backend hooks a runner calls (FlashInfer/Triton style)."""

    def get_cuda_graph_seq_len_fill_value(self) -> int: ...

    def init_forward_metadata_replay_cuda_graph(
        self, bs: int, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
        seq_lens_sum: int | None, seq_lens_cpu: torch.Tensor | None,
        extend_lens: torch.Tensor | None = None, **kwargs: Any) -> None: ...

    # Optional: init_cuda_graph_state(max_bs, max_num_tokens) and
    # init_forward_metadata_capture_cuda_graph(bs, num_tokens, req_pool_indices, seq_lens, **kw).


class MetadataInForward:
    """The replay hooks of a backend whose captured forward builds its own metadata.

    A runner whose forward calls ``backend.init_forward_metadata`` (as every Kestrel
    forward does) needs no separate replay planning: the forward reads the padded static
    inputs. Backends without the hooks (torch_native, the CPU path) get them from here.
    """

    def __init__(self, backend: Any):
        self.backend = backend

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return int(self.backend.get_cuda_graph_seq_len_fill_value())

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens,
                                                seq_lens_sum, seq_lens_cpu, extend_lens=None,
                                                **kwargs: Any) -> None:
        """Nothing to plan: the forward rebuilds metadata from the padded inputs."""


def graph_backend(backend: Any) -> Any:
    """``backend`` when it has the runner's replay hook, else :class:`MetadataInForward`."""
    if hasattr(backend, "init_forward_metadata_replay_cuda_graph"):
        return backend
    return MetadataInForward(backend)


def _padded_sum(raw_sum: int | None, raw_bs: int, bs: int, fill: int) -> int | None:
    """C04/C05: the sum matching padded seq_lens; None stays None (never None + x)."""
    if raw_sum is None:
        return None
    return int(raw_sum) + (bs - raw_bs) * fill


def _check_rows(name: str, t: torch.Tensor, rows: int) -> None:
    # copy_ would broadcast a [1] tensor over every lane silently; insist on exact rows.
    if t.dim() == 0 or t.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} leading rows, got shape {tuple(t.shape)}")


def _write(dst: torch.Tensor, src: torch.Tensor, rows: int, pad) -> None:
    """dst[:rows] = src, dst[rows:] = pad: the whole used range is rewritten (C06)."""
    dst[:rows].copy_(src)
    dst[rows:].fill_(pad)


def _slice_out(out: Any, bs: int, raw: int, width: int) -> Any:
    """Cut graph outputs back to the raw batch: per-token rows [bs*W], per-request rows [bs]."""
    if isinstance(out, torch.Tensor):
        if out.dim() > 0 and out.shape[0] == bs * width:
            return out[:raw * width]
        if out.dim() > 0 and out.shape[0] == bs:
            return out[:raw]
        return out
    if isinstance(out, (tuple, list)):
        return type(out)(_slice_out(o, bs, raw, width) for o in out)
    if isinstance(out, dict):
        return {k: _slice_out(v, bs, raw, width) for k, v in out.items()}
    return out


def pad_graph_batch(batch: GraphBatch, bs: int, fill: int) -> GraphBatch:
    """A new batch of ``bs`` lanes (DP padding for the eager path); the caller's is untouched.

    Padded lanes follow the graph rules: FILL in seq_lens, accept count W, zeros (slot 0,
    row 0, no mask bits) elsewhere. Integer tensors come out int64 (C02).
    """
    raw, W = batch.batch_size, batch.width
    if bs < raw:
        raise ValueError(f"cannot pad a batch of {raw} to {bs}")

    def pad(t: torch.Tensor | None, per_lane: int, value, int64: bool = True):
        if t is None:
            return None
        dtype = torch.int64 if int64 and not t.dtype.is_floating_point and t.dtype != torch.bool else t.dtype
        out = torch.empty((bs * per_lane, *t.shape[1:]), dtype=dtype, device=t.device)
        _check_rows("padded input", t, raw * per_lane)
        _write(out, t, raw * per_lane, value)
        return out

    slots = batch.out_cache_loc.shape[0] // raw if raw else W
    hid = (batch.hidden.shape[0] // raw if raw else 1) if batch.hidden is not None else 1
    return dataclasses.replace(
        batch,
        batch_size=bs,
        input_ids=pad(batch.input_ids, W, 0),
        positions=pad(batch.positions, W, 0),
        out_cache_loc=pad(batch.out_cache_loc, slots, 0),
        req_pool_indices=pad(batch.req_pool_indices, 1, 0),
        seq_lens=pad(batch.seq_lens, 1, fill),
        seq_lens_cpu=pad(batch.seq_lens_cpu, 1, fill),
        seq_lens_sum=_padded_sum(batch.seq_lens_sum, raw, bs, fill),
        accept_lens=pad(batch.accept_lens, 1, W),
        topk_p=pad(batch.topk_p, 1, 0),
        topk_index=pad(batch.topk_index, 1, 0),
        hidden=pad(batch.hidden, hid, 0),
        custom_mask=pad(batch.custom_mask, 1, False),
    )


class EagerGraph:
    """CPU stand-in for a captured graph: replay = the forward on the static view."""

    def __init__(self, forward: Callable[[GraphBatch], Any], view: GraphBatch):
        self._forward, self._view = forward, view
        self.output: Any = None

    def replay(self) -> None:
        self.output = self._forward(self._view)


class _CudaGraph:
    """A captured torch.cuda.CUDAGraph and the static outputs its replay rewrites."""

    def __init__(self, graph: "torch.cuda.CUDAGraph", output: Any):
        self._graph, self.output = graph, output

    def replay(self) -> None:
        self._graph.replay()


def padded_size(sizes: list[int], raw_bs: int) -> int | None:
    """The smallest of the sorted captured ``sizes`` >= raw_bs, or None when none is."""
    if raw_bs < 0:
        raise ValueError(f"batch size must be >= 0, got {raw_bs}")
    i = bisect.bisect_left(sizes, raw_bs)
    return sizes[i] if i < len(sizes) else None


def capture_cuda_graph(forward: Callable[[Any], Any], view: Any, pool: Any,
                       stream: "torch.cuda.Stream", size: int) -> _CudaGraph:
    """Record ``forward(view)`` as one CUDA graph in memory ``pool`` on ``stream`` (not
    the legacy default stream), after two warm-up runs there: lazy inits, Triton compiles
    and library handles stay out of the graph. ``size``: the batch size it serves."""
    free_before = PROGRESS.free_before()
    device = stream.device
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            forward(view)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = forward(view)
    PROGRESS.tick(size, free_before)
    return _CudaGraph(graph, out)


class GraphRunner:
    """Captured graphs of one forward kind, with the padding rules of docs/design.md, "CUDA graphs"."""

    def __init__(self, kind: GraphKind, batch_sizes: Iterable[int], backend: GraphBackend, *,
                 width: int = 1, slots_per_req: int | None = None, topk: int = 0,
                 hidden_size: int = 0, hidden_dtype: torch.dtype = torch.float32,
                 mask_width: int | None = None, device: torch.device | str = "cpu",
                 use_cuda_graph: bool | None = None):
        sizes = sorted(set(int(b) for b in batch_sizes))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"captured batch sizes must be positive integers, got {sizes}")
        if not hasattr(backend, "init_forward_metadata_replay_cuda_graph"):
            raise TypeError(f"{type(backend).__name__} has no init_forward_metadata_replay_cuda_graph")
        if kind == GraphKind.TARGET_DECODE and width != 1:
            raise ValueError("target decode runs one token per request")
        if kind == GraphKind.DRAFT_DECODE and (topk < 1 or hidden_size < 1):
            raise ValueError("draft decode needs topk >= 1 and hidden_size >= 1")
        if kind == GraphKind.DRAFT_EXTEND and hidden_size < 1:
            raise ValueError("draft extend needs hidden_size >= 1")
        self.kind, self.sizes, self.backend = kind, sizes, backend
        self.width = int(width)
        self.slots_per_req = int(slots_per_req or width)
        self.device = torch.device(device)
        self.use_cuda_graph = (self.device.type == "cuda") if use_cuda_graph is None else use_cuda_graph
        if self.use_cuda_graph and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.fill = int(backend.get_cuda_graph_seq_len_fill_value())
        self.max_bs = sizes[-1]
        self._needs = _KIND_INPUTS[kind]
        W, L, M, dev, i64 = self.width, self.slots_per_req, self.max_bs, self.device, torch.int64
        # Static inputs; the graph of size bs reads the first bs lanes of each.
        self.input_ids = torch.zeros(M * W, dtype=i64, device=dev)  # [M*W] int64
        self.positions = torch.zeros(M * W, dtype=i64, device=dev)  # [M*W] int64
        self.out_cache_loc = torch.zeros(M * L, dtype=i64, device=dev)  # [M*L] int64, slot 0 = pad
        self.req_pool_indices = torch.zeros(M, dtype=i64, device=dev)  # [M] int64
        self.seq_lens = torch.full((M,), self.fill, dtype=i64, device=dev)  # [M] int64
        self.seq_lens_cpu = torch.full((M,), self.fill, dtype=i64)  # [M] int64 host mirror
        # Extend length per lane: constant W, padded lanes included (C07/C08).
        self.extend_lens = (torch.full((M,), W, dtype=i64, device=dev)  # [M] int64
                            if kind in (GraphKind.TARGET_VERIFY, GraphKind.DRAFT_EXTEND) else None)
        self.accept_lens = (torch.full((M,), W, dtype=i64, device=dev)  # [M] int64
                            if kind == GraphKind.DRAFT_EXTEND else None)
        self.topk_p = self.topk_index = self.hidden = self.custom_mask = None
        if kind == GraphKind.DRAFT_DECODE:
            self.topk_p = torch.zeros(M, topk, dtype=torch.float32, device=dev)  # [M, K] fp32
            self.topk_index = torch.zeros(M, topk, dtype=i64, device=dev)  # [M, K] int64
            self.hidden = torch.zeros(M, hidden_size, dtype=hidden_dtype, device=dev)  # [M, H]
        elif kind == GraphKind.DRAFT_EXTEND:
            self.hidden = torch.zeros(M * W, hidden_size, dtype=hidden_dtype, device=dev)  # [M*W, H]
        elif kind == GraphKind.TARGET_VERIFY:
            E = int(mask_width or W)
            self.custom_mask = torch.zeros(M, W, E, dtype=torch.bool, device=dev)  # [M, W, E] bool
        self._hidden_rows = W if kind == GraphKind.DRAFT_EXTEND else 1  # hidden rows per lane
        # One view object per size: fixed tensor slices, so a captured graph's addresses hold.
        self._views = {bs: self._make_view(bs) for bs in sizes}
        self._graphs: dict[int, EagerGraph | _CudaGraph] = {}
        self.graph_pool = None

    # ------------------------------------------------------------------ sizes and views
    def pad_size(self, raw_bs: int) -> int | None:
        """The smallest captured size >= raw_bs, or None (too big: run eagerly)."""
        return padded_size(self.sizes, raw_bs)

    def can_run(self, batch: GraphBatch) -> bool:
        return bool(self._graphs) and self.pad_size(batch.batch_size) is not None

    def _make_view(self, bs: int) -> GraphBatch:
        W, L = self.width, self.slots_per_req
        cut = lambda t, rows: None if t is None else t[:rows]
        return GraphBatch(
            batch_size=bs, input_ids=self.input_ids[:bs * W], positions=self.positions[:bs * W],
            out_cache_loc=self.out_cache_loc[:bs * L], req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs], seq_lens_cpu=self.seq_lens_cpu[:bs],
            seq_lens_sum=bs * self.fill, width=W, accept_lens=cut(self.accept_lens, bs),
            topk_p=cut(self.topk_p, bs), topk_index=cut(self.topk_index, bs),
            hidden=cut(self.hidden, bs * self._hidden_rows), custom_mask=cut(self.custom_mask, bs))

    def _extend_view(self, bs: int) -> torch.Tensor | None:
        return None if self.extend_lens is None else self.extend_lens[:bs]

    # ------------------------------------------------------------------------- capture
    def capture(self, forward: Callable[[GraphBatch], Any], pool: Any = None) -> None:
        """Record ``forward(view)`` for every captured size (CPU: remember it for replay),
        in memory ``pool`` when given (another runner's, whose replays never overlap these)."""
        if not self.use_cuda_graph:
            self._graphs = {bs: EagerGraph(forward, self._views[bs]) for bs in self.sizes}
            return
        init_state = getattr(self.backend, "init_cuda_graph_state", None)
        if init_state is not None:
            init_state(self.max_bs, self.max_bs * self.width)
        capture_meta = getattr(self.backend, "init_forward_metadata_capture_cuda_graph", None)
        self.graph_pool = pool or torch.cuda.graph_pool_handle()  # one pool shared by every size
        stream = torch.cuda.Stream(self.device)  # capture may not use the legacy default stream
        # Largest first: smaller graphs then fit in blocks the pool already holds.
        for bs in reversed(self.sizes):
            view = self._views[bs]
            self._load_all_padding(bs)  # every lane a valid padded lane while capturing
            view.seq_lens_sum = bs * self.fill
            if capture_meta is not None:
                capture_meta(bs, bs * self.width, view.req_pool_indices, view.seq_lens,
                             extend_lens=self._extend_view(bs), forward_mode=self.kind.mode, spec=view)
            self._graphs[bs] = capture_cuda_graph(forward, view, self.graph_pool, stream, bs)
        torch.cuda.synchronize(self.device)

    def wrap_graphs(self, wrap: Callable[[int, Any], Any]) -> None:
        """Put each captured size's graph inside ``wrap(bs, graph)``, an object with the
        graph's ``replay()`` and ``output`` (dp_attention: a replay takes the step's phases)."""
        self._graphs = {bs: wrap(bs, g) for bs, g in self._graphs.items()}

    def _load_all_padding(self, bs: int) -> None:
        v = self._views[bs]
        for t, value in ((v.input_ids, 0), (v.positions, 0), (v.out_cache_loc, 0),
                         (v.req_pool_indices, 0), (v.seq_lens, self.fill),
                         (v.seq_lens_cpu, self.fill), (v.accept_lens, self.width),
                         (v.topk_p, 0), (v.topk_index, 0), (v.hidden, 0), (v.custom_mask, False)):
            if t is not None:
                t.fill_(value)

    # -------------------------------------------------------------------------- replay
    def _check(self, batch: GraphBatch) -> None:
        if batch.width != self.width:
            raise ValueError(f"{self.kind.value} runner has width {self.width}, batch has {batch.width}")
        for name in _OPTIONAL:
            given = getattr(batch, name) is not None
            if name in self._needs and not given:
                raise ValueError(f"{self.kind.value} replay needs batch.{name}")
            if name not in self._needs and given:
                raise ValueError(f"{self.kind.value} replay has no buffer for batch.{name}")
        n, W, L = batch.batch_size, self.width, self.slots_per_req
        for name, rows in (("input_ids", n * W), ("positions", n * W), ("out_cache_loc", n * L),
                           ("req_pool_indices", n), ("seq_lens", n)):
            _check_rows(name, getattr(batch, name), rows)
        if batch.seq_lens_cpu is not None:
            _check_rows("seq_lens_cpu", batch.seq_lens_cpu, n)
        for name in self._needs:
            rows = n * self._hidden_rows if name == "hidden" else n
            _check_rows(name, getattr(batch, name), rows)

    def _load(self, batch: GraphBatch, bs: int) -> GraphBatch:
        """Copy the raw batch into the first lanes of size ``bs``; rewrite the padded lanes."""
        n, W, L, v = batch.batch_size, self.width, self.slots_per_req, self._views[bs]
        _write(v.input_ids, batch.input_ids, n * W, 0)
        _write(v.positions, batch.positions, n * W, 0)
        _write(v.out_cache_loc, batch.out_cache_loc, n * L, 0)  # padded tokens write slot 0
        _write(v.req_pool_indices, batch.req_pool_indices, n, 0)
        _write(v.seq_lens, batch.seq_lens, n, self.fill)
        if batch.seq_lens_cpu is not None:
            _write(v.seq_lens_cpu, batch.seq_lens_cpu, n, self.fill)
        if v.accept_lens is not None:
            _write(v.accept_lens, batch.accept_lens, n, W)
        if v.topk_p is not None:
            _write(v.topk_p, batch.topk_p, n, 0)
            _write(v.topk_index, batch.topk_index, n, 0)
        if v.hidden is not None:
            _write(v.hidden, batch.hidden, n * self._hidden_rows, 0)
        if v.custom_mask is not None:
            _write(v.custom_mask, batch.custom_mask, n, False)
        v.seq_lens_sum = _padded_sum(batch.seq_lens_sum, n, bs, self.fill)
        return v

    def _size_for(self, batch: GraphBatch, bs: int | None) -> int:
        raw = batch.batch_size
        if bs is None:
            bs = self.pad_size(raw)
            if bs is None:
                raise ValueError(f"batch of {raw} exceeds the largest captured size {self.max_bs}")
        elif bs not in self._views or bs < raw:
            raise ValueError(f"cannot replay a batch of {raw} at size {bs} (captured {self.sizes})")
        if bs not in self._graphs:
            raise RuntimeError("capture() must run before replay()")
        return bs

    def _swap_in(self, batch: GraphBatch, view: GraphBatch) -> dict[str, Any]:
        saved = {f: getattr(batch, f) for f in _SWAPPED}
        for f in _SWAPPED:
            setattr(batch, f, getattr(view, f))
        if saved["seq_lens_cpu"] is None:
            batch.seq_lens_cpu = None  # never hand out a stale host mirror
        return saved

    def _metadata(self, batch: GraphBatch, bs: int) -> None:
        self.backend.init_forward_metadata_replay_cuda_graph(
            bs, batch.req_pool_indices, batch.seq_lens, batch.seq_lens_sum, batch.seq_lens_cpu,
            extend_lens=self._extend_view(bs), forward_mode=self.kind.mode, spec=batch)

    def init_replay_metadata(self, batch: GraphBatch, *, bs: int | None = None) -> int:
        """Load the padded inputs and build replay metadata only (the plan-stream half of
        a replay); returns the padded size. The caller's batch is restored afterwards."""
        self._check(batch)
        bs = self._size_for(batch, bs)
        saved = self._swap_in(batch, self._load(batch, bs))
        try:
            self._metadata(batch, bs)
        finally:
            for f, value in saved.items():
                setattr(batch, f, value)
        return bs

    def replay(self, batch: GraphBatch, *, bs: int | None = None, metadata_ready: bool = False) -> Any:
        """Pad ``batch`` to ``bs`` (default: the next captured size), build replay metadata
        unless ``metadata_ready``, replay, and return outputs cut to the raw batch.

        On CUDA the returned tensors are views of the graph's static outputs: the next
        replay of that size overwrites them.
        """
        self._check(batch)
        raw = batch.batch_size
        bs = self._size_for(batch, bs)
        # While the replay runs, the batch object is the padded view (what hooks reading the
        # batch must see); its own values come back in `finally`, whatever happens (C05).
        saved = self._swap_in(batch, self._load(batch, bs))
        try:
            if not metadata_ready:
                self._metadata(batch, bs)
            graph = self._graphs[bs]
            graph.replay()
            return _slice_out(graph.output, bs, raw, self.width)
        finally:
            for f, value in saved.items():
                setattr(batch, f, value)


    def replay_all_padded(self, bs: int) -> None:
        """Replay size ``bs`` with no request, every lane padding (a dp_attention rank with
        no work in a graph step: its captured collectives pair with its peers')."""
        empty = self.input_ids[:0]  # [0] int64
        none = {name: getattr(self, name)[:0] for name in self._needs}  # [0, ...] of each buffer's dtype
        self.replay(GraphBatch(0, empty, empty, empty, empty, empty, width=self.width, **none),
                    bs=bs)


# ----------------------------------------------------------------------------- C15
@dataclass
class PreparedVerify:
    """A target-verify batch after preparation, and what preparation already built."""

    batch: GraphBatch
    use_graph: bool
    metadata_ready: bool = False  # graph path: replay metadata built, forward must not rebuild
    graph_bs: int | None = None  # the captured size that metadata was built for


def _verify_forward_batch(b: GraphBatch) -> ForwardBatch:
    """The eager target-verify ForwardBatch: prefix = seq_lens, W new tokens per request."""
    return ForwardBatch(ForwardMode.TARGET_VERIFY, b.input_ids, b.positions, b.out_cache_loc,
                        b.req_pool_indices, b.seq_lens, [b.width] * b.batch_size,
                        custom_mask=b.custom_mask)


class VerifyPath:
    """Where target-verify attention metadata is built (C15).

    - Non-graph: preparation builds no metadata; :meth:`forward_verify` pads for DP first
      and then calls ``backend.init_forward_metadata`` on the padded batch, so a backend
      never holds metadata for a batch size the forward does not run.
    - Graph: preparation builds the replay metadata once (on the plan stream when one is
      on) and marks it ready; the forward replays without touching metadata again.
    """

    def __init__(self, backend: Any, eager_forward: Callable[[ForwardBatch], Any], *,
                 runner: GraphRunner | None = None, plan: PlanStream | None = None):
        self.backend, self.eager_forward, self.runner = backend, eager_forward, runner
        self.plan = plan or PlanStream(False)
        self.fill = int(backend.get_cuda_graph_seq_len_fill_value())

    def prepare_verify(self, batch: GraphBatch, use_graph: bool,
                       verify: VerifyInputs | None = None,
                       build: Callable[[GraphBatch, VerifyInputs], dict] | None = None,
                       graph_bs: int | None = None) -> PreparedVerify:
        """Verify preparation; with ``verify``/``build`` also rebinds the batch's inputs
        (``build`` returns the new fields; plan-stream rules C16/C17 apply). ``graph_bs``:
        the captured size to replay at (dp_attention: the group's), default the next one."""
        if use_graph and (self.runner is None or self.runner.pad_size(batch.batch_size) is None):
            raise ValueError("graph verify needs a runner with a captured size for this batch")
        prepared = PreparedVerify(batch, use_graph)

        def work() -> dict:
            new = build(batch, verify) if build is not None else {}
            if use_graph:  # metadata for the inputs the forward will run
                target = dataclasses.replace(batch, **new) if new else batch
                prepared.graph_bs = self.runner.init_replay_metadata(target, bs=graph_bs)
                prepared.metadata_ready = True
            return new

        if verify is not None:
            prepare_verify_inputs(self.plan, batch, verify, work)
        else:
            for name, value in self.plan.prepare(work).items():
                setattr(batch, name, value)
        return prepared

    def forward_verify(self, prepared: PreparedVerify, dp_padded_bs: int | None = None) -> Any:
        batch, raw = prepared.batch, prepared.batch.batch_size
        bs = max(raw, dp_padded_bs or raw)
        if prepared.use_graph:
            graph_bs = self.runner.pad_size(bs)
            if not prepared.metadata_ready or graph_bs != prepared.graph_bs:
                raise RuntimeError(f"graph verify metadata was built for size {prepared.graph_bs}, "
                                   f"the forward runs {graph_bs}: agree on DP padding first")
            return self.runner.replay(batch, bs=graph_bs, metadata_ready=True)
        padded = pad_graph_batch(batch, bs, self.fill)  # DP padding first ...
        fb = _verify_forward_batch(padded)
        self.backend.init_forward_metadata(fb)  # ... then metadata for the size that runs
        return _slice_out(self.eager_forward(fb), bs, raw, batch.width)
