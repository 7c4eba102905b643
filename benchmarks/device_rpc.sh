# bench_rpc on the project's GPU machine's CPUs (device tool, from the repository root: `bash benchmarks/device_rpc.sh`,
# carrying .whl/, benchmarks/loadgen/bin/ and benchmarks/goecho/bin/, built here: the GPU machine has no Go): the
# service and the Python and Go echoes each pinned to CPU 0, the Go load generator on the others; small and
# medium batches. The set-up is scripts/device-env.sh's.
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
. scripts/device-env.sh
nproc; lscpu | grep -m1 "Model name" || true; git log -1 --format="commit %H %cI" 2>/dev/null || true
timeout 540 $PY -m benchmarks.bench_rpc --batches small-8,medium-64 --rounds "${ROUNDS:-6}" --seconds 2 \
    --out "${OUT:-/tmp}/device-rpc.json" 2>&1 | tail -40
