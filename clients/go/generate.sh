#!/usr/bin/env bash
# Generates the Go package of indexer/v1/indexer.proto into clients/go/indexer/v1 (git ignores it), with
# protoc, protoc-gen-go and protoc-gen-go-grpc (Debian: protobuf-compiler, protoc-gen-go,
# protoc-gen-go-grpc). The import path comes from the proto's go_package; module= strips this module's prefix.
# Usage: clients/go/generate.sh [PROTO_ROOT]   (default: protos/ of this repository)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
protos="${1:-$here/../../protos}"
module="github.com/indexer-service/indexer-service/clients/go"
rm -rf "$here/indexer"
protoc -I "$protos" \
    --go_out="$here" --go_opt=module="$module" \
    --go-grpc_out="$here" --go-grpc_opt=module="$module" \
    indexer/v1/indexer.proto
