#!/usr/bin/env bash
# One device call's worth of measurements, named by stage, their outputs kept in one archive:
# the device returns at most 8 files from $OUT, and $OUT is emptied by the next call, so each
# stage re-packs everything so far into OUT/lease.tgz (a call cut at its time limit keeps
# what ran).
#   bash benchmarks/h200_lease.sh OUT STAGE [STAGE ...]
# Stages (seconds on the H200, with the bundle already unstaged: source .stage/tools/unstage.sh):
#   kernels    the Triton kernels' GPU tests (penalties, grammar mask) and grammar GPU tests  ~120
#   features   feature_cost --batch-sizes 1 64 --repeats 2: every feature's cost, in-process   ~60
#   tree       HTTP, the h200 preset, without and with the grammar, 1 and 64 streams         ~120
#   plain      the same without speculation                                                  ~110
#   vllm       vLLM 0.24 EAGLE (our head), the same client and grammar                      ~250
#   profile    py-spy on the served plain and tree ranks under the grammar (profile_http.sh) ~300
#   gputests   the adaptive draft shapes', speculative graphs', layer kernels' and sampled
#              graphs' GPU tests                                                            ~260
#   mixed      mixed steps' GPU tests and the attention kernel's mixed-mask tests           ~120
#   load-tree, load-plain, load-vllm-plain, load-vllm-eagle
#              closed bursts at 1..512 streams, then (not plain; not with OPEN=0) the
#              open-loop sweep                                                             ~300 each
#   load7b     a 7B-shaped safetensors checkpoint written to local disk, then loaded to the GPU
#              with the page cache dropped: load seconds and peak host memory (load_bench.py) ~150
#   fp8gemm    the FP8 linear against bf16 at the 7B and 72B GEMM shapes (fp8_gemm_bench.py) ~60
#   fp8gemv    the Triton FP8 GEMV's GPU tests, then its config sweep at 1, 8, 16 rows
#              (fp8_gemm_bench.py --gemv; GEMV_ARGS="--m 1 16 --weights bf16 ..." instead)
#              and the row quantization's time by warp count and its bits (--quant)           ~100
#   attention  decode attention by context (1k-32k), key splits and tile (attention_bench.py)  ~90
#   library    needs no bundle: a long prompt's chunks through cuDNN (library_attention.py) beside
#              the Triton kernel, steady and on each new shape's first call, and its GPU tests ~90
#   sweeps     needs no bundle (torch and Triton as the machine has them): the 7B prefill
#              chunk's attention beside torch's SDPA (and FlashInfer's FA2/FA3 where the bundle
#              is unstaged), the GEMVs' split-K reduce by launch or by the last split (bf16,
#              FP8), the FP8 row quantization by warp count, the GEMV's GPU tests (with pytest) ~300
#   fp8        the FP8 linear's GPU tests (the CUDA path, graphs, a served FP8 target, the
#              fused quantization, the GEMV's reduce by its last split)                       ~90
#   profile512 py-spy on the replica, core and rank while 512 streams arrive at once      ~150
#   memory     the start-up memory profile's GPU test (and GPU_TESTS, more test files)    ~90
#   census     SmolLM2's decode step and tree iteration per kernel, with graphs (kernel_census.py) ~60
#   census7b   the 7B shape's decode step per kernel (kernel_census.py): bf16 at 1 and 64
#              streams, FP8 at 1, prompts of about 1k tokens                               ~200
#   decode64   the 7B shape's decode steps alone at 64 streams (kernel_census.py --decode-only),
#              bf16 and FP8: where Kestrel trails vLLM                                      ~200
#   ttt        the draft trainer's TTT attention against its dense-mask reference
#              (ttt_attention_bench.py, B=16, T=1024, 7 steps)                             ~30
#   shapes     draft shapes in-process, graphs, batch 1 (8 prompts) to 64: the preset's tree
#              against wider trees of top-k 8 (gpu_bench.py; SHAPES to choose others)        ~200
#   softce     the draft trainer's chunked token loss against the autograd path, alone and in
#              whole EAGLE-1 and EAGLE-3 training steps (soft_ce_bench.py)                 ~90
#   kestrel-7b, vllm-7b, kestrel-32b, vllm-32b, kestrel-72b, vllm-72b (FP8)
#              random weights of the shape, plain decoding: benchmarks/h200_sizes.sh      ~200-300 each
# LEVELS, REPEATS, ROUNDS and MAX_TOKENS pass through to h200_http.sh for tree, plain, vllm and load-*.
set -uo pipefail
out=$1; shift
cd "$(dirname "$0")/.."
work=/tmp/kestrel-lease
mkdir -p "$work" "$out"
regex='{"structured_outputs": {"regex": "[^\\x01]*\\x01"}}'
pack() {
  for f in /tmp/kestrel-serve-*.log; do  # the servers' logs, without colour codes
    [ -e "$f" ] && sed 's/\x1b\[[0-9;]*m//g' "$f" | tail -400 > "$work/$(basename "$f")"
  done
  tar czf "$out/lease.tgz" -C "$work" .
}
for stage in "$@"; do
  echo "== $stage $(date +%T)"
  case $stage in
    kernels)
      timeout 300 python3 -m pytest -q tests/gpu/test_token_bitmask_kernel_gpu.py \
        tests/gpu/test_penalties_kernel_gpu.py tests/gpu/test_penalties_gpu.py \
        "tests/gpu/test_feature_graphs_gpu.py::test_grammar_batches_replay_the_step_graph_parts" \
        tests/gpu/test_step_channel_gpu.py > "$work/kernels.txt" 2>&1
      tail -3 "$work/kernels.txt" ;;
    features)
      timeout 300 python3 -m benchmarks.feature_cost --batch-sizes 1 64 --repeats 2 \
        --out "$work/features" > "$work/features.txt" 2>&1
      grep "^|" "$work/features.txt" ;;
    tree|plain)
      LEVELS=${LEVELS:-1 64} REPEATS=${REPEATS:-2} timeout 300 bash benchmarks/h200_http.sh "kestrel-$stage" \
        "$work/http" grammar > "$work/http_$stage.txt" 2>&1
      grep "c=" "$work/http_$stage.txt" | cut -c1-90 ;;
    vllm)
      mkdir -p .peer && rm -rf .peer/tools && cp -r .xfer/tools/peer .peer/tools
      LEVELS=${LEVELS:-1 64} REPEATS=${REPEATS:-2} timeout 400 bash benchmarks/h200_http.sh vllm-eagle "$work/http" grammar \
        > "$work/http_vllm.txt" 2>&1
      grep "c=" "$work/http_vllm.txt" | cut -c1-90 ;;
    profile)
      for engine in plain tree; do
        set_=(); [ $engine = plain ] && set_=(--set draft.enabled=false)
        mkdir -p "$work/profile_$engine"
        bash benchmarks/profile_http.sh /tmp/pyspy/bin/py-spy "$work/profile_$engine" 64 "${set_[@]}" \
          --variant "grammar=$regex" 2>&1 | tail -3
      done ;;
    gputests)
      timeout 540 python3 -m pytest -q tests/gpu/test_adaptive_draft_gpu.py tests/gpu/test_spec_graphs.py \
        tests/gpu/test_layer_ops_gpu.py tests/gpu/test_sampled_graphs_gpu.py > "$work/gputests.txt" 2>&1
      tail -5 "$work/gputests.txt" ;;
    mixed)
      timeout 400 python3 -m pytest -q tests/gpu/test_mixed_steps_gpu.py tests/unit/test_triton_attention.py \
        > "$work/mixed.txt" 2>&1
      tail -5 "$work/mixed.txt" ;;
    census)
      timeout 300 python3 -m benchmarks.kernel_census --variants plain_graphs spec_graphs --out "$work/census" \
        > "$work/census.txt" 2>&1
      grep -E "tok/s|kernels/step|Error" "$work/census.txt" | cut -c1-200 ;;
    census7b)
      for q in bf16 fp8; do
        set_=(--batch 1 64); [ $q = fp8 ] && set_=(--batch 1 --set model.quantization=fp8)
        timeout 300 python3 -m benchmarks.kernel_census --config configs/h200-7b.yaml --variants plain_graphs \
          --prompt-words 750 "${set_[@]}" --out "$work/census7b_$q" > "$work/census7b_$q.txt" 2>&1
        grep -E "tok/s|kernels/step|Error" "$work/census7b_$q.txt" | cut -c1-200
      done ;;
    memory)
      timeout 400 python3 -m pytest -q tests/gpu/test_memory_profile_gpu.py ${GPU_TESTS:-} \
        > "$work/memory.txt" 2>&1
      tail -5 "$work/memory.txt" ;;
    decode64)
      for q in bf16 fp8; do
        set_=(); [ $q = fp8 ] && set_=(--set model.quantization=fp8)
        timeout 300 python3 -m benchmarks.kernel_census --config configs/h200-7b.yaml --variants plain_graphs \
          --prompt-words 750 --batch 64 --decode-only "${set_[@]}" --out "$work/decode64_$q" > "$work/decode64_$q.txt" 2>&1
        grep -E "tok/s|kernels/step|Error" "$work/decode64_$q.txt" | cut -c1-200
        head -14 "$work/decode64_$q/plain_graphs_b64.txt" | tail -12 | cut -c1-110
      done ;;
    kestrel-7b|vllm-7b|kestrel-32b|vllm-32b|kestrel-72b|vllm-72b)
      if [ "${stage#vllm}" != "$stage" ]; then mkdir -p .peer && rm -rf .peer/tools && cp -r .xfer/tools/peer .peer/tools; fi
      mkdir -p "$work/sizes"
      bash benchmarks/h200_sizes.sh "$stage" "$work/sizes" > "$work/sizes_$stage.txt" 2>&1
      grep -E "c=|prompts:|Error|error" "$work/sizes_$stage.txt" | cut -c1-160 | tail -20 ;;
    load-tree|load-plain|load-vllm-plain|load-vllm-eagle)
      # Hundreds of streams: closed levels up to 512, then the open-loop sweep (one start).
      part=${stage#load-}; [ "${part#vllm}" = "$part" ] && part=kestrel-$part
      mode=both; { [ "$part" = kestrel-plain ] || [ "${OPEN:-1}" = 0 ]; } && mode=closed
      if [ "${part#vllm}" != "$part" ]; then mkdir -p .peer && rm -rf .peer/tools && cp -r .xfer/tools/peer .peer/tools; fi
      if [ $mode = both ]; then
        LEVELS=${LEVELS:-1 8 32 64 128 256 512} REPEATS=${REPEATS:-1} RATES=${RATES:-16 48 96 inf} \
          NUM_REQUESTS=${NUM_REQUESTS:-300} timeout 580 bash benchmarks/h200_http.sh "$part" "$work/load" both \
          > "$work/load_$part${TAG:-}.txt" 2>&1
      else
        HTTP_ONLY=1 LEVELS=${LEVELS:-1 8 32 64 128 256 512} REPEATS=${REPEATS:-1} timeout 580 \
          bash benchmarks/h200_http.sh "$part" "$work/load" > "$work/load_$part${TAG:-}.txt" 2>&1
      fi
      grep -E "c=|rate " "$work/load_$part${TAG:-}.txt" | cut -c1-140 ;;
    load7b)
      timeout 400 python3 -m benchmarks.load_bench --shape models/qwen2.5-7b --dir /tmp/ckpt-7b --device cuda \
        > "$work/load7b.txt" 2>&1
      tail -8 "$work/load7b.txt"; rm -rf /tmp/ckpt-7b ;;
    fp8)
      timeout 300 python3 -m pytest -q tests/gpu/test_fp8_gpu.py tests/gpu/test_fp8_fused_quant_gpu.py \
        tests/gpu/test_triton_gemv_gpu.py tests/unit/test_triton_fp8_quant.py tests/unit/test_triton_gemv.py \
        tests/unit/test_fp8_fused_quant.py > "$work/fp8_tests.txt" 2>&1
      tail -3 "$work/fp8_tests.txt" ;;
    attention)
      PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 300 python3 benchmarks/attention_bench.py \
        --out "$work/attention.json" > "$work/attention.txt" 2>&1
      PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 120 python3 benchmarks/attention_bench.py --prefill-chunk 8192 \
        --context 8192 16384 32768 >> "$work/attention.txt" 2>&1
      grep -E "ctx=(1024|32768)|prefill" "$work/attention.txt" | cut -c1-100 | tail -40 ;;
    library)
      export PYTHONPATH=$PWD:${PYTHONPATH:-}
      timeout 150 python3 benchmarks/attention_bench.py --prefill-chunk 8192 --context 8192 16384 32768 \
        --tiles default --peers > "$work/library_prefill.txt" 2>&1
      timeout 120 python3 benchmarks/attention_bench.py --first-calls >> "$work/library_prefill.txt" 2>&1
      grep -E "tile=|sdpa|cudnn" "$work/library_prefill.txt" | cut -c1-120
      timeout 120 python3 -m pytest -q tests/gpu/test_library_attention_gpu.py > "$work/library_tests.txt" 2>&1
      tail -3 "$work/library_tests.txt" ;;
    sweeps)
      export PYTHONPATH=$PWD:${PYTHONPATH:-}
      timeout 240 python3 benchmarks/attention_bench.py --prefill-chunk 8192 --context 8192 32768 \
        --tiles default --peers > "$work/prefill_peers.txt" 2>&1
      cut -c1-110 "$work/prefill_peers.txt" | grep prefill
      timeout 150 python3 benchmarks/fp8_gemm_bench.py --gemv --weights bf16 --models 7b --m 1 8 16 \
        --configs default mma_k256 last last_k256 > "$work/gemv_bf16.txt" 2>&1
      tail -4 "$work/gemv_bf16.txt"
      timeout 150 python3 benchmarks/fp8_gemm_bench.py --gemv --models 7b 72b --m 1 16 \
        --configs default last > "$work/gemv_fp8.txt" 2>&1
      tail -5 "$work/gemv_fp8.txt"
      timeout 60 python3 benchmarks/fp8_gemm_bench.py --quant --m 1 64 8192 > "$work/fp8_quant.txt" 2>&1
      cat "$work/fp8_quant.txt"
      if python3 -c "import pytest" 2>/dev/null; then
        timeout 200 python3 -m pytest -q tests/gpu/test_triton_gemv_gpu.py > "$work/gemv_gpu_tests.txt" 2>&1
        tail -3 "$work/gemv_gpu_tests.txt"
      fi ;;
    ttt)
      timeout 200 python3 -m benchmarks.ttt_attention_bench --device cuda > "$work/ttt.txt" 2>&1
      cat "$work/ttt.txt" ;;
    shapes)
      timeout 420 python3 -m benchmarks.gpu_bench --backends triton --modes graphs --skip-hf --b1-prompts 8 \
        --spec-shapes ${SHAPES:-tree 8-8-32 8-6-16 8-5-8} --batch-sizes 1 8 32 64 --out "$work/shapes" \
        > "$work/shapes.txt" 2>&1
      grep "^|" "$work/shapes.txt" ;;
    softce)
      timeout 300 python3 -m benchmarks.soft_ce_bench --device cuda > "$work/softce.txt" 2>&1
      grep -v "loading" "$work/softce.txt" ;;
    fp8gemm)
      PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 300 python3 benchmarks/fp8_gemm_bench.py > "$work/fp8_gemm.txt" 2>&1
      tail -45 "$work/fp8_gemm.txt" ;;
    fp8gemv)
      timeout 200 python3 -m pytest -q tests/unit/test_triton_gemv.py > "$work/fp8_gemv_tests.txt" 2>&1
      tail -3 "$work/fp8_gemv_tests.txt"
      PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 300 python3 benchmarks/fp8_gemm_bench.py --gemv ${GEMV_ARGS:-} > "$work/fp8_gemv.txt" 2>&1
      tail -60 "$work/fp8_gemv.txt"
      PYTHONPATH=$PWD:${PYTHONPATH:-} timeout 60 python3 benchmarks/fp8_gemm_bench.py --quant --m 1 64 > "$work/fp8_quant.txt" 2>&1
      cat "$work/fp8_quant.txt" ;;
    profile512)
      mkdir -p "$work/profile512"
      SPY_DELAY=0 bash benchmarks/profile_http.sh /tmp/pyspy/bin/py-spy "$work/profile512" 512 \
        --max-tokens 256 2>&1 | tail -3
      for p in replica core rank; do
        python3 -m benchmarks.stack_summary "$work/profile512/profile_$p.txt" > "$work/profile512/summary_$p.txt" 2>&1
      done ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
  pack
done
