# The H200 host's run of bench_shapes (device tool, from the repository root: `bash benchmarks/h200_shapes.sh`,
# carrying .whl/ and benchmarks/loadgen/bin/): the wheels the image lacks (grpcio 1.85 and its health and
# reflection packages, uvicorn, httptools, prometheus-client: .whl/, downloaded for cp312 as
# /work/.library/device/README.md says), the package importable as indexer_service through a folder of links, the
# C extension, an indexer-service script beside python3, then the benchmark at N = 4 (servers pinned to CPUs 0-3,
# the Go load generator, built here where Go is, on the others).
set -e
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
PY=$(command -v python3)
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pkg/indexer_service && touch /tmp/pkg/indexer_service/__init__.py
for d in kernels service protos; do ln -sfn "$PWD/$d" "/tmp/pkg/indexer_service/$d"; done
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD
$PY setup.py -q build_ext --inplace 2>&1 | tail -2
printf '#!/bin/sh\nexport PYTHONPATH=%s\nexec %s -m indexer_service.service.cli "$@"\n' "$PYTHONPATH" "$PY" > "$(dirname "$PY")/indexer-service"
chmod +x "$(dirname "$PY")/indexer-service"
nproc
$PY -c "import grpc, indexer_service.service._fastpath as f; print('grpc', grpc.__version__, 'fastpath', f.__file__)"
timeout 500 $PY -m benchmarks.bench_shapes --n 4 --rounds 3 --seconds 2 --out "${OUT:-/tmp}/h200-shapes.json" > "${OUT:-/tmp}/h200-shapes.log" 2>&1; tail -c 6000 "${OUT:-/tmp}/h200-shapes.log"
