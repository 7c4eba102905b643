# The GPU tests on the project's GPU machine (device tool, from the repository root: `bash scripts/h200-gpu-tests.sh`,
# carrying .whl/): the tests that skip without CUDA, and the warmup-proof tests that compile in process there.
# The set-up is scripts/device-env.sh's. The log comes back as $OUT/gpu-tests.log.
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
. scripts/device-env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
$PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())"
set -o pipefail
timeout 540 $PY -m pytest -q -p no:cacheprovider -rs tests/kernels/test_gpu.py tests/service/test_gpu.py \
    tests/service/test_warmup_proof.py tests/kernels/test_launch_combiner.py 2>&1 | tee "${OUT:-/tmp}/gpu-tests.log" | tail -25
