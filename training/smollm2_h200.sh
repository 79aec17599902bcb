#!/usr/bin/env bash
# The SmolLM2-135M-Instruct head, as trained on two H200s on 2026-11-30 (training/README.md):
# data generated with the engine on every GPU at once (one seed each), then two EAGLE-1
# heads on the joined data, unrolled 3 steps: the shipped recipe (token loss weight 0.5,
# the trainer's default) in OUT/eagle1, and the EAGLE paper's weight 0.1 in
# OUT/eagle1-tw01 for comparison. With two GPUs each head has one; with one GPU they share
# it. Each is measured with the engine on the held-out split and on the MT-bench first
# turns. EAGLE-3 lost to EAGLE-1 in the 2026-11-30 runs (docs/benchmarks.md);
# `--arch eagle3 --draft-vocab 4096` in place of the comparison's flags repeats that.
#   usage: bash training/smollm2_h200.sh [OUT=runs/smollm2] [GEN_S=300] [TRAIN_S=960] [--set K=V ...]
set -euo pipefail
out=${1:-runs/smollm2}
gen_s=${2:-300}
train_s=${3:-960}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
# Up to two processes share a GPU: each engine holds at most 45% of it.
engine=(--config configs/h200.yaml --set attention.backend=triton --set attention.plan_stream=false
        --set kv_cache.memory_utilization=0.45
        --set "attention.cuda_graph_batch_sizes=[1,2,4,8,16,32,64,128,256,512]" "${@:4}")

# 1. data: one generator per GPU, unseeded Magpie prompts as in that run (the default mix of
#    categories came later); greedy responses are 70% because acceptance is measured
#    on greedy decoding.
pids=()
for g in $(seq 0 $((ngpu - 1))); do
  CUDA_VISIBLE_DEVICES=$g python -m training.train "${engine[@]}" --out "$out/data$g" --data-only \
    --seed "$g" --samples 200000 --gen-batch 512 --gen-time-budget "$gen_s" --greedy-fraction 0.7 \
    --category-mix magpie=1 \
    > "$out/data$g.log" 2>&1 & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
parts=()
for g in $(seq 0 $((ngpu - 1))); do parts+=("$out/data$g/data/train.jsonl"); done
for g in $(seq 1 $((ngpu - 1))); do parts+=("$out/data$g/data/eval.jsonl"); done  # only GPU 0's is held out

# 2. two heads; the held-out split is GPU 0's (join_samples drops its prompts from training)
train=(--data "${parts[@]}" --eval-data "$out/data0/data/eval.jsonl" --arch eagle
       --epochs 40 --train-time-budget "$train_s" --eval-samples 48 --eval-max-tokens 256
       --eval-prompts benchmarks/data/mt_bench_questions.jsonl --eval-batch 128)
pids=()
CUDA_VISIBLE_DEVICES=0 python -m training.train "${engine[@]}" "${train[@]}" --out "$out/eagle1" \
  > "$out/eagle1.log" 2>&1 & pids+=($!)
CUDA_VISIBLE_DEVICES=$((ngpu - 1)) python -m training.train "${engine[@]}" "${train[@]}" --token-weight 0.1 \
  --out "$out/eagle1-tw01" > "$out/eagle1-tw01.log" 2>&1 & pids+=($!)
status=0
for p in "${pids[@]}"; do wait "$p" || status=1; done
echo "done (status $status)"
exit $status
