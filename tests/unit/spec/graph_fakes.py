"""Stand-ins for the CUDA-graph and stream contract tests: a recording attention backend
(C04-C08) and logging streams and events (C15, C17, the spec graph wiring)."""
from __future__ import annotations

import re


def _list(t):
    return None if t is None else t.tolist()


class RecordingBackend:
    """Records what each replay-metadata call saw, as plain lists or clones (the runner's
    static buffers change on the next replay)."""

    def __init__(self, fill: int):
        self.fill = fill
        self.calls: list[dict] = []

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.fill

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_sum,
                                                seq_lens_cpu, extend_lens=None, **kw):
        spec = kw["spec"]
        self.calls.append(dict(
            bs=bs, mode=kw.get("forward_mode"), batch_size=spec.batch_size,
            seq_lens=seq_lens.tolist(), seq_lens_sum=seq_lens_sum, spec_sum=spec.seq_lens_sum,
            seq_lens_cpu=_list(seq_lens_cpu), extend_lens=_list(extend_lens),
            req_pool_indices=req_pool_indices.tolist(), positions=spec.positions.tolist(),
            out_cache_loc=spec.out_cache_loc.tolist(), input_ids=spec.input_ids.tolist(),
            accept_lens=_list(spec.accept_lens),
            mask=None if spec.custom_mask is None else spec.custom_mask.clone()))


class FakeStream:
    """Stands in for a CUDA stream: logs becoming current and every wait as "name:what"."""

    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def __enter__(self):
        self.log.append(f"{self.name}:enter")
        return self

    def __exit__(self, *exc):
        self.log.append(f"{self.name}:exit")
        return False

    def wait_event(self, ev):
        self.log.append(f"{self.name}:wait_event:{ev.name}")

    def wait_stream(self, other):
        self.log.append(f"{self.name}:wait_stream:{other.name}")


class FakeEvent:
    """Stands in for a CUDA event, named ev1, ev2, ... in order of creation."""
    count = 0

    def __init__(self, log: list):
        FakeEvent.count += 1
        self.name, self.log = f"ev{FakeEvent.count}", log

    def record(self, stream):
        self.log.append(f"{stream.name}:record:{self.name}")


def without_event_names(log: list[str]) -> list[str]:
    """The log with event names dropped, for checks that do not follow one event."""
    return [re.sub(r":ev\d+$", "", e) for e in log]
