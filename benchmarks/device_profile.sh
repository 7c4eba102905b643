# Issue 36 item 6 on the GPU machine's CPUs (device tool, from the repository root: `bash benchmarks/device_profile.sh`,
# carrying .whl/ with py-spy's wheel, benchmarks/loadgen/bin/ and benchmarks/goecho/bin/, built here): where the
# service's CPU per call goes against the Python echo's at medium, 32 in flight (benchmarks/profile_rpc.py: /proc
# per thread, then py-spy --native), then the A/B of RELEASE_GIL_ELEMENTS in service/compute/fastpath.c: its value,
# 1e9 (the GIL never released), its value again, each a bench_rpc of medium (--rounds 4 --seconds 2), the extension
# rebuilt in place between them. It edits fastpath.c in this tree and puts it back: run it in a copy of the tree
# (the device tool's is one). With EXTRA_RPC=1, then bench_rpc --backend numpy,triton,auto (2 rounds of 1 s) if
# enough of BUDGET seconds (default 540) is left; PROFILE=0 leaves the profile out. bench_rpc's load generator gets
# static 16 MiB receive windows (LOADGEN_WINDOW bytes, 0 for grpc-go's dynamic ones: on that machine they fail about
# one medium call in 10,000, which voids a bench_rpc run; benchmarks/loadgen/main.go). The set-up is
# scripts/device-env.sh's. Writes under $OUT:
# profile-rpc.json, service.collapsed, echo.collapsed, ab-kept.json, ab-never.json, ab-kept-again.json,
# rpc-backends.json (EXTRA_RPC) and every step's output in device-profile.log.
T0=$(date +%s)
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
. scripts/device-env.sh
set +e
set -o pipefail
SRC=service/compute/fastpath.c
W=${LOADGEN_WINDOW:-16777216}
rebuild() {
    rm -f service/compute/_fastpath*.so
    "$PY" setup.py -q build_ext --inplace 2>&1 | tail -2
    grep -n "^#define RELEASE_GIL_ELEMENTS" "$SRC"
    "$PY" -c "import indexer_service.service.compute._fastpath as f; print('fastpath', f.__file__)"
}
{
    nproc
    lscpu | grep -m1 "Model name"
    echo "commit ${COMMIT:-$(git rev-parse HEAD 2>/dev/null)}"
    if [ "${PROFILE:-1}" = 1 ]; then
        step 150 env PYTHONUNBUFFERED=1 "$PY" -m benchmarks.profile_rpc --batch medium-64 --in-flight 32 --rounds 2 \
            --seconds 6 --profile-seconds 8 --rate 500 --py-spy /tmp/site/bin/py-spy --out-dir "$O"
    fi
    cp "$SRC" /tmp/fastpath.c.orig
    for variant in kept never kept-again; do
        cp /tmp/fastpath.c.orig "$SRC"
        if [ "$variant" = never ]; then
            sed -i 's/^#define RELEASE_GIL_ELEMENTS 65536$/#define RELEASE_GIL_ELEMENTS 1000000000/' "$SRC"
        fi
        rebuild
        step 130 env PYTHONUNBUFFERED=1 "$PY" -m benchmarks.bench_rpc --batches medium-64 --rounds 4 --seconds 2 \
            --loadgen-window "$W" --out "$O/ab-$variant.json"
    done
    cp /tmp/fastpath.c.orig "$SRC"
    rebuild
    left=$((${BUDGET:-540} - $(elapsed) - 10))
    if [ "${EXTRA_RPC:-0}" = 1 ] && [ "$left" -ge 150 ]; then
        step "$left" env PYTHONUNBUFFERED=1 "$PY" -m benchmarks.bench_rpc --backend numpy,triton,auto \
            --batches small-8,medium-64,large-256 --rounds 2 --seconds 1 --loadgen-window "$W" --out "$O/rpc-backends.json"
    fi
} 2>&1 | tee "$O/device-profile.log"
