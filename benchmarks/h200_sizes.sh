#!/usr/bin/env bash
# Real model sizes on one H200, random weights (speed does not depend on their values):
# Kestrel's preset for the shape beside `vllm serve --load-format dummy`, the same client,
# one server start each:
#   bash benchmarks/h200_sizes.sh kestrel-7b|vllm-7b|kestrel-32b|vllm-32b|kestrel-72b|vllm-72b OUT
# Plain decoding (no draft): closed bursts at c = 1, 8, 64, 256 (LEVELS) of prompts of about
# 1k tokens (750 words), 256 new tokens, greedy, streamed chat; then two prompts of about
# 31.5k tokens (22800 words) one at a time: the long-context decode and its TTFT.
# Needs Kestrel's bundle unstaged (source .stage/tools/unstage.sh) and, for vllm parts,
# .peer/tools from vLLM's (benchmarks/h200_lease.sh copies it). SET="k=v ..." adds
# overrides to the Kestrel part, VLLM_ARGS to vLLM's command line; TAG names either;
# LONG_WORDS=0 skips the long prompts. The 72B
# shape is FP8 on both servers (vLLM: --quantization fp8, weights quantized at load); the 7B
# in FP8: SET="model.quantization=fp8" TAG=-fp8 and VLLM_ARGS="--quantization fp8" TAG=-fp8.
set -uo pipefail
part=$1
out=${2:-.}
cd "$(dirname "$0")/.."
server=${part%%-*}
size=${part#*-}
name=qwen2.5-$size
levels=${LEVELS:-1 8 64 256}
sets=(); for kv in ${SET:-}; do sets+=(--set "$kv"); done
bench=(python3 -m benchmarks.http_bench --concurrency $levels --max-tokens 256 --prompt-words 750
       --long-prompt-words "${LONG_WORDS:-22800}" --c1-prompts "${C1:-3}" --no-in-process --model "$name" --out "$out")
case $server in
  kestrel)
    timeout "${LIMIT:-560}" "${bench[@]}" --config "configs/h200-$size.yaml" "${sets[@]}" --name "kestrel-$size${TAG:-}" ;;
  vllm)
    [ "$size" = 72b ] && VLLM_ARGS="--quantization fp8 ${VLLM_ARGS:-}"
    # --quantization fp8 needs compressed-tensors, which vLLM's bundle lacks (pack_for_device.sh).
    (source .peer/tools/unstage_vllm.sh >/dev/null && { [[ "${VLLM_ARGS:-}" != *fp8* ]] ||
      python3 -m pip install -q --no-index --no-deps --target /tmp/vsite .xfer/tools/vllm_wheels/*.whl; } &&
      exec python3 -m vllm.entrypoints.openai.api_server \
      --model "$PWD/models/$name" --served-model-name "$name" --load-format dummy --dtype bfloat16 \
      --port 8011 --gpu-memory-utilization 0.9 --max-model-len 32768 ${VLLM_ARGS:-}) > "$out/vllm-$size${TAG:-}.log" 2>&1 &
    pid=$!
    # A server that dies while starting (a missing module, out of memory) ends the part now,
    # not at the client's time limit.
    until python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health', timeout=2)" 2>/dev/null; do
      kill -0 "$pid" 2>/dev/null || { echo "vllm serve exited while starting:"; grep -E "Error|error" "$out/vllm-$size${TAG:-}.log" | tail -3; exit 1; }
      sleep 2; waited=$((${waited:-0} + 2))
      [ "$waited" -lt "${LIMIT:-560}" ] || { echo "vllm serve not ready in ${LIMIT:-560} s"; kill "$pid"; exit 1; }
    done
    timeout "${LIMIT:-560}" "${bench[@]}" --url http://127.0.0.1:8011 --name "vllm-$size${TAG:-}"
    kill "$pid"; wait "$pid" 2>/dev/null ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
