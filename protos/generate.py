"""Generate the Python code of every ``.proto`` under ``protos/``: ``python -m protos.generate [--out DIR]``.

Writes ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` beside each ``.proto``, and ``*_descriptor.binpb``, its
FileDescriptorSet with the source comments (what server reflection sends, so ``grpcurl describe`` shows the
comments; the descriptors compiled into ``*_pb2.py`` have none), or under ``--out`` with the same layout, which
the freshness test compares byte for byte with the committed files. grpcio-tools is
pinned exactly in pyproject.toml: another version generates different bytes and a different runtime check.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path

from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
# The descriptors keep import paths relative to PROTO_ROOT ("indexer/v1/indexer.proto", as grpcurl and other
# languages see them), while the Python package lives under "protos": protoc writes "from indexer.v1 import
# x_pb2" into the service stubs, which must become "from protos.indexer.v1 import x_pb2".
DESCRIPTOR_SUFFIX = "_descriptor.binpb"
_STUB_IMPORT = re.compile(r"^from (indexer(?:\.\w+)*) import (\w+_pb2)", re.MULTILINE)


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def generate(out: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc over every proto file into ``out``; returns the generated files."""
    sources = proto_files()
    well_known = resources.files("grpc_tools") / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(s) for s in sources),
    ]
    out.mkdir(parents=True, exist_ok=True)
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    generated = []
    for source in sources:
        stem = out / source.with_suffix("")
        descriptor_set = stem.with_name(stem.name + DESCRIPTOR_SUFFIX)
        described = [args[0], args[1], args[2], "--include_source_info", f"--descriptor_set_out={descriptor_set}"]
        if protoc.main([*described, str(source)]) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(described)} {source}")
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", DESCRIPTOR_SUFFIX):
            generated.append(stem.with_name(stem.name + suffix))
        stub = stem.with_name(stem.name + "_pb2_grpc.py")
        stub.write_text(_STUB_IMPORT.sub(r"from protos.\1 import \2", stub.read_text()))
    return generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m protos.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: beside the protos)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
