#!/usr/bin/env bash
# Pack what a head-training leg needs on a GPU machine that has torch and triton but not
# the rest (the default GGUF target, pydantic, gguf), with files of your own (a data run's
# run_pieces folder, a carried leg head), into as few device transfers as the 64 MiB limit
# allows, xz-compressed: 3 for the target, a 17 MB data run and a leg head, against 7 for
# the serving bundle.
#   usage (project root): bash training/pack_for_device.sh [PATH ...]
# Writes .xfer/train/p0..pN (one piece each) and .xfer/train/install.sh. On the machine:
#   call k < N:  carry [".xfer/train/pk"],  mkdir -p /tmp/xfer && cp .xfer/train/pk/* /tmp/xfer/
#   call N:      carry [".xfer/train/pN", ".xfer/train/install.sh"], then
#                cp .xfer/train/pN/* /tmp/xfer/ && source .xfer/train/install.sh
# install.sh checks and unpacks the pieces into /tmp/train (each PATH under
# /tmp/train/extra/<its name>), installs the wheels into /tmp/site and exports PYTHONPATH and
# KESTREL_DEFAULT_GGUF; then, for instance:
#   python3 -m training.run_pieces unpack /tmp/train/extra/data0-pieces /tmp/kt/data0
#   HEADS=eagle3-fscale STAGES=legs bash training/smollm2_h200.sh /tmp/kt
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
source benchmarks/device_pieces.sh
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/train/wheels" "$work/train/model" "$work/train/extra"
PACK_PYTHON=.venv/bin/python wheels "$work/train/wheels" pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection gguf==0.19.0
gguf=$(.venv/bin/python -c "from actors.models.loader import default_model_path; print(default_model_path())" 2>/dev/null || true)
[ -f "$gguf" ] || { echo "pack: the default GGUF is not installed here (make setup installs it)"; exit 1; }
cp "$gguf" "$work/train/model/"
for p in "$@"; do cp -r "$p" "$work/train/extra/"; done
# xz: a transfer fewer for the default GGUF, a data run and a leg head (about 10% smaller)
tar -C "$work" -cf - train | xz -9 -T2 > "$work/all.tar.xz"
rm -rf .xfer/train && mkdir -p .xfer/train
split -b "$(piece_bytes)" -d -a 1 "$work/all.tar.xz" .xfer/train/piece_
n=0
for f in .xfer/train/piece_*; do mkdir -p ".xfer/train/p$n"; mv "$f" ".xfer/train/p$n/"; n=$((n + 1)); done
sum=$(sha256sum "$work/all.tar.xz" | cut -c1-64)
cat > .xfer/train/install.sh <<EOF
# Sourced on the GPU machine (project root) once /tmp/xfer holds every piece.
cat /tmp/xfer/piece_* > /tmp/train.tar.xz
[ "\$(sha256sum /tmp/train.tar.xz | cut -c1-64)" = $sum ] || { echo "install: a piece is missing or stale"; return 1; }
python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)" /tmp/train.tar.xz \\
  | tar -C /tmp -xf - && rm /tmp/train.tar.xz
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/train/wheels/*.whl
export PYTHONPATH=/tmp/site KESTREL_DEFAULT_GGUF=\$(ls /tmp/train/model/*.gguf)
echo "install: ready (/tmp/train/extra: \$(ls /tmp/train/extra | tr '\n' ' '))"
EOF
echo "$n pieces in .xfer/train/p0..p$((n - 1)), then source .xfer/train/install.sh"
