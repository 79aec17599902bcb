#!/usr/bin/env bash
# SmolLM2-135M-Instruct draft heads on the GPUs of one machine (training/README.md).
#   usage: bash training/smollm2_h200.sh [OUT=runs/smollm2] [GEN_S=300] [TRAIN_S=960] [--set K=V ...]
# Stages (STAGES, default "data heads"), each of which fits one 10-minute device command
# when GEN_S, or TRAIN_S plus about 3 minutes of evaluation, does:
#   data   one generator per GPU (seed SEED+g on GPU g, into OUT/data<seed>; batch 512, 70%
#          greedy answers, since acceptance is measured on greedy decoding), prompts by MIX
#          (--category-mix; default magpie=1, the recipe of the 2026-11-30 heads; "default" =
#          the trainer's mix of chat, code, math, multi-turn, long and short prompts). More
#          data on one GPU: run it again with SEED=1, 2, ...
#   heads  the heads named in HEADS (default "eagle1 eagle1-tw01", the shipped recipe and
#          the EAGLE paper's token weight) trained on every OUT/data*/ at once, head i on GPU
#          i mod the GPU count, each for at most TRAIN_S seconds, then measured with the
#          engine on OUT/data0's held-out split, the MT-bench first turns and the fixed held-out
#          prompts of benchmarks/data/smollm2_heldout_prompts.jsonl (OUT/<head>/report.json,
#          logs OUT/<head>.log). "shipped" is no training: the shipped head measured the same way.
#   legs   the same heads on the same data, STEPS optimizer steps each (default 13000, the
#          shipped head's length), as resumable legs (python -m training.legs, one leg of at
#          most LEG_S seconds, default 540, per run of this stage): run the stage again, on this
#          machine or on another with OUT carried over (python -m training.run_pieces), until
#          each head's report is written; the last leg measures it as `heads` does. Each
#          unfinished leg exports the head as it stands to OUT/<head>/leg_head (about 20 MB):
#          carry it off the machine with the leg, since the machine may be gone before the next;
#          put back as OUT/<head>/leg_head on a fresh machine, the next leg continues from it.
# GREEDY sets the share of greedy answers in `data` (default 0.7; 1.0: every answer as greedy
# decoding, the way accept lengths are measured, writes it).
# EVAL_SAMPLES (default 48) and EVAL_TOKENS (default 256) set the measurement. INIT_HEAD=DIR
# starts every head of `heads` and `legs` from an exported head (train.py --init-head: the
# shipped head fine-tuned on more data, for instance) instead of from scratch.
set -euo pipefail
out=${1:-runs/smollm2}
gen_s=${2:-300}
train_s=${3:-960}
mkdir -p "$out"
ngpu=$(nvidia-smi -L | wc -l)
heads=(${HEADS:-eagle1 eagle1-tw01})
mix=${MIX:-magpie=1}
seed0=${SEED:-0}
evals=${EVAL_SAMPLES:-48}
# Every head is also measured on these, and no generated prompt may copy one of them.
eval_files=(benchmarks/data/mt_bench_questions.jsonl benchmarks/data/smollm2_heldout_prompts.jsonl)
eval_tokens=${EVAL_TOKENS:-256}
# Processes sharing a GPU split its memory between their engines, built one at a time
# (training/device_turn.py).
per_gpu=$(( (${#heads[@]} + ngpu - 1) / ngpu ))
# Generation runs 512 answers at once; evaluation at most 128 (--eval-batch). Options after
# TRAIN_S follow these settings, so they win over them.
engine=(--config configs/h200.yaml --set attention.backend=triton --set attention.plan_stream=false)
gen_engine=("${engine[@]}" --set scheduler.max_running_requests=512
            --set "attention.cuda_graph_batch_sizes=[1,2,4,8,16,32,64,128,256,512]" "${@:4}")
eval_engine=("${engine[@]}" --set scheduler.max_running_requests=128
             --set "attention.cuda_graph_batch_sizes=[1,2,4,8,16,32,64,128]" "${@:4}")

head_flags() {  # the trainer's options for one named head
  case $1 in
    eagle1)          echo --arch eagle ;;
    eagle1-tw01)     echo --arch eagle --token-weight 0.1 ;;
    eagle3)          echo --arch eagle3 --draft-vocab 8192 ;;
    eagle3-v16k)     echo --arch eagle3 --draft-vocab 16384 ;;
    eagle3-lmtarget) echo --arch eagle3 --draft-vocab 8192 --lm-head-init target ;;
    eagle3-ttt3)     echo --arch eagle3 --draft-vocab 8192 --ttt-steps 3 ;;
    eagle3-fscale)   echo --arch eagle3 --draft-vocab 8192 --feature-scale rms ;;
    eagle3-fscale-lmtarget) echo --arch eagle3 --draft-vocab 8192 --feature-scale rms --lm-head-init target ;;
    eagle3-last)     echo --arch eagle3 --draft-vocab 8192 --aux-layers 2 15 30 ;;
    # The shipped recipe with an MLP 4x the target's width (its held-out top-1 equals its
    # training top-1: the head underfits); with INIT_HEAD of the target's width it starts
    # as that head, widened (train.py --intermediate-size).
    eagle3-fscale-wide) echo --arch eagle3 --draft-vocab 8192 --feature-scale rms --intermediate-size 6144 ;;
    # The shipped recipe trained on the target's argmax alone (greedy acceptance asks only
    # that the draft's first choice be the target's) instead of its whole distribution.
    eagle3-fscale-hard) echo --arch eagle3 --draft-vocab 8192 --feature-scale rms --hard-targets ;;
    *) echo "unknown head $1" >&2; return 2 ;;
  esac
}

for h in "${heads[@]}"; do [ "$h" = shipped ] || head_flags "$h" > /dev/null || exit 2; done
init=()
[ -n "${INIT_HEAD:-}" ] && init=(--init-head "$INIT_HEAD")

for stage in ${STAGES:-data heads}; do
  case $stage in
    data)
      [ "$mix" = default ] && mix_flag=() || mix_flag=(--category-mix "$mix")
      pids=()
      for g in $(seq 0 $((ngpu - 1))); do
        seed=$((seed0 + g))
        CUDA_VISIBLE_DEVICES=$g python -m training.train "${gen_engine[@]}" --out "$out/data$seed" --data-only \
          --seed "$seed" --samples 200000 --gen-batch 512 \
          --gen-time-budget "$gen_s" --greedy-fraction "${GREEDY:-0.7}" "${mix_flag[@]}" --eval-only-prompts "${eval_files[@]}" \
          > "$out/data$seed.log" 2>&1 & pids+=($!)
      done
      for p in "${pids[@]}"; do wait "$p"; done ;;
    heads|legs)
      parts=("$out"/data*/data/train.jsonl)
      for d in "$out"/data*/; do  # only data0's held-out split is held out
        [ "$d" = "$out/data0/" ] || parts+=("$d/data/eval.jsonl")
      done
      held="$out/data0/data/eval.jsonl"
      share=(--set "kv_cache.memory_utilization=0.$(( 90 / per_gpu ))")
      pids=()
      for i in "${!heads[@]}"; do
        h=${heads[$i]}
        export CUDA_VISIBLE_DEVICES=$((i % ngpu))
        if [ "$stage" = legs ]; then
          [ "$h" = shipped ] && continue
          # status 3: legs are left (run the stage again); the last leg measures the head
          { python -m training.legs --out "$out/$h" --leg-seconds "${LEG_S:-540}" --max-legs 1 -- \
              "${eval_engine[@]}" "${share[@]}" $(head_flags "$h") "${init[@]}" --data "${parts[@]}" --eval-data "$held" \
              --epochs 40 --max-steps "${STEPS:-13000}" --eval-samples "$evals" --eval-max-tokens "$eval_tokens" \
              --eval-prompts "${eval_files[@]}" --eval-batch 128 || [ $? = 3 ]; } >> "$out/$h.log" 2>&1 & pids+=($!)
          continue
        fi
        if [ "$h" = shipped ]; then
          mkdir -p "$out/shipped"
          { python -m training.evaluate "${eval_engine[@]}" "${share[@]}" --prompts "$held" --num-prompts "$evals" \
              --max-tokens "$eval_tokens" --out "$out/shipped/heldout.json" &&
            for f in "${eval_files[@]}"; do
              python -m training.evaluate "${eval_engine[@]}" "${share[@]}" --no-baseline --max-tokens "$eval_tokens" \
                --prompts "$f" --out "$out/shipped/$(basename "$f" .jsonl).json" || exit 1
            done
          } > "$out/shipped.log" 2>&1 & pids+=($!)
          continue
        fi
        # The held-out split is GPU 0's (join_samples drops its prompts from training).
        python -m training.train "${eval_engine[@]}" "${share[@]}" $(head_flags "$h") "${init[@]}" --data "${parts[@]}" \
          --eval-data "$held" --epochs 40 --train-time-budget "$train_s" --eval-samples "$evals" \
          --eval-max-tokens "$eval_tokens" --eval-prompts "${eval_files[@]}" \
          --eval-batch 128 --out "$out/$h" > "$out/$h.log" 2>&1 & pids+=($!)
      done
      unset CUDA_VISIBLE_DEVICES
      status=0
      for p in "${pids[@]}"; do wait "$p" || status=1; done
      echo "$stage done (status $status)"
      if [ "$stage" = legs ]; then
        for h in "${heads[@]}"; do
          [ "$h" = shipped ] || echo "$h: $(cat "$out/$h/train_state/progress.json" 2>/dev/null || echo 'no progress yet')"
        done
      fi
      [ $status = 0 ] || exit $status ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
