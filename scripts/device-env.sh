# Sourced by the scripts that run on the project's GPU machine (benchmarks/h200_shapes.sh,
# scripts/h200-gpu-tests.sh), from the repository root, with .whl/ carried: the wheels its image lacks (cp312,
# downloaded as /work/.library/device/README.md says: grpcio 1.85 and its health and reflection packages, uvicorn,
# httptools, prometheus-client, and for the tests trustme, cryptography, h2), the package importable as
# indexer_service through a folder of links (the image has no registry to install it from), the C extension built
# in place, and an indexer-service script beside python3. Sets PY.
set -e
PY=$(command -v python3)
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
mkdir -p /tmp/pkg/indexer_service && touch /tmp/pkg/indexer_service/__init__.py
for d in kernels service protos; do ln -sfn "$PWD/$d" "/tmp/pkg/indexer_service/$d"; done
ln -sfn "$PWD/clients/python/client" /tmp/pkg/indexer_service/client
export PYTHONPATH=/tmp/site:/tmp/pkg:$PWD
$PY setup.py -q build_ext --inplace 2>&1 | tail -2
printf '#!/bin/sh\nexport PYTHONPATH=%s\nexec %s -m indexer_service.service.process.cli "$@"\n' "$PYTHONPATH" "$PY" > "$(dirname "$PY")/indexer-service"
chmod +x "$(dirname "$PY")/indexer-service"
$PY -c "import grpc, indexer_service.service.compute._fastpath as f; print('grpc', grpc.__version__, 'fastpath', f.__file__)"
# The device scripts' timed steps (benchmarks/device_gpu.sh, benchmarks/device_profile.sh): `step LIMIT COMMAND...`
# runs COMMAND under `timeout LIMIT` and prints its start and exit code in seconds since T0 (the sourcing script's
# start); O is where their files go.
T0=${T0:-$(date +%s)}
O=${OUT:-/tmp}
elapsed() { echo $(($(date +%s) - T0)); }
step() {
    local limit=$1
    shift
    echo "== $* (limit ${limit} s, at $(elapsed) s)"
    timeout "$limit" "$@"
    echo "== rc $? at $(elapsed) s"
}
