#!/usr/bin/env bash
# Installs Debian's prometheus package (it carries both `prometheus` and `promtool`) for the deploy tests.
# Idempotent: a machine that already has both binaries is left alone, so CI on a reused machine costs nothing.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# No recommends: they would pull node-exporter and friends, which the tests never run. The package's
# postinst tries to start a system service; in a container without an init that fails harmlessly, and
# the tests start their own Prometheus on a free loopback port anyway.
$SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null

command -v prometheus >/dev/null && command -v promtool >/dev/null
