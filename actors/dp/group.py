"""One data-parallel group: the ranks (RankWorkers) of one Engine replica.

A thin wrapper over ``torch.distributed``. Rank 0 publishes ``master_addr`` and
``master_port`` (see :func:`find_free_port`); every rank then calls
:meth:`DPGroup.init` with them. The backend is gloo on CPU and NCCL when CUDA is
available (``backend="auto"``).

The step sync is :meth:`DPGroup.all_gather_int64`; dp_attention's tensor-parallel layers
use :meth:`all_gather_rows`, :meth:`reduce_scatter_rows` and :meth:`all_to_all_rows`.
An integer tensor enters none of them unless it is int64 (docs/design.md, "Data parallelism and dp_attention"; contract C02): a
rank that contributes an int32 tensor while another contributes int64 makes NCCL read the
wrong number of bytes and hang or corrupt memory, so a wrong dtype is a ``TypeError``
raised locally, before any communication. ``timeout_s`` bounds every collective: a rank
that died or hangs turns into an error on the others, never a wait without end.

With ``world_size == 1`` no process group is created at all: the gathers return their
input (with a leading axis of size 1 for ``all_gather_int64``), ``barrier``/``destroy`` do
nothing.
"""

from __future__ import annotations

import re
from datetime import timedelta

import torch
import torch.distributed as dist

from actors.ports import free_ports_below_ephemeral

__all__ = ["CollectiveFailed", "DPGroup", "find_free_port", "resolve_backend"]

DEFAULT_TIMEOUT_S = 300.0


class CollectiveFailed(RuntimeError):
    """A collective of the group failed: a peer died, hung past the timeout, or issued
    another collective. The message says which, without the backend's source location."""


def _collective(name: str, rank: int, fn, *args, **kwargs) -> None:
    try:
        fn(*args, **kwargs)
    except RuntimeError as e:
        reason = re.sub(r"^\[[^\]]*\]\s*", "", str(e).strip())  # gloo's "[file.cc:123] "
        raise CollectiveFailed(f"the DP group's {name} failed on rank {rank}: {reason}") from e


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port for the group's rendezvous on ``host`` (rank 0 publishes it): free now,
    and below the kernel's ephemeral range, so no outgoing connection or bind(0) of the
    processes Ray starts meanwhile can take it before rank 0's TCPStore binds it.

    It is checked on ``host`` (the address the other ranks connect to) and on every
    address, since TCPStore listens on the wildcard address whatever host it is given."""
    return free_ports_below_ephemeral(1, hosts=(host, ""))[0]


def resolve_backend(backend: str = "auto") -> str:
    """``"auto"`` -> ``"nccl"`` when CUDA is available, else ``"gloo"``."""
    b = backend.lower()
    if b == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if b not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    if b == "nccl" and not torch.cuda.is_available():
        raise RuntimeError("backend 'nccl' needs CUDA, which is not available")
    return b


class DPGroup:
    """The process group of one Engine replica's DP ranks (one process per rank)."""

    def __init__(self, rank: int, world_size: int, backend: str, device: torch.device):
        # Use DPGroup.init(); the constructor only records state.
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.device = device
        self._pg: dist.ProcessGroup | None = None
        self._owns_default_pg = False
        self._alive = True

    # ------------------------------------------------------------------ lifecycle
    @classmethod
    def init(
        cls,
        rank: int,
        world_size: int,
        master_addr: str = "127.0.0.1",
        master_port: int | None = None,
        backend: str = "auto",
        *,
        device: torch.device | str | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> "DPGroup":
        """Join the group. Every rank calls this with the same addr/port/world_size.

        ``device`` defaults to the current CUDA device for NCCL and CPU for gloo.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")

        if world_size == 1:
            # Fast path: no process group, no port, no backend needed.
            if device is not None:
                dev = torch.device(device)
            elif torch.cuda.is_available():
                dev = torch.device("cuda", torch.cuda.current_device())
            else:
                dev = torch.device("cpu")
            return cls(rank, 1, "none", dev)

        if master_port is None:
            raise ValueError("master_port is required when world_size > 1")
        be = resolve_backend(backend)
        dev = torch.device(device) if device is not None else torch.device(
            "cuda" if be == "nccl" else "cpu")
        if dev.type == "cuda" and dev.index is None:
            # A worker's device is plain "cuda" (the one its process was given); NCCL and
            # set_device need the index.
            dev = torch.device("cuda", torch.cuda.current_device())
        if be == "nccl":
            torch.cuda.set_device(dev)

        group = cls(rank, world_size, be, dev)
        timeout = timedelta(seconds=timeout_s)
        init_method = f"tcp://{master_addr}:{int(master_port)}"
        if dist.is_initialized():
            # The process already has a default group (e.g. a TP group); this group
            # must span exactly the same ranks to be built on top of it.
            if dist.get_world_size() != world_size or dist.get_rank() != rank:
                raise RuntimeError(
                    "torch.distributed is already initialized with "
                    f"rank={dist.get_rank()} world_size={dist.get_world_size()}, "
                    f"cannot join DP group rank={rank} world_size={world_size}"
                )
            group._pg = dist.new_group(list(range(world_size)), backend=be, timeout=timeout)
        else:
            dist.init_process_group(
                backend=be,
                init_method=init_method,
                rank=rank,
                world_size=world_size,
                timeout=timeout,
            )
            group._pg = dist.group.WORLD
            group._owns_default_pg = True
        return group

    def destroy(self) -> None:
        """Leave the group. Idempotent; a no-op for ``world_size == 1``."""
        if not self._alive:
            return
        self._alive = False
        pg, self._pg = self._pg, None
        if pg is None or not dist.is_initialized():
            return
        if self._owns_default_pg:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(pg)

    @property
    def is_alive(self) -> bool:
        return self._alive

    def __enter__(self) -> "DPGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return (
            f"DPGroup(rank={self.rank}, world_size={self.world_size}, "
            f"backend={self.backend!r}, device={self.device}, alive={self._alive})"
        )

    # ---------------------------------------------------------------- collectives
    def _check_alive(self) -> None:
        if not self._alive:
            raise RuntimeError("DPGroup was destroyed")

    def barrier(self) -> None:
        self._check_alive()
        if self.world_size == 1:
            return
        if self.backend == "nccl":
            dist.barrier(group=self._pg, device_ids=[self.device.index])
        else:
            dist.barrier(group=self._pg)

    def all_gather_int64(self, row: torch.Tensor) -> torch.Tensor:
        """Gather one 1-D int64 row per rank into ``[world_size, C]`` (int64).

        ``C`` must be the same on every rank. Anything that is not an int64 tensor is
        rejected with ``TypeError`` before any communication. The result is a new
        tensor on the group's device (``world_size == 1``: on the row's device).
        """
        if not isinstance(row, torch.Tensor):
            raise TypeError(f"all_gather_int64 needs a torch.Tensor, got {type(row).__name__}")
        if row.dtype != torch.int64:
            raise TypeError(
                f"all_gather_int64 needs dtype torch.int64, got {row.dtype}; "
                "cast with actors.dp.sync.to_int64 first"
            )
        if row.dim() != 1:
            raise ValueError(f"all_gather_int64 needs a 1-D row, got shape {tuple(row.shape)}")
        self._check_alive()
        if self.world_size == 1:
            return row[None].clone()
        src = row.to(self.device).contiguous()
        out = [torch.empty_like(src) for _ in range(self.world_size)]
        _collective("all_gather", self.rank, dist.all_gather, out, src, group=self._pg)
        return torch.stack(out, dim=0)

    def _rows_in(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``x`` checked for a row collective (C02: integers only as int64), contiguous on
        the group's device."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} needs a torch.Tensor, got {type(x).__name__}")
        if not (x.dtype.is_floating_point or x.dtype == torch.int64):
            raise TypeError(f"{name} takes floating tensors or torch.int64, got {x.dtype}; "
                            "cast integers with actors.dp.sync.to_int64 first")
        self._check_alive()
        return x.to(self.device).contiguous()

    def all_gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x [n, ...]`` (the same shape on all) stacked by rank: ``[W*n, ...]``."""
        src = self._rows_in(x, "all_gather_rows")
        if self.world_size == 1:
            return src
        out = src.new_empty((self.world_size * src.shape[0], *src.shape[1:]))
        _collective("all_gather", self.rank, dist.all_gather_single, out, src, group=self._pg)
        return out

    def reduce_scatter_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [W*n, ...]`` summed over ranks; this rank keeps block ``rank``: ``[n, ...]``."""
        src = self._rows_in(x, "reduce_scatter_rows")
        if self.world_size == 1:
            return src
        if src.shape[0] % self.world_size:
            raise ValueError(f"reduce_scatter_rows needs a multiple of {self.world_size} rows, "
                             f"got {src.shape[0]}")
        out = src.new_empty((src.shape[0] // self.world_size, *src.shape[1:]))
        _collective("reduce_scatter", self.rank, dist.reduce_scatter_single, out, src,
                    group=self._pg)
        return out

    def all_to_all_rows(self, x: torch.Tensor) -> torch.Tensor:
        """``x [W*n, ...]``: block j goes to rank j; returns the blocks this rank got, by
        sender: ``[W*n, ...]``."""
        src = self._rows_in(x, "all_to_all_rows")
        if self.world_size == 1:
            return src
        if src.shape[0] % self.world_size:
            raise ValueError(f"all_to_all_rows needs a multiple of {self.world_size} rows, "
                             f"got {src.shape[0]}")
        out = torch.empty_like(src)
        _collective("all_to_all", self.rank, dist.all_to_all_single, out, src, group=self._pg)
        return out
