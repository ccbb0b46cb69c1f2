"""Avro binary encoders compiled from a writer schema: the writer's per-event encoding.

fastavro's writer takes a dict (so the event's payload is dumped into one first) and walks
the schema for every record it writes: a lookup and a type dispatch per field, a
validation pass per union. A writer only ever encodes its types' current schemas, so each
is compiled once into straight-line Python that reads the ``Event`` and its payload model
by attribute and appends to one ``bytearray``. Only what our schemas use is compiled
(records, string, bytes, long, int, boolean, double, ``timestamp-micros``, arrays, maps,
unions with null, and a content field's union of string and ``runlog.Sealed``, chosen by the
value's type); a schema with anything else gets no encoder, and ``codec.encode`` uses fastavro.

A compiled encoder raises on any value it does not take exactly as its schema says (a
wrong type, an int out of range, a missing attribute); ``codec.encode`` then encodes the
event's dict with fastavro, whose error (or output) stands. ``tests/schemas/test_avro_writer.py``
checks the two write the same bytes for events of every released schema.
"""

from __future__ import annotations

import itertools
import keyword
import struct
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from runlog.schemas._sealing import SEALED_NAME, SEALED_SCHEMA

Encoder = Callable[[Any, bytearray], None]
"""Appends the Avro encoding of an object to the buffer, or raises: the object holds each
field of a record as an attribute of the field's name (an ``Event``, its payload model)."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


class Unsupported(Exception):
    """The schema uses something the compiler does not compile."""


def _varint(out: bytearray, n: int) -> None:
    """A zig-zag varint (Avro's int and long), ``n`` already range-checked."""
    z = (n << 1) ^ (n >> 63)
    while z > 0x7F:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)


def _long(out: bytearray, n: int) -> None:
    if type(n) is not int or not _LONG_MIN <= n <= _LONG_MAX:
        raise TypeError(f"not an Avro long: {n!r}")
    if 0 <= n < 64:  # most counters, lengths and versions: one byte
        out.append(n << 1)
    else:
        _varint(out, n)


def _int(out: bytearray, n: int) -> None:
    if type(n) is not int or not _INT_MIN <= n <= _INT_MAX:
        raise TypeError(f"not an Avro int: {n!r}")
    _long(out, n)  # the same zig-zag varint, in a narrower range


def _string(out: bytearray, s: str) -> None:
    if type(s) is str:
        b = s.encode()
    elif isinstance(s, str):  # a str enum (EventType): its value
        b = str.encode(s)
    else:
        raise TypeError(f"not an Avro string: {s!r}")
    n = len(b)
    if n < 64:
        out.append(n << 1)
    else:
        _varint(out, n)
    out += b


def _bytes(out: bytearray, b: bytes) -> None:
    if type(b) is not bytes:
        raise TypeError(f"not Avro bytes: {b!r}")
    n = len(b)
    if n < 64:
        out.append(n << 1)
    else:
        _varint(out, n)
    out += b


def _boolean(out: bytearray, v: bool) -> None:
    if type(v) is not bool:
        raise TypeError(f"not an Avro boolean: {v!r}")
    out.append(1 if v else 0)


_pack_double = struct.Struct("<d").pack


def _double(out: bytearray, v: float) -> None:
    if type(v) is not float:
        raise TypeError(f"not an Avro double: {v!r}")
    out += _pack_double(v)


def _timestamp_micros(out: bytearray, v: datetime | int) -> None:
    if type(v) is datetime and v.tzinfo is not None:
        d = v - _EPOCH
        _long(out, (d.days * 86400 + d.seconds) * 1_000_000 + d.microseconds)
    elif type(v) is int:
        _long(out, v)
    else:  # a naive datetime: fastavro reads it in local time; leave that to it
        raise TypeError(f"not an aware datetime: {v!r}")


_PRIMITIVES = {
    "string": "_string",
    "bytes": "_bytes",
    "long": "_long",
    "int": "_int",
    "boolean": "_boolean",
    "double": "_double",
}


class _Compiler:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self.names = itertools.count()

    def var(self, stem: str) -> str:
        return f"{stem}{next(self.names)}"

    def emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    def value(self, schema: Any, expr: str, depth: int) -> None:
        """Lines that append the encoding of ``expr`` (a variable) as ``schema``."""
        if schema == SEALED_NAME:  # the envelope, named again after its first definition
            schema = SEALED_SCHEMA
        if isinstance(schema, str):
            if schema not in _PRIMITIVES:
                raise Unsupported(f"type {schema!r}")
            self.emit(depth, f"{_PRIMITIVES[schema]}(out, {expr})")
            return
        if isinstance(schema, list):
            self.union(schema, expr, depth)
            return
        kind = schema.get("type")
        logical = schema.get("logicalType")
        if logical is not None:
            if logical == "timestamp-micros" and kind == "long":
                self.emit(depth, f"_timestamp_micros(out, {expr})")
                return
            raise Unsupported(f"logical type {logical!r}")
        if kind == "record":
            self.record(schema, expr, depth)
        elif kind in ("array", "map"):
            self.collection(schema, expr, depth)
        elif isinstance(kind, str) and kind in _PRIMITIVES and len(schema) == 1:
            self.value(kind, expr, depth)
        else:
            raise Unsupported(f"type {kind!r}")

    def union(self, branches: list[Any], expr: str, depth: int) -> None:
        if any(_is_sealed(b) for b in branches):
            self.sealed_union(branches, expr, depth)
            return
        others = [b for b in branches if b != "null"]
        if len(branches) != 2 or len(others) != 1:
            raise Unsupported(f"union {branches!r}")  # only null | T
        null_at = branches.index("null")
        self.emit(depth, f"if {expr} is None:")
        self.emit(depth + 1, f"out.append({null_at << 1})")
        self.emit(depth, "else:")
        self.emit(depth + 1, f"out.append({(1 - null_at) << 1})")
        self.value(others[0], expr, depth + 1)

    def sealed_union(self, branches: list[Any], expr: str, depth: int) -> None:
        """A content field: None, plaintext ``str`` or a ``Sealed`` value, by its type."""
        kinds = ["null" if b == "null" else "sealed" if _is_sealed(b) else b for b in branches]
        if sorted(kinds) not in (["sealed", "string"], ["null", "sealed", "string"]):
            raise Unsupported(f"union {branches!r}")
        test = {"null": f"{expr} is None", "string": f"type({expr}) is str"}
        first = True
        for k, kind in enumerate(kinds):
            if kind == "sealed":
                continue
            self.emit(depth, f"{'if' if first else 'elif'} {test[kind]}:")
            first = False
            self.emit(depth + 1, f"out.append({k << 1})")
            if kind == "string":
                self.emit(depth + 1, f"_string(out, {expr})")
        self.emit(depth, "else:")
        self.emit(depth + 1, f"out.append({kinds.index('sealed') << 1})")
        self.record(SEALED_SCHEMA, expr, depth + 1)

    def record(self, schema: dict[str, Any], expr: str, depth: int) -> None:
        for f in schema["fields"]:
            name = f["name"]
            if not name.isidentifier() or keyword.iskeyword(name) or name.startswith("_"):
                raise Unsupported(f"field name {name!r}")
            v = self.var("v")
            self.emit(depth, f"{v} = {expr}.{name}")
            self.value(f["type"], v, depth)

    def collection(self, schema: dict[str, Any], expr: str, depth: int) -> None:
        is_map = schema["type"] == "map"
        test = f"type({expr}) is not dict" if is_map else f"type({expr}) not in (list, tuple)"
        self.emit(depth, f"if {test}:")
        self.emit(depth + 1, f"raise TypeError('not an Avro {schema['type']}')")
        self.emit(depth, f"if {expr}:")
        self.emit(depth + 1, f"_long(out, len({expr}))")
        item = self.var("i")
        if is_map:
            key = self.var("k")
            self.emit(depth + 1, f"for {key}, {item} in {expr}.items():")
            self.emit(depth + 2, f"_string(out, {key})")
            self.value(schema["values"], item, depth + 2)
        else:
            self.emit(depth + 1, f"for {item} in {expr}:")
            self.value(schema["items"], item, depth + 2)
        self.emit(depth, "out.append(0)")


def compile_encoder(parsed: Any) -> Encoder | None:
    """An encoder of objects as the fastavro-parsed record schema ``parsed``, or None when
    it uses something not compiled here (fastavro then encodes it)."""
    if not isinstance(parsed, dict) or parsed.get("type") != "record":
        return None
    c = _Compiler()
    try:
        c.value(parsed, "record", 1)
    except Unsupported:
        return None
    source = "def encode(record, out):\n" + "\n".join(c.lines) + "\n"
    namespace: dict[str, Any] = {
        "_string": _string,
        "_bytes": _bytes,
        "_long": _long,
        "_int": _int,
        "_boolean": _boolean,
        "_double": _double,
        "_timestamp_micros": _timestamp_micros,
    }
    exec(compile(source, f"<avro encoder {parsed.get('name')}>", "exec"), namespace)
    encoder: Encoder = namespace["encode"]
    return encoder


def _is_sealed(branch: Any) -> bool:
    return branch == SEALED_NAME or (isinstance(branch, dict) and branch.get("name") == SEALED_NAME)
