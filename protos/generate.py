"""Generate the code of every ``.proto`` under ``protos/`` (``make protos`` runs it):
``python -m indexer_service.protos.generate [--out DIR]``.

Writes ``*_pb2.py``, ``*_pb2.pyi`` and ``*_pb2_grpc.py`` beside each ``.proto``, ``*_descriptor.binpb``, its
FileDescriptorSet with the source comments (what server reflection sends, so ``grpcurl describe`` shows the comments;
the descriptors compiled into ``*_pb2.py`` have none), and ``*_wire.h``, every message's field numbers, tags and types
for C code that reads or writes the messages as raw bytes (service/compute/fastpath.c), or under ``--out`` with the same
layout, which the freshness test compares byte for byte with the committed files. grpcio-tools is pinned exactly in
pyproject.toml: another version generates different bytes and a different runtime check.
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import resources
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

PROTO_ROOT = Path(__file__).resolve().parent
# The descriptors keep import paths relative to PROTO_ROOT ("indexer/v1/indexer.proto", as grpcurl and other
# languages see them), while the Python package lives under "protos": protoc writes "from indexer.v1 import
# x_pb2" into the service stubs, which must become "from indexer_service.protos.indexer.v1 import x_pb2".
DESCRIPTOR_SUFFIX = "_descriptor.binpb"
WIRE_HEADER_SUFFIX = "_wire.h"
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
        header = stem.with_name(stem.name + WIRE_HEADER_SUFFIX)
        file = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set.read_bytes()).file[0]
        header.write_text(wire_header(file))
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py", DESCRIPTOR_SUFFIX, WIRE_HEADER_SUFFIX):
            generated.append(stem.with_name(stem.name + suffix))
        stub = stem.with_name(stem.name + "_pb2_grpc.py")
        stub.write_text(_STUB_IMPORT.sub(r"from indexer_service.protos.\1 import \2", stub.read_text()))
    return generated


# --- the C header: the wire contract of every message, from its descriptor -----------------------------------

_Field = descriptor_pb2.FieldDescriptorProto
_TYPE_NAMES = {number: name.removeprefix("TYPE_") for name, number in _Field.Type.items()}
# Wire types (protobuf's encoding guide): what the low three bits of a tag say about the bytes that follow.
_WIRE_VARINT, _WIRE_I64, _WIRE_LEN, _WIRE_I32 = 0, 1, 2, 5
_WIRE_TYPES = {
    **dict.fromkeys((_Field.TYPE_DOUBLE, _Field.TYPE_FIXED64, _Field.TYPE_SFIXED64), _WIRE_I64),
    **dict.fromkeys((_Field.TYPE_FLOAT, _Field.TYPE_FIXED32, _Field.TYPE_SFIXED32), _WIRE_I32),
    **dict.fromkeys((_Field.TYPE_STRING, _Field.TYPE_BYTES, _Field.TYPE_MESSAGE), _WIRE_LEN),
    _Field.TYPE_GROUP: 3,
}


def _c_name(camel: str) -> str:
    """``BuildChunkRequest`` -> ``BUILD_CHUNK_REQUEST``, ``query_start_loc`` -> ``QUERY_START_LOC``."""
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", camel).upper()


def _wire_type(field: descriptor_pb2.FieldDescriptorProto, syntax: str) -> int:
    wire = _WIRE_TYPES.get(field.type, _WIRE_VARINT)
    repeated_scalar = field.label == _Field.LABEL_REPEATED and wire != _WIRE_LEN
    # proto3 packs repeated scalars unless told not to; proto2 only when told to.
    packed = field.options.packed if field.options.HasField("packed") else syntax == "proto3"
    return _WIRE_LEN if repeated_scalar and packed else wire


def _message_lines(message: descriptor_pb2.DescriptorProto, prefix: str, full_name: str, syntax: str) -> list[str]:
    name = prefix + _c_name(message.name)
    lines = [f"/* {full_name} */"]
    if message.field:
        lines.append(f"#define {name}_FIELD_COUNT {len(message.field)}")
        lines.append(f"#define {name}_MAX_FIELD {max(f.number for f in message.field)}")
    for field in message.field:
        at = f"{name}_{_c_name(field.name)}"
        label = "repeated " if field.label == _Field.LABEL_REPEATED else "optional " if field.proto3_optional else ""
        kind = field.type_name.rsplit(".", 1)[-1] if field.type_name else _TYPE_NAMES[field.type].lower()
        lines.append(f"#define {at} {field.number} /* {label}{kind} {field.name} */")
        lines.append(f"#define {at}_TAG {field.number << 3 | _wire_type(field, syntax)}")
        lines.append(f"#define {at}_TYPE PB_TYPE_{_TYPE_NAMES[field.type]}")
    lines.append("")
    for nested in message.nested_type:
        if not nested.options.map_entry:
            lines += _message_lines(nested, name + "_", f"{full_name}.{nested.name}", syntax)
    return lines


def wire_header(file: descriptor_pb2.FileDescriptorProto) -> str:
    """The C header of ``file``: for each message field its number, its tag (number << 3 | wire type, the varint
    in front of it on the wire) and its declared type, named MESSAGE_FIELD, MESSAGE_FIELD_TAG and
    MESSAGE_FIELD_TYPE; MESSAGE_FIELD_COUNT and MESSAGE_MAX_FIELD per message."""
    guard = re.sub(r"\W", "_", file.name.removesuffix(".proto") + WIRE_HEADER_SUFFIX).upper()
    syntax = file.syntax or "proto2"
    messages, types = list(file.message_type), set()
    while messages:  # every field type in the file, nested messages included
        message = messages.pop()
        types.update(f.type for f in message.field)
        messages += message.nested_type
    lines = [
        f"/* Generated by `python -m indexer_service.protos.generate` from {file.name}: do not edit. */",
        f"/* The wire contract of every message of {file.package}, for C code that parses or writes them as raw",
        " * bytes: a field's tag is the varint in front of its value; _TYPE is descriptor.proto's field type. */",
        f"#ifndef {guard}",
        f"#define {guard}",
        "",
    ]
    for number in sorted(types):  # guarded: several such headers may meet in one C file
        name = f"PB_TYPE_{_TYPE_NAMES[number]}"
        lines += [f"#ifndef {name}", f"#define {name} {number}", "#endif"]
    lines.append("")
    for message in file.message_type:
        lines += _message_lines(message, "", f"{file.package}.{message.name}", syntax)
    lines += [f"#endif /* {guard} */", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m indexer_service.protos.generate", description=__doc__.splitlines()[0].rstrip(":")
    )
    parser.add_argument("--out", type=Path, default=PROTO_ROOT, help="output root (default: beside the protos)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
