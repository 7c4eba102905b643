"""A request message from its proto3 JSON mapping (protobuf.dev, "ProtoJSON Format"), for the RPCs over HTTP.

Why not ``google.protobuf.json_format.Parse``: its errors are Python exception texts (a number array for a bytes
field gave ``can only concatenate list (not "bytes") to list``, ``"four"`` for an int32 ``invalid literal for
int()``, non-UTF-8 a codec error), and it decodes bytes with a base64 decoder that drops every character outside
the alphabet (``"AAAA$$$$"`` became 3 bytes), so a mistyped array silently turned into other numbers. Here every
value is checked against its field and a wrong one is :class:`InvalidArgument` naming the field and the form it
takes. The rules are the mapping's own:

- bytes: a base64 string, standard (``+/``) or URL-safe (``-_``) alphabet, with or without ``=`` padding ("Either
  standard or URL-safe base64 encoding with/without paddings are accepted"); one alphabet per string and
  nothing outside it, as Go's protojson decodes them;
- int32, int64: a JSON number or a string holding one, exponent notation allowed, no fractional part, in range;
- bool: ``true`` or ``false``; a message: an object;
- ``null`` for any field leaves it unset; keys are the lowerCamelCase JSON name or the proto name; a field given
  twice (also under both names) keeps the last value; an unknown key is an error.

Answers are still written by ``json_format.MessageToJson``, which follows the mapping as it is.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
from decimal import Decimal

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from indexer_service.service.errors import InvalidArgument

_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: ("int32", -(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: ("int64", -(2**63), 2**63 - 1),
}
# The field types the request messages use; tests/service/test_http_errors.py holds every request field to it,
# so a new field of another type fails a test rather than a caller.
SUPPORTED_TYPES = frozenset(
    {*_INT_RANGES, FieldDescriptor.TYPE_BOOL, FieldDescriptor.TYPE_BYTES, FieldDescriptor.TYPE_MESSAGE}
)
_JSON_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_STANDARD_BASE64 = re.compile(r"[A-Za-z0-9+/]*")
_URL_SAFE_BASE64 = re.compile(r"[A-Za-z0-9_-]*")
_FROM_URL_SAFE = str.maketrans("-_", "+/")
# Integers longer than this are read as Decimal: Python refuses to make ints of more than 4,300 digits (an error
# text a caller could not act on), and the range check below tells such a number apart without making it.
_LONGEST_INT_DIGITS = 40
BASE64_FORM = "a base64 string (standard or URL-safe alphabet, = padding optional)"


class _JsonObject(list):
    """A JSON object as its (key, value) pairs in the order sent: the last of duplicate keys wins, whichever of
    a field's two names each one used."""


def message_from_json(message_type: type[Message], body: bytes) -> Message:
    """``body`` (UTF-8 JSON) as a ``message_type``, or :class:`InvalidArgument` naming what is wrong."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidArgument(
            f"body is not UTF-8 (byte 0x{body[exc.start]:02x} at offset {exc.start}): JSON must be UTF-8 text"
        ) from None
    try:
        value = json.loads(
            text,
            object_pairs_hook=_JsonObject,
            parse_float=Decimal,
            parse_int=lambda digits: int(digits) if len(digits) <= _LONGEST_INT_DIGITS else Decimal(digits),
            parse_constant=_not_json,
        )
    except json.JSONDecodeError as exc:
        raise InvalidArgument(f"body is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}") from None
    except _NotJson as exc:
        raise InvalidArgument(f"body is not valid JSON: {exc} is not a JSON value") from None
    except RecursionError:
        raise InvalidArgument("body is not valid JSON: nested too deeply") from None
    name = message_type.DESCRIPTOR.name
    if not isinstance(value, _JsonObject):
        raise InvalidArgument(f"body must be a JSON object (a {name}), got {_describe(value)}")
    message = message_type()
    _fill(message, value, "")
    return message


class _NotJson(ValueError):
    """``NaN``, ``Infinity``, ``-Infinity``: Python's json reads them, JSON has no such values."""


def _not_json(constant: str) -> None:
    raise _NotJson(constant)


def _fill(message: Message, pairs: _JsonObject, prefix: str) -> None:
    descriptor: Descriptor = message.DESCRIPTOR
    for key, value in pairs:
        field = descriptor.fields_by_camelcase_name.get(key) or descriptor.fields_by_name.get(key)
        if field is None:
            names = ", ".join(f.name for f in descriptor.fields) or "none"
            raise InvalidArgument(
                f"unknown field `{prefix}{key}` in {descriptor.name}; its fields are {names} (or their lowerCamelCase "
                "JSON names)"
            )
        path = prefix + field.name
        if value is None:
            message.ClearField(field.name)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            if not isinstance(value, _JsonObject):
                raise InvalidArgument(
                    f"field `{path}` must be a JSON object (a {field.message_type.name}), got {_describe(value)}"
                )
            nested = getattr(message, field.name)
            nested.SetInParent()
            _fill(nested, value, path + ".")
        else:
            setattr(message, field.name, _scalar(field, value, path))


def _scalar(field: FieldDescriptor, value: object, path: str) -> object:
    if field.type == FieldDescriptor.TYPE_BYTES:
        decoded = _base64(value) if isinstance(value, str) else None
        if decoded is None:
            hint = ""
            if isinstance(value, list) and not isinstance(value, _JsonObject):
                hint = " (an array of numbers goes as the base64 of its little-endian int32 bytes)"
            raise InvalidArgument(f"bytes field `{path}` must be {BASE64_FORM}, got {_describe(value)}{hint}")
        return decoded
    if field.type == FieldDescriptor.TYPE_BOOL:
        if not isinstance(value, bool):
            raise InvalidArgument(f"bool field `{path}` must be true or false, got {_describe(value)}")
        return value
    kind, low, high = _INT_RANGES[field.type]
    number = _integer(value)
    if number is None or not low <= number <= high:
        raise InvalidArgument(
            f"{kind} field `{path}` must be an integer from {low} to {high} (a JSON number or a string holding "
            f"one), got {_describe(value)}"
        )
    return int(number)


def _integer(value: object) -> int | Decimal | None:
    """An integral number from a JSON number or a string holding one (``"1e2"`` too), else None. Kept as a Decimal
    until its range is checked: ``1e999999999`` must not become an int."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        if not _JSON_NUMBER.fullmatch(value):
            return None
        value = Decimal(value)
    if isinstance(value, Decimal) and value == value.to_integral_value():
        return value
    return None


def _base64(text: str) -> bytes | None:
    """The bytes of ``text`` in either base64 alphabet, padded or not; None for anything else."""
    data = text.rstrip("=")
    padding = len(text) - len(data)
    if (padding and (padding > 2 or len(text) % 4)) or len(data) % 4 == 1:
        return None
    if _STANDARD_BASE64.fullmatch(data):
        pass
    elif _URL_SAFE_BASE64.fullmatch(data):
        data = data.translate(_FROM_URL_SAFE)
    else:
        return None
    try:
        return base64.b64decode(data + "=" * (-len(data) % 4), validate=True)
    except binascii.Error:
        return None


def _describe(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, _JsonObject):
        return "a JSON object"
    if isinstance(value, list):
        return "a JSON array"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:40] + "..."
        return f"the string {json.dumps(shown)}"
    shown = str(value)
    return f"the number {shown if len(shown) <= 40 else shown[:40] + '...'}"
