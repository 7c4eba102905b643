#!/usr/bin/env bash
# Installs what the proto checks and the other-language client tests need beyond the venv, only where it is
# missing (idempotent: a reused machine pays nothing):
#   - buf (npm @bufbuild/buf, pinned in tools/buf/package-lock.json) for tests/system/test_proto_buf.py;
#   - the Node client's @grpc/grpc-js and @grpc/proto-loader (clients/node/package-lock.json);
#   - Debian's Go toolchain and generators for the Go client: golang-go, protobuf-compiler, protoc-gen-go
#     (protobuf APIv2; golang-goprotobuf-dev is the older v1.3 generator), protoc-gen-go-grpc, and the Go
#     libraries the client builds against, from Debian too (golang-google-grpc-dev, golang-google-protobuf-dev,
#     golang-github-golang-protobuf-1-5-dev): the Go module proxy is not reachable from CI, so the client
#     builds in GOPATH mode against /usr/share/gocode (see clients/go/README.md).
# Usage: scripts/install-client-tools.sh
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

missing=()
for package in golang-go protobuf-compiler protoc-gen-go protoc-gen-go-grpc golang-google-grpc-dev \
    golang-google-protobuf-dev golang-github-golang-protobuf-1-5-dev; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$package")
    fi
done
if ! command -v npm >/dev/null 2>&1; then
    missing+=(nodejs npm)
fi
if [ "${#missing[@]}" -gt 0 ]; then
    echo "installing the client tests' tools from Debian: ${missing[*]} ..."
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
for tool in go protoc protoc-gen-go protoc-gen-go-grpc npm node; do
    command -v "$tool" >/dev/null
done

if [ ! -x "$ROOT/tools/buf/node_modules/.bin/buf" ]; then
    echo "installing buf (tools/buf, npm ci) ..."
    npm ci --prefix "$ROOT/tools/buf" --no-audit --no-fund --loglevel=error
fi
if [ ! -d "$ROOT/clients/node/node_modules/@grpc/grpc-js" ] || [ ! -d "$ROOT/clients/node/node_modules/@grpc/proto-loader" ]; then
    echo "installing the Node client's modules (clients/node, npm ci) ..."
    npm ci --prefix "$ROOT/clients/node" --no-audit --no-fund --loglevel=error
fi
