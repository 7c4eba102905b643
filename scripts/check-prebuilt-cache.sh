#!/usr/bin/env bash
# Replays the image's cache recipe on this host, without Docker: precompile the warmup set with the GPU hidden
# (the Dockerfile's build step), then start the server on that cache (the pod) and report how long each warmup
# key took and whether anything new was compiled. Then the same start on an empty cache, for comparison.
# Usage: scripts/check-prebuilt-cache.sh [TARGET]   (TARGET defaults to cuda:90, as in the Dockerfile)
# On a GPU host the server warms up in-process on the GPU; on a CPU host it compiles TARGET ahead of time.
set -euo pipefail

TARGET="${1:-cuda:90}"
if command -v indexer-service >/dev/null 2>&1; then
    CLI=(indexer-service)
else
    CLI=(python3 -m indexer_service.service.process.cli)
fi
WORK="$(mktemp -d)"
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill -TERM "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

count_files() { find "$1" -type f | wc -l; }

# Starts a server on TRITON_CACHE_DIR=$1, waits for /readyz (at most 10 min), prints its warmup, stops it.
serve_on() {
    local cache="$1" ports="$WORK/ports.json"
    rm -f "$ports"
    TRITON_CACHE_DIR="$cache" INDEXER_GRPC_HOST=127.0.0.1 INDEXER_HTTP_HOST=127.0.0.1 \
        "${CLI[@]}" serve --grpc-port 0 --health-port 0 --http-port 0 --http-rpc-port 0 --port-file "$ports" >"$WORK/serve.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 1 6000); do
        if [ -s "$ports" ] && python3 - "$ports" <<'PY' 2>/dev/null; then
import json, sys, urllib.request
port = json.load(open(sys.argv[1]))["http_port"]
urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2)
PY
            break
        fi
        kill -0 "$SERVER_PID" 2>/dev/null || { cat "$WORK/serve.log"; return 1; }
        sleep 0.1
    done
    local grpc_port
    grpc_port="$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['grpc_port'])" "$ports")"
    # Live calls at every ratio of the warmup set: compiles_after_ready below must stay 0.
    python3 - "$grpc_port" <<'PY'
import sys
import numpy as np
from indexer_service.kernels.inputs import ChunkInputs
from indexer_service.kernels.planner import BatchInputs
from indexer_service.client import IndexerClient

with IndexerClient(f"127.0.0.1:{sys.argv[1]}") as client:
    qsl, seq_lens = np.array([0, 4, 10, 300]), np.array([8, 20, 1000])
    for ratio in (0, 4, 128):
        for _ in range(10):
            client.build_chunk(ChunkInputs(qsl, seq_lens, ratio, 0, 3))
            client.plan_batch(BatchInputs(qsl, seq_lens, ratio, 1, 1 << 20))
print("live calls: 60 ok")
PY
    "${CLI[@]}" check "127.0.0.1:$grpc_port"
    kill -TERM "$SERVER_PID"
    wait "$SERVER_PID"
    SERVER_PID=""
    grep -E "warmup|backend=" "$WORK/serve.log" | tail -n 8
}

mkdir -p "$WORK/prebuilt" "$WORK/cold"
echo "== precompile --target $TARGET with the GPU hidden (the image build step)"
start=$(date +%s.%N)
CUDA_VISIBLE_DEVICES="" TRITON_CACHE_DIR="$WORK/prebuilt" \
    "${CLI[@]}" precompile --target "$TARGET" --cache-dir "$WORK/prebuilt"
echo "precompile wall seconds: $(python3 -c "import sys; print(round($(date +%s.%N) - $start, 3))")"
before=$(count_files "$WORK/prebuilt")

echo "== serve on the prebuilt cache (the pod)"
serve_on "$WORK/prebuilt"
after=$(count_files "$WORK/prebuilt")
echo "cache files: $before after the build, $after after serving ($((after - before)) new)"

echo "== serve on an empty cache (no image cache: a cold warmup)"
serve_on "$WORK/cold"
