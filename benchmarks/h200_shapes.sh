# The H200 host's run of bench_shapes (device tool, from the repository root: `bash benchmarks/h200_shapes.sh`,
# carrying .whl/ and benchmarks/loadgen/bin/, the Go load generator built here: the GPU machine has no Go). N = 4:
# servers pinned to CPUs 0-3, the load generator on the others. The set-up is scripts/device-env.sh's.
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
. scripts/device-env.sh
nproc
timeout 500 $PY -m benchmarks.bench_shapes --n 4 --rounds 3 --seconds 2 --out "${OUT:-/tmp}/h200-shapes.json" > "${OUT:-/tmp}/h200-shapes.log" 2>&1
tail -c 6000 "${OUT:-/tmp}/h200-shapes.log"
