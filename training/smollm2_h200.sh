#!/usr/bin/env bash
# The SmolLM2-135M-Instruct heads, as trained on one H200 (training/README.md):
# one data generation with the engine, then EAGLE-1 and EAGLE-3 (draft vocabulary 4096;
# larger ones did no better on the first run) trained side by side on the same data and
# GPU, each measured with the engine on its held-out split and on the MT-bench first turns.
#   usage: bash training/smollm2_h200.sh [OUT=runs/smollm2] [GEN_S=240] [TRAIN_S=300] [--set K=V ...]
set -euo pipefail
out=${1:-runs/smollm2}
gen_s=${2:-240}
train_s=${3:-300}
mkdir -p "$out"
# Two processes share the GPU: each engine takes a tenth of the free memory for KV.
engine=(--config configs/h200.yaml --set attention.backend=triton --set attention.plan_stream=false
        --set kv_cache.memory_fraction=0.1
        --set "attention.cuda_graph_batch_sizes=[1,2,4,8,16,32,64,128,256,512]" "${@:4}")
python -m training.train "${engine[@]}" --out "$out/data" --data-only \
  --samples 100000 --gen-batch 512 --gen-time-budget "$gen_s"
train=(--data "$out/data/data/train.jsonl" --eval-data "$out/data/data/eval.jsonl"
       --epochs 20 --train-time-budget "$train_s" --eval-samples 48 --eval-max-tokens 256
       --eval-prompts benchmarks/data/mt_bench_questions.jsonl --eval-batch 128)
pids=()
python -m training.train "${engine[@]}" "${train[@]}" --arch eagle3 --draft-vocab 4096 \
  --out "$out/eagle3-v4096" > "$out/eagle3-v4096.log" 2>&1 & pids+=($!)
python -m training.train "${engine[@]}" "${train[@]}" --arch eagle --out "$out/eagle1" \
  > "$out/eagle1.log" 2>&1 & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
echo "done (status $status)"
exit $status
