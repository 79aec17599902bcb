#!/usr/bin/env bash
# The serving benchmark on one H200, one part per device call (each fits the 10-minute limit):
#   bash benchmarks/h200_http.sh kestrel-tree OUT  the h200 preset (tree): HTTP, then in-process
#   bash benchmarks/h200_http.sh kestrel-plain OUT the same without speculation
#   bash benchmarks/h200_http.sh proxy OUT        h200 preset through Serve's Python proxy instead
#   bash benchmarks/h200_http.sh vllm-plain OUT   vllm serve, the same client
#   bash benchmarks/h200_http.sh vllm-eagle OUT   vllm serve with the shipped head (EAGLE-3, 3 tokens;
#                                                 HEAD_DIR=DIR for another EAGLE-3 head)
# and on two GPUs (issue 18), HTTP only, at 64 and 128 streams:
#   bash benchmarks/h200_http.sh dp1 OUT          one replica, one GPU (the baseline)
#   bash benchmarks/h200_http.sh dp2 OUT          one replica, two independent DP ranks
#   bash benchmarks/h200_http.sh dp2-attention OUT  one replica, parallel.dp_attention
#   bash benchmarks/h200_http.sh replicas2 OUT    two replicas of one GPU each (Serve)
# A third argument `sampled` runs the part at temperature 0.7, top_p 0.9 (names end in -sampled):
#   bash benchmarks/h200_http.sh kestrel-tree OUT sampled
# SET="processing.grammar_threads=4" TAG=-gt4 bash benchmarks/h200_http.sh kestrel-tree OUT grammar
# overrides the preset for a kestrel part (names get TAG).
# `grammar` runs it twice over against one server, run by run, without and with a regex that allows
# nearly any text and never ends (so ignore_eos keeps every token masked, and vLLM does not fail
# the request on a token after the grammar's end); names end in -none and -grammar; HTTP only.
#   bash benchmarks/h200_http.sh kestrel-plain OUT grammar
# `openloop` runs the part's server through an open-loop rate sweep instead of the levels
# (Poisson arrivals, the MT-bench mix with answers of 64..512 tokens, goodput at TTFT <= 500 ms
# and TPOT <= 50 ms; RATES, NUM_REQUESTS, CLIENTS and OPEN_ARGS adjust it); one call a server:
#   for p in kestrel-tree kestrel-plain vllm-plain vllm-eagle; do bash benchmarks/h200_http.sh $p OUT openloop; done
#   python -m benchmarks.plot_open_loop OUT/open_loop.png OUT/http_open_loop_*.json
# `both` runs the levels (HTTP only) and then the sweep against one server start.
# HTTP_ONLY=1 leaves out the in-process runs after the levels.
# Needs Kestrel's bundle unstaged (../shared/device/stage.sh full, benchmarks/pack_for_device.sh;
# source .stage/tools/unstage.sh)
# and, for the vllm parts, vLLM's (../shared/peers/stage_vllm.sh). Every run writes
# OUT/http_bench_<name>.json (open loop: OUT/http_open_loop_<name>.json) and prints its table.
set -uo pipefail
part=$1
out=${2:-${OUT:-.}}
cd "$(dirname "$0")/.."
levels=${LEVELS:-1 8 32 64}  # LEVELS="1 64" REPEATS=2: a shorter run when device time is short
repeats=${REPEATS:-3}
max_tokens=${MAX_TOKENS:-256}  # MAX_TOKENS=1024: runs long enough that the ramp-up is a small part
# ROUNDS=4: each stream of a closed level sends 4 requests one after another (c streams kept busy)
sampling=() suffix=""
if [ "${3:-}" = sampled ]; then sampling=(--sampling '{"temperature": 0.7, "top_p": 0.9}'); suffix=-sampled; fi
vllm_extra=()
# SET="key=value ..." TAG=-x: config overrides for the kestrel parts, and a name suffix for them
sets=(); for kv in ${SET:-}; do sets+=(--set "$kv"); done
tag=${TAG:-}
load=(--concurrency $levels --max-tokens "$max_tokens" --repeats "$repeats" --rounds "${ROUNDS:-1}" ${HTTP_ONLY:+--no-in-process})
vllm_limit=270
if [ "${3:-}" = openloop ] || [ "${3:-}" = both ]; then
  # 500 requests a rate: about 2 minutes of arrivals over the default rates; p99 is the 5th slowest.
  # Four client processes keep the send lag small at the H200's tens of thousands of chunks a second.
  open=(--request-rate ${RATES:-8 16 32 64 128 inf} --num-requests "${NUM_REQUESTS:-500}"
        --client-processes "${CLIENTS:-4}" ${OPEN_ARGS:-})
  load=("${open[@]}")
  vllm_limit=420  # its start-up and the sweep
  if [ "${3:-}" = both ]; then  # the closed levels, then the sweep, against one server start
    load=(--concurrency $levels --max-tokens "$max_tokens" --repeats "$repeats" --rounds "${ROUNDS:-1}" --no-in-process
          "${open[@]}")
    vllm_limit=560
  fi
fi
if [ "${3:-}" = grammar ]; then
  sampling=(--no-in-process --variant 'none={}' --variant 'grammar={"structured_outputs": {"regex": "[^\\x01]*\\x01"}}')
  vllm_extra=(--structured-outputs-config '{"backend": "xgrammar"}')  # the engine Kestrel uses
fi
mkdir -p "$out"  # the servers' logs go there before the first bench writes its JSON
bench() {  # limit, args...; the part's --name gets the suffix
  local args=("${@:2}")
  for i in "${!args[@]}"; do [ "${args[$i]}" = --name ] && args[$((i + 1))]+=$suffix; done
  timeout "$1" python3 -m benchmarks.http_bench "${load[@]}" --out "$out" "${sampling[@]}" "${args[@]}"
}

vllm_serve() {  # name, extra args: start vllm serve in its own environment, bench it, stop it
  local name=$1; shift
  [ -d /tmp/vwork/model ] || (source .peer/tools/unstage_vllm.sh >/dev/null &&
    python3 .peer/tools/vllm_bench.py --configs "" --no-serve-smoke --out "$out/vllm_convert")
  if [ ${#vllm_extra[@]} -gt 0 ] && [ ! -d /tmp/vsite/lmformatenforcer ]; then  # after the unstage, which rebuilds /tmp/vsite
    python3 -m pip install -q --no-index --no-deps --target /tmp/vsite .xfer/tools/vllm_wheels/*.whl
  fi
  (source .peer/tools/unstage_vllm.sh >/dev/null && exec python3 -m vllm.entrypoints.openai.api_server \
    --model /tmp/vwork/model --served-model-name SmolLM2-135M-Instruct --port 8011 \
    --gpu-memory-utilization 0.5 --max-model-len 4096 "${vllm_extra[@]}" "$@") > "$out/$name.log" 2>&1 &
  local pid=$!
  bench "$vllm_limit" --url http://127.0.0.1:8011 --name "$name"
  kill "$pid"; wait "$pid" 2>/dev/null
}

case $part in
  kestrel-tree)
    bench 560 --config configs/h200.yaml "${sets[@]}" --name "kestrel-tree$tag" ;;
  kestrel-plain)
    bench 560 --config configs/h200.yaml --set draft.enabled=false "${sets[@]}" --name "kestrel-plain$tag" ;;
  proxy)
    bench 560 --config configs/h200.yaml --set serve.http_proxy=serve --name kestrel-tree-serve-proxy --no-in-process ;;
  vllm-plain)
    vllm_serve vllm-plain ;;
  dp1|dp2|dp2-attention|replicas2)
    levels=${LEVELS:-64 128}
    case $part in
      dp1) extra=() ;;
      dp2) extra=(--set parallel.dp_size=2) ;;
      dp2-attention) extra=(--set parallel.dp_size=2 --set parallel.dp_attention=true) ;;
      replicas2) extra=(--set serve.engine_autoscaling.min_replicas=2 --set serve.engine_autoscaling.max_replicas=2) ;;
    esac
    bench 560 --config configs/h200.yaml --set scheduler.max_running_requests=128 "${extra[@]}" \
      --name "kestrel-$part" --no-in-process ;;
  vllm-eagle)
    # the head folder is already in the layout vLLM and SGLang load (LlamaForCausalLMEagle3,
    # midlayer.*, d2t): no conversion, the same weights as Kestrel's preset
    head=$(realpath "${HEAD_DIR:-heads/smollm2-135m-instruct-eagle3}")
    vllm_serve vllm-eagle3 --speculative-config \
      "{\"method\": \"eagle3\", \"model\": \"$head\", \"num_speculative_tokens\": 3}" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
