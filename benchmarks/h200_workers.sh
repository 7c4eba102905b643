# The H200 run of bench_workers (device tool: `bash benchmarks/h200_workers.sh`, carrying .whl/): the wheels the
# image lacks, the C extension, an indexer-service script beside python3, then the benchmark.
set -e
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
PY=$(command -v python3)
$PY -m pip install --no-index --no-deps -q .whl/*.whl 2>&1 | tail -2 || true
$PY - <<'P'
import importlib
for m in ("grpc","uvicorn","uvloop","httptools","psutil","prometheus_client","numpy","grpc_health"):
    try: importlib.import_module(m); print("ok", m)
    except Exception as e: print("MISSING", m, e)
P
$PY setup.py build_ext --inplace -q 2>&1 | tail -2
printf '#!/bin/sh\nexec %s -m indexer_service.service.process.cli "$@"\n' "$PY" > "$(dirname $PY)/indexer-service"; chmod +x "$(dirname $PY)/indexer-service"
nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null || true
timeout 420 $PY -m benchmarks.bench_workers --workers 1,2,4,8 --rounds 2 --seconds 2 --out $OUT/h200-workers.json 2>&1 | tail -20
