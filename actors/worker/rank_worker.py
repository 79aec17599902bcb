"""RankWorker: one GPU (or CPU process) worth of models, KV pools and step execution.

A plain class. The Serve Engine wraps it in a Ray actor; `kestrel generate` and most
tests call it in-process through the same `execute(plan)` interface.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import time
from functools import lru_cache
from typing import Callable

import torch

from actors.attention.torch_native import TorchNativeBackend
from actors.graphs.capture_progress import PROGRESS
from actors.worker.eager_steps import EagerSteps
from actors.worker.forward_batch import ForwardBatch, ForwardMode
from actors.worker.future_map import FutureMap
from actors.worker.gc_pauses import watch
from actors.sampling.grammar_rows import GrammarRows
from actors.worker.host_copy import to_device
from actors.worker.launched_step import Emitted, LaunchedStep, one_token_each, timing_event
from actors.worker.kv_cache import ReqToTokenPool, TokenToKVPool, kv_cache_dtype, max_request_slots
from actors.worker.memory_profile import MemoryPlan, plan_memory
from actors.sampling.logprobs import asked_top, prompt_logprobs, top_logprobs
from actors.worker.model_runner import ModelRunner
from actors.sampling.output_counts import OutputCounts
from actors.sampling.processing_table import ProcessingTable
from actors.models.loader import build_model, default_model_path, read_arch, serves_fp8
from actors.sampling.sampler import sample_tokens, sampling_flags
from actors.protocol.step_plan import StepOutput, StepPlan
from configs.schema import KestrelConfig
from kestrel_kernels import fp8_linear, layer_ops, small_rows_linear
from kestrel_kernels.compile_watch import CompileWatch
from kestrel_kernels.penalties import apply_processing
from kestrel_kernels.token_bitmask import mask_logits_

log = logging.getLogger("kestrel.worker")


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device == "cuda" or cpu_has_native_bf16():
        return torch.bfloat16
    return torch.float32


def make_backend(name: str, kv_pool, req_to_token, scale: float, page_size: int = 1,
                 max_kv_splits: int | None = None, cpu_kernel: bool = False,
                 library_min_tokens: int = 0):
    """The attention backend `attention.backend` names. page_size is the KV allocator's;
    1 is valid for any pool (FlashInfer then reads slots as one-token pages).
    max_kv_splits: attention.max_kv_splits (Triton; None: the kernel's default).
    cpu_kernel: torch_native attends with the batch-invariant CPU kernel.
    library_min_tokens: attention.library_prefill_min_tokens (Triton; 0: off)."""
    if name == "torch_native":
        return TorchNativeBackend(kv_pool, req_to_token, scale, cpu_kernel=cpu_kernel)
    if name == "triton":
        from actors.attention.triton_backend import TritonBackend
        kw = {} if max_kv_splits is None else {"max_kv_splits": max_kv_splits}
        return TritonBackend(kv_pool, req_to_token, scale, library_min_tokens=library_min_tokens, **kw)
    if name == "flashinfer":
        if kv_pool.quantized:  # its kernels read no per-layer KV scales
            raise ValueError("attention.backend=flashinfer does not read an FP8 KV cache "
                             "(kv_cache.dtype=fp8_e4m3): set kv_cache.dtype=auto, or "
                             "attention.backend=triton")
        # Raises, naming the setting and the alternatives, without CUDA or flashinfer.
        from actors.attention.flashinfer_backend import FlashInferBackend
        backend = FlashInferBackend(kv_pool, req_to_token, scale, page_size=page_size)
        if kv_pool.k[0].dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"attention.backend=flashinfer runs bfloat16 or float16, not "
                             f"{kv_pool.k[0].dtype}: set model.dtype, or attention.backend=triton")
        return backend
    raise NotImplementedError(f"attention.backend={name!r} is not available in this build "
                              "(allowed here: torch_native, triton, flashinfer)")


class RankWorker:
    def __init__(self, cfg: KestrelConfig, rank: int = 0, loaded: tuple | None = None):
        """`loaded`: (model, arch, draft head or None) already built on the device, which
        this worker then shares (the memory profile's throwaway worker)."""
        self.cfg = cfg
        self.rank = rank
        self.compiles = CompileWatch()  # armed once start-up has compiled what serving needs
        CompileWatch.pause_all()
        self.gc = watch()  # the collector's passes, a step's `gc` phase
        self.eager = EagerSteps(rank)  # steps that leave the captured graphs, and why
        self.device = torch.device(cfg.resolved_device())
        self.cpu_weights = self._cpu_weights(cfg)
        self.dtype = (torch.float32 if self.cpu_weights == "packed"
                      else resolve_dtype(cfg.model.dtype, self.device.type))
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache.dtype, self.dtype)  # target's and draft's KV
        torch.set_num_threads(cfg.resolved_cpu_threads(self.device.type, os.cpu_count() or 1))
        torch.manual_seed(cfg.seed)
        layer_ops.set_fused(cfg.model.fused_layer_ops)
        fp8_linear.set_gemv_max_rows(cfg.model.fp8_gemv_max_rows)
        small_rows_linear.set_gpu_max_rows(cfg.model.gemv_max_rows)
        spec = cfg.draft.enabled
        fp8_linear.set_tensorwise(not spec)  # a verify's rows summed as a plain step's
        if loaded is None:
            loaded = self._load(spec)
        self.model, self.arch, draft_head = loaded
        self.cpu_q4_isa = None  # packed: the Q4_1 kernel's instruction set, "avxvnni", "avx512vnni" or "avx2"
        if self.cpu_weights == "packed":
            from kestrel_kernels import cpu_q4
            self.cpu_q4_isa = cpu_q4.isa()
            log.info("rank %d: packed CPU weights, the Q4_1 kernel on %s", rank, self.cpu_q4_isa)
        small_rows_linear.set_enabled(self._small_rows(cfg))
        a = self.arch
        self.window = cfg.draft.window if spec else 1
        self.max_context = max_request_slots(cfg.model.max_model_len, self.window,
                                             cfg.kv_cache.page_size)
        self.num_rows = cfg.scheduler.max_running_requests + 2
        self.memory: MemoryPlan | None = None  # on a GPU without kv_cache.num_slots: the profile's
        if cfg.kv_cache.num_slots is None and self.device.type == "cuda":
            self.memory = plan_memory(cfg, rank, loaded, self._kv_bytes_per_slot(),
                                      self._profile_slots())
        self.num_slots = self._num_slots()
        self.req_to_token = ReqToTokenPool(self.num_rows, self.max_context, self.device)
        self.kv_pool = TokenToKVPool(self.num_slots, a.num_layers, a.num_kv_heads, a.head_dim,
                                     self.kv_dtype, self.device)
        scale = a.head_dim ** -0.5
        # The packed model's verify and decode steps give a token the same logits only if
        # attention is batch-invariant too.
        backend = make_backend(cfg.attention.backend, self.kv_pool, self.req_to_token, scale,
                               page_size=cfg.kv_cache.page_size,
                               max_kv_splits=cfg.attention.max_kv_splits,
                               cpu_kernel=self.cpu_weights == "packed",
                               library_min_tokens=cfg.attention.library_prefill_min_tokens)
        self.target = ModelRunner(self.model, backend)
        self.eagle = None
        if spec:
            from actors.spec.eagle_worker import EagleWorker
            self.eagle = EagleWorker(cfg, self, draft_head)
        # draft.plain_steps: the target's features at a plain step's positions, written by
        # its forward (inside the decode graph too), for the draft's KV after it
        # (EagleWorker.follow_plain_step). [num_rows, F] in the model's dtype.
        self.plain_features = None
        if self.eagle is not None and cfg.draft.plain_steps:
            self.plain_features = torch.zeros(self.num_rows, self.eagle.feature_size, dtype=self.dtype,
                                              device=self.device)
        self.counts = OutputCounts(self.num_rows, a.vocab_size, self.device)
        self.processing = ProcessingTable(self.num_rows, cfg.processing, self.device)
        self.grammars = GrammarRows(cfg.processing.grammar_threads)
        GrammarRows.preload()  # not in the step that meets the first grammar
        self._last_end = None  # the end event of the last finished step (device idle time)
        self.future = FutureMap(self.num_rows, cfg.draft.topk,
                                self.eagle.hidden_size if self.eagle else a.hidden_size,
                                self.dtype, self.device, spec)
        self.decode_graphs = self.processed_decode_graphs = None
        self.sampled_decode_graphs = {}  # (processed, filtered) -> GraphRunner
        self.step_coins = None  # StepCoins: the sampled decode graphs' coins
        # dp_attention: the group's graph size for every forward of the running step, None
        # when it runs eagerly (set with the graphs, which it captures once the model is
        # sharded and the group formed: their forwards hold collectives; group_graphs.py).
        self.group_graph_size: Callable[[], int | None] | None = None
        self.prefill_graphs = None
        self.graph_capture: dict = {}  # what start-up captured: graphs, sizes, seconds, GiB
        if cfg.attention.cuda_graphs and not cfg.parallel.dp_attention:
            self._capture_graphs()
            if self.memory is not None:
                self.memory.graphs = int(self.graph_capture["gib"] * 2 ** 30)
        elif self.eagle is not None and cfg.draft.eager_shapes and not cfg.parallel.dp_attention:
            # No step graphs: the draft shapes run eagerly, timed so (a group steps one shape).
            from actors.spec.draft_shapes import eager_cost_sizes
            self.eagle.eager_shapes(eager_cost_sizes(cfg.scheduler.max_running_requests))
        if self.eagle is not None and cfg.draft.plain_steps and self.eagle.plain_costs is None:
            log.warning("rank %d: draft.plain_steps takes no effect: no plain step cost was measured "
                        "(measured beside the speculative step graphs on a GPU, or with "
                        "draft.eager_shapes=true without graphs; never under parallel.dp_attention)",
                        self.rank)
        if self.device.type == "cuda":  # compile eager paths' kernels now, not at a first request
            from actors.graphs.warmup import (warm_up_library, warm_up_mixed, warm_up_prefill,
                                              warm_up_processing, warm_up_sampled_decode)
            warm_up_library(self)
            warm_up_prefill(self)
            warm_up_mixed(self)
            warm_up_sampled_decode(self)
            warm_up_processing(self)
            self.compiles.arm()

    def _small_rows(self, cfg: KestrelConfig) -> bool:
        """model.cpu_small_rows: on a CPU with float32 weights, whether linear layers at a
        few rows go through weight @ x^T; auto measures both ways on this model's MLP and
        LM head weights at small_rows_linear.MAX_ROWS rows."""
        setting = cfg.model.cpu_small_rows
        if setting == "never" or self.device.type != "cpu" or self.dtype != torch.float32 \
                or self.cpu_weights == "packed":  # its own kernels
            return False
        if setting == "always":
            return True
        mlp = self.model.model.layers[0].mlp
        weights = [mlp.gate_up_proj.weight, mlp.down_proj.weight, self.model.lm_head.weight]
        if any(w.dtype != torch.float32 for w in weights):
            return False  # model.quantization=fp8: its own GEMMs
        plain = fast = 0.0
        for w in weights:
            a, b = small_rows_linear.measure(w.detach())
            plain, fast = plain + a, fast + b
        on = fast < 0.9 * plain
        log.info("rank %d: linear layers at %d rows: %.2f ms as F.linear, %.2f ms as weight @ x^T "
                 "(model.cpu_small_rows=auto: %s)", self.rank, small_rows_linear.MAX_ROWS,
                 1000 * plain, 1000 * fast, "on" if on else "off")
        return on

    def _cpu_weights(self, cfg: KestrelConfig) -> str:
        """model.cpu_weights where it applies (on the CPU with model.dtype auto, no
        model.quantization or dp_attention), else float; auto: packed where the CPU
        kernels also load."""
        m = cfg.model
        if m.cpu_weights == "float":
            return "float"
        why = ("the device is not a CPU" if self.device.type != "cpu"
               else f"model.dtype={m.dtype} asks for float weights" if m.dtype != "auto"
               else f"model.quantization={m.quantization}" if m.quantization != "none"
               else "parallel.dp_attention shards float weights" if cfg.parallel.dp_attention
               else "scheduler.mixed_steps computes decode rows in prefill's float GEMM"
               if cfg.scheduler.mixed_steps
               else "")
        if why:
            log.info("rank %d: model.cpu_weights=%s does not apply (%s): float weights",
                     self.rank, m.cpu_weights, why)
            return "float"
        if m.cpu_weights == "auto":
            from kestrel_kernels import cpu_build
            reason = cpu_build.unavailable_reason()  # builds them on first use
            if reason is not None:
                log.warning("rank %d: model.cpu_weights=auto: the CPU kernels do not load (%s): "
                            "float weights, slower", self.rank, reason)
                return "float"
            return "packed"
        return m.cpu_weights

    def _capture_graphs(self) -> None:
        """Every graph serving replays, for every batch size the scheduler can form, with
        their count, time and device memory logged (start-up's longest part)."""
        sizes = self.graph_batch_sizes()
        PROGRESS.reset()
        free0 = torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda" else 0
        log.info("rank %d: capturing graphs for %d batch sizes up to %d", self.rank, len(sizes), max(sizes))
        self.capture_decode_graphs(sizes)
        if self.eagle is not None:  # verify, draft decode and draft extend replay too
            self.eagle.capture_graphs(sizes)
        if self.cfg.attention.prefill_graph_tokens:
            a = self.cfg.attention
            self.capture_prefill_graphs(sizes, a.prefill_graph_tokens, a.prefill_graph_max_tokens)
        used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / 2**30 if free0 else 0.0
        self.graph_capture = {"graphs": PROGRESS.graphs, "batch_sizes": sizes,
                              "seconds": round(PROGRESS.seconds, 1), "gib": round(used, 2)}
        log.info("rank %d: captured %d graphs for batch sizes %s in %.1fs, %.2f GiB of device memory",
                 self.rank, PROGRESS.graphs, sizes, PROGRESS.seconds, used)

    def graph_batch_sizes(self) -> list[int]:
        if self.device.type != "cuda":
            raise ValueError("attention.cuda_graphs needs a CUDA device (set it false on CPU)")
        if self.cfg.attention.backend == "torch_native":
            raise ValueError("attention.cuda_graphs needs a capturable backend "
                             "(attention.backend=triton); torch_native plans on the host")
        return [b for b in self.cfg.graph_batch_sizes() if b < self.num_rows]

    @property
    def feature_graphs(self) -> bool:
        """attention.feature_graphs, where it applies: not under dp_attention, whose group
        replays the plain graphs only (a processed batch takes the eager processing)."""
        return self.cfg.attention.feature_graphs and not self.cfg.parallel.dp_attention

    def capture_decode_graphs(self, sizes: list[int], use_cuda_graph: bool | None = None) -> None:
        """Plain target decode as graphs, one per captured batch size (docs/design.md, "CUDA graphs"); on CPU
        (use_cuda_graph None) the eager stand-in.

        With `feature_graphs` and no speculation (under it every decode step is a
        speculative iteration), more sets in the same pool, whose bodies end in the step's
        tokens (-> processed logits [B, V], tokens [B]): `processed_decode_graphs` for
        greedy steps with logit processing (the rows' processing, the pick and its counting
        inside the graph), and `sampled_decode_graphs[(processed, filtered)]` for steps
        with a sampled row: each row's processing when `processed`, then its own sampling
        from the processing table (greedy rows their argmax, the others inverse-CDF with
        their coin from `step_coins`), the top-k/top-p sort only in the `filtered` set,
        which steps with a truncating row take."""
        from actors.graphs.cuda_graph_runner import GraphKind, GraphRunner, graph_backend
        from actors.sampling.step_coins import StepCoins
        from kestrel_kernels.sampling import sample_rows

        def runner() -> GraphRunner:
            return GraphRunner(GraphKind.TARGET_DECODE, sizes, graph_backend(self.target.backend),
                               device=self.device, use_cuda_graph=use_cuda_graph)

        # Every decode graph writes its logits into one buffer sized for the largest batch,
        # not into an output of its own per size (0.9 GiB a graph set over the 19 sizes up
        # to 256 streams with Qwen2's vocabulary, 2.7 GiB up to 512); the processed sets
        # keep the processed copy they make.
        # A rank runs one step at a time and reads a step's logits within it.
        self.decode_logits = torch.empty(max(sizes), self.arch.vocab_size, dtype=torch.float32,
                                         device=self.device)  # [max_bs, V] fp32

        def forward(view):
            # Metadata is rebuilt inside the graph from the static inputs on every replay.
            return self._decode_logits(view.input_ids, view.seq_lens - 1, view.out_cache_loc,
                                       view.req_pool_indices, self.decode_logits[:view.batch_size])

        def picked(view, processed: bool, sampled: bool, filtered: bool = False):
            rows = view.req_pool_indices  # [bs] int64; padded lanes: row 0, greedy, no processing
            logits = forward(view)  # [bs, V] fp32
            if processed:
                logits = self.process(rows, logits[:, None])[:, 0]
            if sampled:
                coins = self.step_coins.buffer[:view.batch_size, 0]  # [bs] float32
                tokens = sample_rows(logits, *self.processing.sampling(rows), coins, filtered=filtered)
            else:
                tokens = logits.argmax(-1)  # [bs] int64
            if processed:
                self.counts.record(rows, tokens[:, None], (rows > 0).to(torch.int64))  # padded lanes emit nothing
            return logits, tokens

        t0 = time.time()
        with torch.inference_mode():
            self.decode_graphs, self.processed_decode_graphs, self.sampled_decode_graphs = runner(), None, {}
            self.decode_graphs.capture(forward)
            pool = self.decode_graphs.graph_pool
            if self.feature_graphs and self.eagle is None:
                self.counts.ensure()  # the graphs read the counts' tensors: they must exist now
                self.step_coins = StepCoins(max(sizes), 1, self.device)
                self.processed_decode_graphs = runner()
                self.processed_decode_graphs.capture(functools.partial(picked, processed=True, sampled=False),
                                                     pool=pool)
                for processed, filtered in itertools.product((False, True), repeat=2):
                    graphs = self.sampled_decode_graphs[processed, filtered] = runner()
                    graphs.capture(functools.partial(picked, processed=processed, sampled=True,
                                                     filtered=filtered), pool=pool)
        log.info("rank %d: captured decode graphs for batch sizes %s in %.1fs%s", self.rank, sizes,
                 time.time() - t0, " (and processed, sampled)" if self.processed_decode_graphs else "")

    def _feature_decode_graphs(self, plan: StepPlan, sampled: bool, filtered: bool):
        """The feature decode graph set that holds a plain decode step with processing or a
        sampled row (sampling_flags), or None: the plain graph (or an eager forward) and
        eager picking."""
        if self.processed_decode_graphs is None or not (plan.processing or sampled) \
                or self.processed_decode_graphs.pad_size(len(plan.rows)) is None \
                or self.grammars.any(plan.rows) \
                or (plan.processing and self.processing.has_extra(plan.rows)):
            return None
        if sampled:
            return self.sampled_decode_graphs[plan.processing, filtered]
        return self.processed_decode_graphs

    def graph_size(self, runner, raw_bs: int) -> int | None:
        """The captured size a forward of raw_bs requests replays at on `runner` (a
        GraphRunner or StepGraph, None when not captured); None: it runs eagerly."""
        if runner is None:
            return None
        if self.group_graph_size is not None:
            bs = self.group_graph_size()
            if bs is None:
                self.eager.note("dp_attention", f"{raw_bs} requests on this rank")
            return bs
        bs = runner.pad_size(raw_bs)
        if bs is None:
            self.eager.note("batch_size", f"{raw_bs} requests, graphs up to {max(runner.sizes)}: "
                                          "raise attention.cuda_graph_batch_sizes or leave it null")
        return bs

    def capture_prefill_graphs(self, batch_sizes: list[int], token_sizes: list[int],
                               max_tokens: int, use_cuda_graph: bool | None = None) -> None:
        """Replay prefill steps of up to max(batch_sizes) chunks of up to max(token_sizes)
        tokens, max_tokens when padded, from now on (actors/graphs/prefill_graph.py); on CPU
        (use_cuda_graph None) the eager stand-in."""
        from actors.graphs.prefill_graph import PrefillGraphs
        real = self.device.type == "cuda" if use_cuda_graph is None else use_cuda_graph
        backends = [self.target.backend] + ([self.eagle.extend_backend] if self.eagle else [])
        if real and not all(b.plans_on_device for b in backends):
            log.info("rank %d: no prefill graphs: attention.backend=%s plans on the host",
                     self.rank, self.cfg.attention.backend)
            return
        graphs = PrefillGraphs(self, batch_sizes, token_sizes, max_tokens, real)
        with torch.inference_mode():
            graphs.capture()
        self.prefill_graphs = graphs

    def _load(self, spec: bool) -> tuple:
        """(target, its arch, the draft head or None), built on this worker's device."""
        cfg, rank = self.cfg, self.rank
        path = cfg.model.path or default_model_path()
        t0 = time.time()
        arch = read_arch(path)  # before reading any weight
        arch.check_context(cfg.model.max_model_len)
        if spec and cfg.model.fp8_gemv_max_rows and serves_fp8(arch, cfg.model.quantization):
            # Decode rows at or below R take the kernel and a verify's more rows cuBLASLt; the
            # two sum in different orders, and a last-bit difference moves a token's FP8
            # activation codes, so speculative output would leave plain output.
            raise ValueError(f"model.fp8_gemv_max_rows={cfg.model.fp8_gemv_max_rows} with a draft: "
                             "speculation is lossless with an FP8 target only when every row takes "
                             "the same GEMM; set model.fp8_gemv_max_rows=0 or draft.enabled=false")
        log.info("rank %d: loading %s (%s, %s)", rank, path, self.device, self.dtype)
        model, arch = build_model(path, self.dtype, self.device, cfg.model.load_format, cfg.seed,
                                  quantization=cfg.model.quantization,
                                  cpu_weights=self.cpu_weights,
                                  packed_gemm_dtype=resolve_dtype("auto", "cpu"))
        log.info("rank %d: model loaded in %.1fs", rank, time.time() - t0)
        head = None
        if spec:
            from actors.models.eagle import load_eagle_head, resolve_draft_path
            d = cfg.draft
            head = load_eagle_head(resolve_draft_path(d.path, cfg.model.path, cfg.model.load_format),
                                   model, d.arch, self.dtype, self.device, seed=cfg.seed)
            if head.eagle3 and d.max_token_id is not None:
                raise ValueError(f"draft.max_token_id={d.max_token_id} cuts the target's LM head for an "
                                 "EAGLE-1 head; this EAGLE-3 head drafts among its own "
                                 f"{head.spec.draft_vocab_size} ids: leave draft.max_token_id unset")
            head.max_token_id = d.max_token_id
            if self.cpu_weights == "packed":
                from actors.models.packed_cpu_weights import pack_draft_weights
                pack_draft_weights(head, model.kernel_switch)
        return model, arch, head

    def _kv_bytes_per_slot(self) -> int:
        """One KV slot's bytes: every target layer's K and V, and the draft's one layer, in
        kv_cache.dtype (FP8: half of bfloat16's, so twice the slots)."""
        a = self.arch
        per_slot = 2 * a.num_layers * a.num_kv_heads * a.head_dim * self.kv_dtype.itemsize
        return per_slot + (per_slot // a.num_layers if self.cfg.draft.enabled else 0)

    def _profile_slots(self) -> int:
        """The memory profile's KV pool: room for the warm-ups' largest prefill, a page a row."""
        page = self.cfg.kv_cache.page_size
        return self.cfg.scheduler.chunked_prefill_size + (self.num_rows + 1) * (page + self.window)

    def _num_slots(self) -> int:
        kv = self.cfg.kv_cache
        if kv.num_slots is not None:
            return kv.num_slots
        if self.memory is None:  # the CPU: no device to measure
            return 16384
        slots = self.memory.kv_cache // self._kv_bytes_per_slot()
        need = max_request_slots(self.cfg.model.max_model_len, self.window, kv.page_size)
        if slots < need:
            m = self.memory
            raise ValueError(
                f"no room for the KV cache: kv_cache.memory_utilization={kv.memory_utilization} "
                f"of {m.total / 2**30:.1f} GiB leaves {max(0, m.kv_cache) / 2**30:.2f} GiB after "
                f"the weights ({m.weights / 2**30:.1f} GiB), graphs ({m.graphs_estimate / 2**30:.1f} "
                f"GiB) and activations ({m.other / 2**30:.1f} GiB); one request of "
                f"model.max_model_len={self.cfg.model.max_model_len} needs {need} slots. Raise "
                "memory_utilization, lower scheduler.max_running_requests (fewer graphs) or "
                "model.max_model_len")
        return slots

    def info(self) -> dict:
        return {"num_slots": self.num_slots, "num_rows": self.num_rows,
                "max_context": self.max_context, "window": self.window,
                "vocab_size": self.arch.vocab_size, "eos_token_ids": list(self.arch.eos_token_ids),
                "dtype": str(self.dtype), "device": str(self.device), "graph_capture": self.graph_capture,
                "cpu_weights": self.cpu_weights, "cpu_q4_isa": self.cpu_q4_isa,
                "memory": self.memory.as_dict() if self.memory is not None else None,
                # Per draft shape (DraftConfig.shapes(), those captured), its step's seconds
                # at each graph batch size, or without graphs at each eager_draft_cost_sizes
                # entry (eager_shapes): the scheduler's DraftPolicy reads them.
                "draft_step_costs": self.eagle.shape_costs if self.eagle is not None else None,
                "plain_step_costs": self.eagle.plain_costs if self.eagle is not None else None,
                "graph_batch_sizes": self.graph_capture.get("batch_sizes"),
                "eager_draft_cost_sizes": self.eagle.eager_cost_sizes if self.eagle is not None else None}

    # ---- step execution -------------------------------------------------------------
    def on_steps_back(self, callback: Callable[[], None] | None) -> None:
        """`callback` runs inside `launch` where a step's grammar masks have waited for the
        steps launched before it: their tokens are back, so the step channel can answer
        them there, before the masks are walked, rather than after the launch."""
        self.grammars.on_settled = callback

    def execute(self, plan: StepPlan) -> StepOutput:
        """Run one step to the end (the in-process engine; the step channel launches the
        next step before it finishes this one)."""
        return self.finish(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue the step's work on the device without waiting for it (nor for the steps
        queued before it): its tokens come back through `finish`. A step with grammar rows
        waits for the steps before it only where its masks are made (GrammarRows.settle),
        after the work that does not need them is queued."""
        t0 = time.perf_counter()
        start = timing_event(self.device)
        if plan.kv_writes:
            self.req_to_token.write_many(plan.kv_writes)
        if plan.count_resets:
            self.counts.reset(plan.count_resets)
        if plan.processing_resets:
            self.processing.reset(plan.processing_resets)
        if plan.grammar_vocab is not None:
            self.grammars.set_vocab(plan.grammar_vocab)
        for row, compiled, outputs in plan.grammar_resets:
            self.grammars.reset(row, compiled, outputs)
        if plan.mode == "idle" or not plan.rows:
            return LaunchedStep(plan, None, None, 0.0)
        self.last_prompt_logprobs = None
        if self.eagle is not None and (plan.use_spec or plan.mode != "decode"):
            self.eagle.flush_plain_kv()  # this step runs the draft: the plain steps' KV first
        if self.model.kernel_switch is not None:  # model.cpu_weights=packed
            self.model.kernel_switch.on = plan.mode == "decode"  # at any batch size: lossless
        if plan.mode == "mixed" and plan.use_spec:
            emitted = self.eagle.decode_mixed(plan)
        elif plan.mode in ("extend", "mixed"):
            emitted = self._extend(plan)
        elif self.eagle is not None and plan.use_spec:
            emitted = self.eagle.decode(plan)
        else:
            emitted = self._decode(plan)
        shape = 0
        if self.eagle is not None and not plan.use_spec:  # PLAIN_STEP: the policy chose a plain step
            shape = plan.draft_shape
        elif self.eagle is not None and plan.mode == "decode":
            shape = self.eagle.last_shape
        step = LaunchedStep(plan, emitted, self.last_prompt_logprobs, time.perf_counter() - t0, start,
                            eager=self.eager.take(), draft_shape=shape)
        self.grammars.launched(step, plan.rows)
        return step

    @torch.inference_mode()
    def finish(self, step: LaunchedStep) -> StepOutput:
        """Wait for a launched step's tokens (launched in order, finished in that order)."""
        plan = step.plan
        if step.emitted is None:
            return StepOutput(plan.step_id, [[] for _ in plan.rows])
        t0 = time.perf_counter()
        tokens, emitted = step.tokens(), step.emitted
        logprobs = emitted.logprobs(emitted.copy.wait(), tokens) if emitted.logprobs is not None else None
        self.grammars.settle(step)  # unless the next step's masks did already
        timings = {plan.mode: step.launch_s + time.perf_counter() - t0}
        end = step.emitted.copy.event
        if self._last_end is not None and step.start is not None:
            # The device's own clock: how long it sat idle between the end of the previous
            # step and the start of this one (0 when this one was queued behind it).
            timings["gpu_idle"] = max(0.0, self._last_end.elapsed_time(step.start)) / 1000
        self._last_end = end
        if self.compiles.seconds:
            timings["compile"] = self.compiles.take_seconds()
        if self.gc.seconds:
            timings["gc"] = self.gc.take_seconds()
        if self.eagle is not None and plan.mode == "decode" and self.cfg.profile_steps:
            timings.update(self.eagle.last_timings)
        nested = emitted.nested(emitted.copy.wait()) if emitted.nested is not None else None
        return StepOutput(plan.step_id, tokens, timings, logprobs, step.prompt_logprobs, step.eager,
                          step.draft_shape, nested)

    def process(self, rows: torch.Tensor, logits: torch.Tensor, plan_rows: list[int] | None = None,
                path_tokens: torch.Tensor | None = None, path_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The logit processing of request rows [B] (their processing table entries and output
        counts) on logits [B, N, V] -> a new tensor; kestrel_kernels/penalties.py for the tree's
        path_tokens / path_mask. With the plan's rows on the host (eager steps), also the
        entries past the tables' widths."""
        c = self.counts
        c.ensure()
        return apply_processing(logits, self.processing.gather(rows, plan_rows), c.counts[rows],
                                c.num_out[rows], c.prompt[rows], path_tokens, path_mask, c.tail[rows])

    def sample(self, plan: StepPlan, rows: torch.Tensor,
               logits: torch.Tensor) -> tuple[torch.Tensor, tuple | None]:
        """One token per request from logits [B, V] of rows [B], after the plan's logit
        processing and the rows' grammars -> (tokens [B] int64, and when the plan asks for
        logprobs their device tensors: top_logprobs)."""
        if plan.processing:
            logits = self.process(rows, logits[:, None], plan.rows)[:, 0]
        masks = self.grammars.next_masks(plan.rows, logits.device)  # [B, W] int32 or None
        if masks is not None:
            logits = mask_logits_(logits, masks)
        tokens = sample_tokens(logits, plan.temperature, plan.top_p, plan.top_k, plan.coins, plan.min_p)
        if plan.logprobs is None:
            return tokens, None
        return tokens, top_logprobs(logits, tokens, asked_top(plan.logprobs))

    def record(self, plan: StepPlan, rows: torch.Tensor, tokens: torch.Tensor,
               lens: torch.Tensor | None = None) -> None:
        """Count emitted tokens ([B] one each, or [B, L] with lens [B]) for processing."""
        if not plan.processing:
            return
        if tokens.dim() == 1:
            tokens, lens = tokens[:, None], torch.ones_like(tokens)
        self.counts.record(rows, tokens, lens)

    def _tensor(self, values) -> torch.Tensor:
        return to_device(values, torch.int64, self.device)

    def extend_batch(self, plan: StepPlan) -> ForwardBatch:
        """The forward of a plan's prefill chunks; a mixed plain plan's decode rows first,
        one token each (their bonus at their length, from the future map)."""
        d = plan.num_decode if plan.mode == "mixed" else 0
        rows = self._tensor(plan.rows[d:])
        prefix = self._tensor(plan.prefix_lens)
        lens = self._tensor(plan.extend_lens)
        offs = torch.arange(sum(plan.extend_lens), device=self.device) - torch.repeat_interleave(
            torch.cumsum(lens, 0) - lens, lens)  # [T] int64 offset inside each chunk
        positions = torch.repeat_interleave(prefix, lens) + offs
        loc = self.req_to_token.req_to_token[torch.repeat_interleave(rows, lens), positions]
        ids = self._tensor(plan.input_ids)
        if d:
            decode_rows = self._tensor(plan.rows[:d])  # [d] int64
            c = self.future.resolve(decode_rows)
            seq = c.seq_lens  # [d] int64
            loc = torch.cat([self.req_to_token.req_to_token[decode_rows, seq], loc])
            ids, positions = torch.cat([c.bonus, ids]), torch.cat([seq, positions])
            rows, prefix = torch.cat([decode_rows, rows]), torch.cat([seq, prefix])
        return ForwardBatch(ForwardMode.EXTEND, ids, positions, loc, rows, prefix,
                            [1] * d + list(plan.extend_lens))

    def _extend(self, plan: StepPlan) -> Emitted:
        """A prefill step, or a mixed step without speculation: its decode rows are
        one-token chunks of the same forward."""
        graphs = self.prefill_graphs if plan.mode == "extend" else None
        shape = graphs.shape_for(plan) if graphs is not None and plan.prompt_logprobs is None else None
        if shape is not None:
            return graphs.run(plan, shape)
        fb = self.extend_batch(plan)
        aux = self.eagle.aux_layers if self.eagle else ()
        hidden, aux_hidden = self.target.forward(fb, aux_layers=aux)
        self.last_prompt_logprobs = prompt_logprobs(
            plan.prompt_logprobs, hidden, self.model.compute_logits, fb.input_ids,
            plan.extend_lens, plan.next_ids, plan.last_chunk)
        last = torch.cumsum(fb.seq_lens - fb.prefix_lens, 0) - 1  # [B] int64 last row per chunk
        logits = self.model.compute_logits(hidden[last])
        tokens, lps = self.sample(plan, fb.req_pool_indices, logits)
        # Rows that emit: a mixed plan's decode rows, and the chunks that end their prompt.
        num_decode = fb.batch_size - len(plan.last_chunk)
        emits = [True] * num_decode + list(plan.last_chunk)
        # [D] int64 their positions in the plan (an index, not a mask: a mask's result size
        # would wait for the device)
        done = self._tensor([i for i, e in enumerate(emits) if e])
        self.record(plan, fb.req_pool_indices[done], tokens[done])
        if self.eagle is not None:
            self.eagle.extend_after_prefill(plan, fb, hidden, aux_hidden, tokens, done, last, num_decode)
        else:
            self.future.store(fb.req_pool_indices[done], fb.seq_lens[done], tokens[done])
        return one_token_each(plan, tokens, emits, lps)

    def _decode_logits(self, ids, prefix_lens, loc, rows, logits_out: torch.Tensor | None = None) -> torch.Tensor:
        """One token per request at position prefix_len -> logits [B, V] fp32, in
        ``logits_out`` when given (eager, and the body captured as a graph)."""
        fb = ForwardBatch(ForwardMode.DECODE, ids, prefix_lens, loc, rows, prefix_lens,
                          [1] * rows.numel())
        if self.plain_features is None:
            hidden, _ = self.target.forward(fb)
        else:  # a plain step of a speculative rank: keep what the draft reads
            hidden, aux = self.target.forward(fb, aux_layers=self.eagle.aux_layers)
            self.plain_features[:rows.numel()] = self.eagle.features(hidden, aux)
        return self.model.compute_logits(hidden, logits_out)

    def _decode(self, plan: StepPlan) -> Emitted:
        rows = self._tensor(plan.rows)
        c = self.future.resolve(rows)
        loc = self.req_to_token.req_to_token[rows, c.seq_lens]
        B = len(plan.rows)
        from actors.graphs.cuda_graph_runner import GraphBatch
        batch = GraphBatch(B, c.bonus, c.seq_lens, loc, rows, c.seq_lens + 1)
        sampled, filtered = sampling_flags(plan)
        graphs = self._feature_decode_graphs(plan, sampled, filtered)
        if graphs is not None:
            if sampled:
                self.step_coins.load(plan.coins, graphs.pad_size(B))
            logits, tokens = graphs.replay(batch)  # processed, picked, counted
            lps = None if plan.logprobs is None else top_logprobs(logits, tokens, asked_top(plan.logprobs))
        else:
            bs = self.graph_size(self.decode_graphs, B)  # the group's size under dp_attention
            if bs is not None:
                logits = self.decode_graphs.replay(batch, bs=bs)
            else:
                logits = self._decode_logits(c.bonus, c.seq_lens, loc, rows)
            tokens, lps = self.sample(plan, rows, logits)
            self.record(plan, rows, tokens)
        if self.plain_features is not None:
            self.eagle.follow_plain_step(tokens, c.seq_lens, loc, self.plain_features[:B])
        self.future.store(rows, c.seq_lens + 1, tokens)
        return one_token_each(plan, tokens, [True] * B, lps)

