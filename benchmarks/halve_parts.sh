#!/usr/bin/env bash
# Split each staged part (DIR/partK/<chunk>) into two halves, DIR/hKa and DIR/hKb, so that a
# part plus the repository's tracked files fits one 64 MiB transfer to the GPU machine.
# On the machine: `cp DIR/hKa/* /tmp/vstage/`, then `cat DIR/hKb/<chunk> >> /tmp/vstage/<chunk>`.
set -euo pipefail
dir=${1:-.peer}
for part in "$dir"/part*; do
  k=${part##*/part}
  for f in "$part"/*; do
    name=${f##*/}
    half=$(( ($(stat -c %s "$f") + 1) / 2 ))
    mkdir -p "$dir/h${k}a" "$dir/h${k}b"
    head -c "$half" "$f" > "$dir/h${k}a/$name"
    tail -c +"$((half + 1))" "$f" > "$dir/h${k}b/$name"
  done
done
echo "halved $(ls -d "$dir"/part* | wc -l) parts into $dir/h*a, $dir/h*b"
