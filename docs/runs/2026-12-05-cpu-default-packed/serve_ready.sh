#!/bin/bash
# seconds from the serve command to the first 200 from /v1/models; then one chat completion
# usage: serve_ready.sh REPO_DIR
cd "$1"
start=$(date +%s.%N)
PYTHONPATH="$1" /work/main/.venv/bin/python -m serve_app.cli serve > /tmp/prof/serve.log 2>&1 &
pid=$!
until curl -sf http://127.0.0.1:8000/v1/models > /dev/null; do sleep 0.1; done
ready=$(date +%s.%N)
echo "ready $(echo "$ready - $start" | bc) s ($1)"
curl -s http://127.0.0.1:8000/v1/chat/completions -H 'content-type: application/json' -d '{"model":"SmolLM2-135M-Instruct","messages":[{"role":"user","content":"Say hi"}],"max_tokens":8}' | head -c 200; echo
kill -TERM $pid; sleep 5; kill -9 $pid 2>/dev/null
ray stop --force > /dev/null 2>&1
sleep 3
