#!/usr/bin/env bash
# Where the serving path's CPU goes under load: one Kestrel server at one concurrency, 2048 tokens a
# stream, three times back to back (http_bench), with py-spy sampling the Engine replica (the HTTP
# front end), the engine core and the rank (the GPU's host thread) during the second run, and
# top's per-process CPU beside.
#   bash benchmarks/profile_http.sh PY_SPY OUT [CONCURRENCY] [--set k=v ...]
# Later --concurrency/--max-tokens in the options override the runs' (the profile follows the
# second level equal to CONCURRENCY); SPY_DELAY (s, default 1) delays the sampling.
# Writes OUT/profile_{replica,core,rank}.txt (py-spy raw stacks: `python -m benchmarks.stack_summary`
# sums them) and OUT/top.txt.
set -uo pipefail
spy=$1; out=$2; c=${3:-64}; shift 3 || shift $#
cd "$(dirname "$0")/.."
log="$out/profile_bench.log"
timeout 400 python3 -m benchmarks.http_bench --config configs/h200.yaml --concurrency "$c" "$c" "$c" \
  --max-tokens 2048 --no-in-process --name profile --out "$out" "$@" > "$log" 2>&1 &
bench=$!
until grep -q "c=$c:" "$log" 2>/dev/null; do
  kill -0 $bench 2>/dev/null || { echo "the benchmark ended early"; tail -20 "$log"; exit 1; }
  sleep 0.2
done
replica=$(pgrep -f "ServeReplica:kestrel:EngineDeployment" | head -1)
sleep "${SPY_DELAY:-1}"  # into the second run's stream, past its warm-up (0: its admissions)
core=$(pgrep -f "EngineCoreActor" | head -1)
rank=$(pgrep -f "RankActor" | head -1)
"$spy" record -p "$replica" -d 3 -r 500 -f raw -o "$out/profile_replica.txt" --nonblocking &
"$spy" record -p "$core" -d 3 -r 500 -f raw -o "$out/profile_core.txt" --nonblocking &
"$spy" record -p "$rank" -d 3 -r 500 -f raw -o "$out/profile_rank.txt" --nonblocking &
top -b -d 0.5 -n 6 -w 200 | grep -v "^$" > "$out/top.txt"
wait $bench
tail -8 "$log"
