"""The protobuf wire format, read by hand: enough to walk XLA's serialized protos
(``BufferAssignmentProto``, ``HloModuleProto``) without depending on ``google.protobuf``.

A message is a sequence of (field number, wire type, value): varints (type 0), 64- and 32-bit
fixed values (types 1 and 5, returned as raw bytes) and length-delimited bytes (type 2: a
nested message, a string, or a packed repeated scalar). Groups (types 3 and 4) are refused:
proto3 has none. :func:`spans` also gives each field's own bytes, so that a message can be
written back without some of its fields (:func:`length_delimited` writes a field anew).
https://protobuf.dev/programming-guides/encoding/
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


class WireError(ValueError):
    """Bytes that are not a protobuf message."""


def varint(data: bytes, pos: int) -> tuple[int, int]:
    """The varint at ``pos``: (value, position after it)."""
    value = shift = 0
    while True:
        if pos >= len(data):
            raise WireError(f"truncated varint at byte {pos}")
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise WireError(f"varint longer than 10 bytes at byte {pos}")


def signed(value: int) -> int:
    """A varint read back as the int64 it encodes (negative ones take 10 bytes)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _read(data: bytes) -> Iterator[tuple[int, int, Any, int]]:
    """(field number, wire type, value, position after the field) of each field of ``data``,
    in order; a one-byte tag or length (most are) is read in place."""
    pos, end = 0, len(data)
    while pos < end:
        key = data[pos]
        if key < 0x80:
            pos += 1
        else:
            key, pos = varint(data, pos)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise WireError(f"field number 0 at byte {pos}")
        value: int | bytes
        if wire == 2:
            size = data[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = varint(data, pos)
            if pos + size > end:
                raise WireError(f"field {number}: {size} bytes past the end")
            value, pos = data[pos : pos + size], pos + size
        elif wire == 0:
            value, pos = varint(data, pos)
        elif wire == 1:
            value, pos = data[pos : pos + 8], pos + 8
        elif wire == 5:
            value, pos = data[pos : pos + 4], pos + 4
        else:
            raise WireError(f"field {number}: wire type {wire} (groups) is not proto3")
        if pos > end:
            raise WireError(f"field {number}: truncated")
        yield number, wire, value, pos


def spans(data: bytes) -> Iterator[tuple[int, int, Any, bytes]]:
    """(field number, wire type, value, the field's own bytes: tag, length and value) of each
    field of ``data``, in order."""
    start = 0
    for number, wire, value, pos in _read(data):
        yield number, wire, value, data[start:pos]
        start = pos


def fields(data: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of each field of ``data``, in order."""
    for number, wire, value, _ in _read(data):
        yield number, wire, value


def encode_varint(value: int) -> bytes:
    """``value`` (0 or more) as a varint."""
    if value < 0:
        raise WireError(f"a varint of {value}: negative values are written as 64-bit")
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def length_delimited(number: int, payload: bytes) -> bytes:
    """Field ``number`` holding ``payload`` (wire type 2), as it is written in a message."""
    return encode_varint(number << 3 | 2) + encode_varint(len(payload)) + payload


def message(data: bytes) -> dict[int, list[Any]]:
    """Field number -> its values in order (a repeated field has several; a scalar one)."""
    out: dict[int, list[Any]] = {}
    for number, _, value, _ in _read(data):
        values = out.get(number)
        if values is None:
            out[number] = [value]
        else:
            values.append(value)
    return out


def ints(msg: dict[int, list[Any]], number: int) -> list[int]:
    """A repeated int64 field, packed (proto3's default) or not, as signed ints."""
    out: list[int] = []
    for value in msg.get(number, []):
        if isinstance(value, int):
            out.append(signed(value))
            continue
        pos = 0
        while pos < len(value):
            v, pos = varint(value, pos)
            out.append(signed(v))
    return out


def first_int(msg: dict[int, list[Any]], number: int, default: int = 0) -> int:
    """A scalar int64/int32/bool/enum field (proto3: absent means 0); the last one wins."""
    values = [v for v in msg.get(number, []) if isinstance(v, int)]
    return signed(values[-1]) if values else default


def text(msg: dict[int, list[Any]], number: int) -> str:
    """A string field ("" when absent)."""
    values = msg.get(number, [])
    return bytes(values[-1]).decode("utf-8", "replace") if values else ""


def messages(msg: dict[int, list[Any]], number: int) -> list[dict[int, list[Any]]]:
    """A repeated (or single) message field, each decoded."""
    return [message(bytes(v)) for v in msg.get(number, []) if not isinstance(v, int)]


__all__ = [
    "WireError",
    "encode_varint",
    "fields",
    "first_int",
    "ints",
    "length_delimited",
    "message",
    "messages",
    "signed",
    "spans",
    "text",
    "varint",
]
