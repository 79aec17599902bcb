#!/usr/bin/env bash
# The SmolLM2-135M-Instruct head, as trained on one H200 (training/README.md): one data
# generation with the engine, then two EAGLE-1 heads side by side on the same data and
# GPU, unrolled 3 steps (the shipped head) and 5 steps (its comparison), each measured
# with the engine on its held-out split and on the MT-bench first turns. EAGLE-3 lost to
# EAGLE-1 in sessions 3 and 4 (docs/benchmarks.md); `--arch eagle3 --draft-vocab 4096`
# in place of `--ttt-steps 5` repeats that comparison.
#   usage: bash training/smollm2_h200.sh [OUT=runs/smollm2] [GEN_S=300] [TRAIN_S=480] [--set K=V ...]
set -euo pipefail
out=${1:-runs/smollm2}
gen_s=${2:-300}
train_s=${3:-480}
mkdir -p "$out"
# Two processes share the GPU: each engine takes a tenth of the free memory for KV.
engine=(--config configs/h200.yaml --set attention.backend=triton --set attention.plan_stream=false
        --set kv_cache.memory_fraction=0.1
        --set "attention.cuda_graph_batch_sizes=[1,2,4,8,16,32,64,128,256,512]" "${@:4}")
python -m training.train "${engine[@]}" --out "$out/data" --data-only \
  --samples 100000 --gen-batch 512 --gen-time-budget "$gen_s"
train=(--data "$out/data/data/train.jsonl" --eval-data "$out/data/data/eval.jsonl" --arch eagle
       --epochs 20 --train-time-budget "$train_s" --eval-samples 48 --eval-max-tokens 256
       --eval-prompts benchmarks/data/mt_bench_questions.jsonl --eval-batch 128)
pids=()
python -m training.train "${engine[@]}" "${train[@]}" --out "$out/eagle1" \
  > "$out/eagle1.log" 2>&1 & pids+=($!)
python -m training.train "${engine[@]}" "${train[@]}" --ttt-steps 5 --out "$out/eagle1-ttt5" \
  > "$out/eagle1-ttt5.log" 2>&1 & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
echo "done (status $status)"
exit $status
