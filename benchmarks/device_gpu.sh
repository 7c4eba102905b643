# The GPU machine's runs at one commit (device tool, from the repository root: `bash benchmarks/device_gpu.sh`,
# carrying .whl/, benchmarks/loadgen/bin/ and benchmarks/goecho/bin/, built here: the GPU machine has no Go):
# bench_kernel (the kernel's device time against a device copy), bench_triton (the Triton backend under
# concurrency), the GPU tests (scripts/h200-gpu-tests.sh), then, if enough of BUDGET seconds (default 540) is left,
# bench_rpc with the numpy, Triton and auto backends on all three batches (3 rounds of 1 s, 2 when time is short;
# the load generator's receive windows static, LOADGEN_WINDOW bytes, default 16 MiB: benchmarks/device_profile.sh).
# Each step under its own timeout; one that fails does not stop the next. The set-up is scripts/device-env.sh's.
# Writes under $OUT: kernel.json, triton.json, gpu-tests.log, rpc-backends.json, and every step's output in
# device-gpu.log. Where the tree has no git checkout, pass COMMIT (the run records read it).
T0=$(date +%s)
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
. scripts/device-env.sh
set +e
set -o pipefail
{
    nproc
    lscpu | grep -m1 "Model name"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,utilization.gpu --format=csv
    echo "commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
    step 150 env PYTHONUNBUFFERED=1 "$PY" -m benchmarks.bench_kernel --out "$O/kernel.json"
    step 120 env PYTHONUNBUFFERED=1 "$PY" -m benchmarks.bench_triton --seconds 1 --out "$O/triton.json"
    step 150 bash scripts/h200-gpu-tests.sh
    left=$((${BUDGET:-540} - $(elapsed) - 10))
    rounds=$((left >= 300 ? 3 : 2))
    if [ "$left" -ge 150 ]; then
        step "$left" env PYTHONUNBUFFERED=1 "$PY" -m benchmarks.bench_rpc --backend numpy,triton,auto \
            --batches small-8,medium-64,large-256 --rounds "$rounds" --seconds 1 \
            --loadgen-window "${LOADGEN_WINDOW:-16777216}" --out "$O/rpc-backends.json"
    else
        echo "== bench_rpc --backend numpy,triton,auto not run: ${left} s left"
    fi
} 2>&1 | tee "$O/device-gpu.log"
