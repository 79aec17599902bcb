"""A recording attention backend for the CUDA-graph padding contracts (C04-C08)."""
from __future__ import annotations


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
