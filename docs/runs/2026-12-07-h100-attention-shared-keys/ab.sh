#!/usr/bin/env bash
# Bundle-free: the attention kernel before/after, FP8 fused-quant and GEMV GPU tests, the attention tests.
# The kernel before the change: git show eb31524^:kestrel_kernels/triton_attention.py > .xfer/tools/old/triton_attention.py
# (an ignored folder carried to the device); run there as: bash ab.sh $OUT
O=$1; export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader
B="timeout 150 python3 benchmarks/attention_bench.py"
cp kestrel_kernels/triton_attention.py /tmp/new.py
for v in new old; do
  [ $v = old ] && cp .xfer/tools/old/triton_attention.py kestrel_kernels/
  P=; [ $v = new ] && P=--peers
  $B --prefill-chunk 8192 --context 8192 32768 --tiles default $P > $O/prefill_$v.txt 2>&1
  $B --batch 1 64 --context 1024 4096 32768 --splits 16 64 --tiles default > $O/decode_$v.txt 2>&1
done
cp /tmp/new.py kestrel_kernels/triton_attention.py
grep -h "prefill\|flashinfer\|sdpa" $O/prefill_*.txt | cut -c1-130
tail -n 14 $O/decode_new.txt $O/decode_old.txt | cut -c1-130
timeout 150 python3 -m pytest -q tests/gpu/test_fp8_fused_quant_gpu.py tests/gpu/test_triton_gemv_gpu.py > $O/fp8_gpu_tests.txt 2>&1; tail -3 $O/fp8_gpu_tests.txt
timeout 120 python3 -m pytest -q -x tests/unit/test_triton_attention.py > $O/attn_tests.txt 2>&1; tail -2 $O/attn_tests.txt
