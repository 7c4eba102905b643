"""python -m benchmarks.goecho: builds benchmarks/goecho/bin/goecho (see __init__.py) and prints its path."""

import sys

from benchmarks.goecho import binary

try:
    print(binary())
except RuntimeError as exc:
    sys.exit(f"cannot build the Go echo: {exc}")
