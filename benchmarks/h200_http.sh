#!/usr/bin/env bash
# The serving benchmark on one H200, one part per device call (each fits the 10-minute limit):
#   bash benchmarks/h200_http.sh kestrel-tree OUT  the h200 preset (tree): HTTP, then in-process
#   bash benchmarks/h200_http.sh kestrel-plain OUT the same without speculation
#   bash benchmarks/h200_http.sh proxy OUT        h200 preset through Serve's Python proxy instead
#   bash benchmarks/h200_http.sh vllm-plain OUT   vllm serve, the same client
#   bash benchmarks/h200_http.sh vllm-eagle OUT   vllm serve with our head (EAGLE, 3 tokens)
# Needs Kestrel's bundle unstaged (../shared/device/stage.sh full, benchmarks/pack_for_device.sh;
# source .stage/tools/unstage.sh)
# and, for the vllm parts, vLLM's (../shared/peers/stage_vllm.sh). Every run writes
# OUT/http_bench_<name>.json and prints its table.
set -uo pipefail
part=$1
out=${2:-${OUT:-.}}
cd "$(dirname "$0")/.."
levels="1 8 32 64"
bench() { timeout "$1" python3 -m benchmarks.http_bench --concurrency $levels --max-tokens 256 --repeats 3 --out "$out" "${@:2}"; }

vllm_serve() {  # name, extra args: start vllm serve in its own environment, bench it, stop it
  local name=$1; shift
  [ -d /tmp/vwork/model ] || (source .peer/tools/unstage_vllm.sh >/dev/null &&
    python3 .peer/tools/vllm_bench.py --configs "" --no-serve-smoke --out "$out/vllm_convert")
  (source .peer/tools/unstage_vllm.sh >/dev/null && exec python3 -m vllm.entrypoints.openai.api_server \
    --model /tmp/vwork/model --served-model-name SmolLM2-135M-Instruct --port 8011 \
    --gpu-memory-utilization 0.5 --max-model-len 4096 "$@") > "$out/$name.log" 2>&1 &
  local pid=$!
  bench 270 --url http://127.0.0.1:8011 --name "$name"
  kill "$pid"; wait "$pid" 2>/dev/null
}

case $part in
  kestrel-tree)
    bench 560 --config configs/h200.yaml --name kestrel-tree ;;
  kestrel-plain)
    bench 560 --config configs/h200.yaml --set draft.enabled=false --name kestrel-plain ;;
  proxy)
    bench 560 --config configs/h200.yaml --set serve.http_proxy=serve --name kestrel-tree-serve-proxy --no-in-process ;;
  vllm-plain)
    vllm_serve vllm-plain ;;
  vllm-eagle)
    vllm_serve vllm-eagle3 --speculative-config '{"method": "eagle", "model": "/tmp/vwork/head_vllm", "num_speculative_tokens": 3}' ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
