"""python -m benchmarks.loadgen: builds benchmarks/loadgen/bin/loadgen (see __init__.py) and prints its path."""

import sys

from benchmarks.loadgen import binary

try:
    print(binary())
except RuntimeError as exc:
    sys.exit(f"cannot build the load generator: {exc}")
