# The H200 host's run of bench_workers (device tool, from the repository root: `bash benchmarks/h200_workers.sh`,
# carrying .whl/ and benchmarks/loadgen/bin/, the Go load generator built here: the GPU machine has no Go). The
# set-up is scripts/device-env.sh's.
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
. scripts/device-env.sh
nproc; cat /sys/fs/cgroup/cpu.max 2>/dev/null || true
timeout 420 $PY -m benchmarks.bench_workers --workers 1,2,4,8 --rounds 2 --seconds 2 --out "${OUT:-/tmp}/h200-workers.json" 2>&1 | tail -20
