"""Per-step DP synchronisation and the int64 rules for integer payloads.

Contracts (docs/spec_v2_contracts.md):

- C01: ids entering draft extend are int64, cast on the compute stream
  (:func:`draft_extend_ids`).
- C02: every integer tensor that enters a collective or a padded input is int64 on
  every rank, idle ones included (:func:`to_int64`, :func:`pad_int64`).
- C03: each rank's sync row is int64 ``[num_tokens, num_tokens_for_logprob,
  can_run_graph, is_extend, forward_mode]``; after one all-gather the group's token
  counts are column 0, ``can_run_graph`` is the min and ``is_extend`` the max
  (:func:`make_sync_row`, :func:`idle_sync_row`, :func:`dp_sync`).

"""

from __future__ import annotations

import contextlib
import operator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ContextManager

import torch

from actors.worker.forward_batch import ForwardMode

if TYPE_CHECKING:  # pragma: no cover
    from actors.dp.group import DPGroup

__all__ = [
    "SYNC_ROW_LEN",
    "COL_NUM_TOKENS",
    "COL_NUM_TOKENS_FOR_LOGPROB",
    "COL_CAN_RUN_GRAPH",
    "COL_IS_EXTEND",
    "COL_FORWARD_MODE",
    "make_sync_row",
    "idle_sync_row",
    "DPSyncResult",
    "dp_sync",
    "to_int64",
    "pad_int64",
    "stream_ctx",
    "draft_extend_ids",
]


# Sync row layout.
COL_NUM_TOKENS = 0
COL_NUM_TOKENS_FOR_LOGPROB = 1
COL_CAN_RUN_GRAPH = 2
COL_IS_EXTEND = 3
COL_FORWARD_MODE = 4
SYNC_ROW_LEN = 5

_INT64_MAX = 2**63 - 1


# --------------------------------------------------------------------------- int64
def _is_integer_dtype(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def to_int64(t: torch.Tensor) -> torch.Tensor:
    """Cast an integer tensor to int64 with the same values (same device).

    Returns ``t`` itself when it is already int64. Raises ``TypeError`` for floating,
    complex and bool tensors (token ids and counts are never those) and ``ValueError``
    for uint64 values that do not fit in int64.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"to_int64 needs a torch.Tensor, got {type(t).__name__}")
    if t.dtype == torch.int64:
        return t
    if not _is_integer_dtype(t.dtype):
        raise TypeError(f"to_int64 needs an integer tensor, got dtype {t.dtype}")
    out = t.to(torch.int64)
    if t.dtype == getattr(torch, "uint64", None) and out.numel() and bool((out < 0).any()):
        raise ValueError("uint64 values above 2**63-1 do not fit in int64")
    return out


def pad_int64(t: torch.Tensor, length: int, fill: int) -> torch.Tensor:
    """Pad a 1-D integer tensor to ``length`` with ``fill``; the result is int64.

    An empty input (an idle rank's batch) may have any dtype, as it has no values to
    lose: the result is ``length`` copies of ``fill`` in int64. A non-empty input must
    be an integer tensor (see :func:`to_int64`). ``length`` below the input's length
    is a ``ValueError``. The result is on the input's device; when no padding is
    needed it is ``to_int64(t)``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"pad_int64 needs a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"pad_int64 needs a 1-D tensor, got shape {tuple(t.shape)}")
    length = operator.index(length)
    fill = operator.index(fill)
    if not -_INT64_MAX - 1 <= fill <= _INT64_MAX:
        raise ValueError(f"fill {fill} does not fit in int64")
    n = t.shape[0]
    if length < n:
        raise ValueError(f"cannot pad a tensor of length {n} to a shorter length {length}")
    if n == 0:
        return torch.full((length,), fill, dtype=torch.int64, device=t.device)
    t64 = to_int64(t)
    if length == n:
        return t64
    out = torch.full((length,), fill, dtype=torch.int64, device=t.device)
    out[:n] = t64
    return out


# ------------------------------------------------------------------------ sync row
def _count(name: str, value: Any) -> int:
    try:
        v = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r}") from None
    if not 0 <= v <= _INT64_MAX:
        raise ValueError(f"{name} must be in [0, 2**63), got {v}")
    return v


def make_sync_row(
    num_tokens: int,
    num_tokens_for_logprob: int,
    can_run_graph: bool,
    is_extend: bool,
    forward_mode: ForwardMode | int,
    *,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """This rank's int64 sync row ``[5]`` for one step.

    Counts may be Python ints or single-element integer tensors (e.g. an int32
    producer's counts); they are taken exactly, never through float.
    """
    row = [
        _count("num_tokens", num_tokens),
        _count("num_tokens_for_logprob", num_tokens_for_logprob),
        int(bool(can_run_graph)),
        int(bool(is_extend)),
        int(ForwardMode(operator.index(forward_mode))),
    ]
    return torch.tensor(row, dtype=torch.int64, device=device)


def idle_sync_row(*, device: torch.device | str | None = None) -> torch.Tensor:
    """The row a rank with no work contributes: no tokens, graph-able, not extend, IDLE.

    ``can_run_graph`` is 1 so an idle rank never vetoes the busy ranks' CUDA graph.
    """
    return make_sync_row(0, 0, True, False, ForwardMode.IDLE, device=device)


@dataclass
class DPSyncResult:
    """What the group agreed on after one step's all-gather."""

    tokens_per_rank: list[int]
    logprob_tokens_per_rank: list[int]
    can_run_graph: bool  # min over ranks
    is_extend: bool  # max over ranks
    max_tokens: int
    forward_mode_per_rank: list[ForwardMode]

    @property
    def world_size(self) -> int:
        return len(self.tokens_per_rank)

    @property
    def all_idle(self) -> bool:
        return all(m == ForwardMode.IDLE for m in self.forward_mode_per_rank)

    @classmethod
    def from_gathered(cls, gathered: torch.Tensor) -> "DPSyncResult":
        """Reduce the ``[world, 5]`` int64 gather result (host side, exact ints)."""
        if gathered.dtype != torch.int64 or gathered.dim() != 2 or gathered.shape[1] != SYNC_ROW_LEN:
            raise ValueError(
                f"expected an int64 [world, {SYNC_ROW_LEN}] tensor, got "
                f"{gathered.dtype} {tuple(gathered.shape)}"
            )
        rows = gathered.cpu().tolist()
        tokens = [r[COL_NUM_TOKENS] for r in rows]
        return cls(
            tokens_per_rank=tokens,
            logprob_tokens_per_rank=[r[COL_NUM_TOKENS_FOR_LOGPROB] for r in rows],
            can_run_graph=bool(min(r[COL_CAN_RUN_GRAPH] for r in rows)),
            is_extend=bool(max(r[COL_IS_EXTEND] for r in rows)),
            max_tokens=max(tokens),
            forward_mode_per_rank=[ForwardMode(r[COL_FORWARD_MODE]) for r in rows],
        )


def dp_sync(group: "DPGroup", row: torch.Tensor) -> DPSyncResult:
    """One all-gather of every rank's int64 sync row, reduced on the host."""
    if not isinstance(row, torch.Tensor) or row.dtype != torch.int64:
        raise TypeError(
            f"dp_sync needs an int64 sync row, got {getattr(row, 'dtype', type(row).__name__)}"
        )
    if tuple(row.shape) != (SYNC_ROW_LEN,):
        raise ValueError(f"sync row must have shape ({SYNC_ROW_LEN},), got {tuple(row.shape)}")
    return DPSyncResult.from_gathered(group.all_gather_int64(row))


# ------------------------------------------------------------------- C01 (streams)
def stream_ctx(stream: Any) -> ContextManager[Any]:
    """Context that makes ``stream`` current.

    ``None`` -> no-op; a CUDA stream -> ``torch.cuda.stream(stream)``; any other object
    must itself be a context manager (a CPU fake stream that records enter/exit).
    """
    if stream is None:
        return contextlib.nullcontext()
    if isinstance(stream, torch.cuda.Stream) or (
        isinstance(stream, torch.Stream) and getattr(stream, "device_type", None) == "cuda"
    ):
        return torch.cuda.stream(stream)
    if hasattr(stream, "__enter__") and hasattr(stream, "__exit__"):
        return stream
    raise TypeError(
        f"compute_stream must be None, a CUDA stream or a context manager, got {type(stream).__name__}"
    )


def draft_extend_ids(accepted_ids: torch.Tensor, compute_stream: Any = None) -> torch.Tensor:
    """C01: the accepted ids as int64 (same values), cast on the compute stream.

    Call this before handing the ids to any plan-stream work.
    """
    with stream_ctx(compute_stream):
        return to_int64(accepted_ids)
