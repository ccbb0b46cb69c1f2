"""Per-schema compiled code of the hot path: Avro binary straight into the event models
(decoders and model builders), and events straight into Avro binary (encoders, below).

``codec.decode`` spends most of a record's time outside the fold: fastavro reads the body
through a file object (a Python call per field), and pydantic then validates every value
of the resulting dicts again, although the schema has already proven most of them. This
module compiles, once per released writer schema, a Python function that reads the Avro
binary body from the bytes themselves, and a builder that turns the decoded values into
the pydantic models with ``model_construct``, checking only what the Avro schema cannot
prove:

* ``Literal`` fields (Avro carries them as plain strings): membership;
* floats: finite (NaN and infinity are refused everywhere, as the models say);
* numeric bounds declared on a field (``Field(ge=0)``): the bound.

A model (or a nested one) with anything else on it (a model or field validator, a
constraint or type this module does not recognise, a field whose Avro type does not
exactly prove its annotation, fields that differ from the schema's) gets no builder, and
its records go through pydantic as before. The reader is held to fastavro's behaviour on
every byte string, valid or hostile, by ``tests/schemas/test_compiled_decoder.py``: the same value,
or both refuse.
"""

from __future__ import annotations

import itertools
import keyword
import math
import struct
import types
import typing
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel

from runlog.schemas._sealing import SEALED_NAME, SEALED_SCHEMA

Reader = Callable[[bytes, int], tuple[Any, int]]
"""``read(data, start) -> (value, end)``; raises on bytes the schema cannot read."""

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_DOUBLE = struct.Struct("<d")
_FLOAT = struct.Struct("<f")


class Unreadable(ValueError):
    """The bytes do not follow the schema (a length below zero, a bad union branch...)."""


class _Gen:
    """Emits the body of one reader function, one statement per line."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.n = 0

    def var(self) -> str:
        self.n += 1
        return f"v{self.n}"

    def emit(self, depth: int, line: str) -> None:
        self.lines.append("    " * depth + line)

    def long(self, d: int, out: str) -> None:
        # Inline, loop included: a call per varint costs as much as reading it.
        self.emit(d, "x = data[i]")
        self.emit(d, "i += 1")
        self.emit(d, "if x & 0x80:")
        self.emit(d + 1, "x &= 0x7F")
        self.emit(d + 1, "s = 7")
        self.emit(d + 1, "while True:")
        self.emit(d + 2, "b = data[i]")
        self.emit(d + 2, "i += 1")
        self.emit(d + 2, "x |= (b & 0x7F) << s")
        self.emit(d + 2, "if b < 0x80:")
        self.emit(d + 3, "x &= 0xFFFFFFFFFFFFFFFF")  # 64 bits, as fastavro keeps
        self.emit(d + 3, "break")
        self.emit(d + 2, "s += 7")
        self.emit(d + 2, "if s > 63:")
        self.emit(d + 3, "raise _Unreadable('varint longer than 10 bytes')")
        self.emit(d, f"{out} = (x >> 1) ^ -(x & 1)")

    def value(self, schema: Any, d: int, out: str) -> None:
        if schema == SEALED_NAME:  # the envelope, named again after its first definition
            schema = SEALED_SCHEMA
        if isinstance(schema, list):
            self._union(schema, d, out)
            return
        kind = schema if isinstance(schema, str) else schema["type"]
        logical = schema.get("logicalType") if isinstance(schema, dict) else None
        if isinstance(kind, dict | list):
            self.value(kind, d, out)
        elif kind == "null":
            self.emit(d, f"{out} = None")
        elif kind == "boolean":
            self.emit(d, "x = data[i]")
            self.emit(d, "i += 1")
            self.emit(d, f"{out} = x != 0")  # as fastavro: any byte but 0 is true
        elif kind in ("int", "long") and logical == "timestamp-micros":
            self.long(d, "n")
            self.emit(d, f"{out} = _EPOCH + _timedelta(microseconds=n)")
        elif kind in ("int", "long"):
            self.long(d, out)
        elif kind == "double":
            self.emit(d, f"{out} = _DOUBLE(data, i)[0]")
            self.emit(d, "i += 8")
        elif kind == "float":
            self.emit(d, f"{out} = _FLOAT(data, i)[0]")
            self.emit(d, "i += 4")
        elif kind in ("string", "bytes"):
            self.long(d, "n")
            self.emit(d, "e = i + n")
            self.emit(d, "if n < 0 or e > size:")
            self.emit(d + 1, "raise _Unreadable(f'length {n} at {i} runs past the record')")
            self.emit(d, f"{out} = data[i:e]" + (".decode()" if kind == "string" else ""))
            self.emit(d, "i = e")
        elif kind == "record":
            fields = [(f["name"], self.var()) for f in schema["fields"]]
            for (_, v), f in zip(fields, schema["fields"], strict=True):
                self.value(f["type"], d, v)
            self.emit(d, f"{out} = {{" + ", ".join(f"{n!r}: {v}" for n, v in fields) + "}")
        elif kind in ("array", "map"):
            self._blocks(schema, kind, d, out)
        else:
            raise NotImplementedError(f"no compiled reader for Avro type {kind!r}")

    def _union(self, branches: list[Any], d: int, out: str) -> None:
        b = self.var()
        self.long(d, b)
        for k, branch in enumerate(branches):
            self.emit(d, f"{'if' if k == 0 else 'elif'} {b} == {k}:")
            self.value(branch, d + 1, out)
        self.emit(d, "else:")
        self.emit(d + 1, f"raise _Unreadable(f'union branch {{{b}}} of {len(branches)}')")

    def _blocks(self, schema: Any, kind: str, d: int, out: str) -> None:
        count, item = self.var(), self.var()
        self.emit(d, f"{out} = []" if kind == "array" else f"{out} = {{}}")
        self.emit(d, "while True:")
        self.long(d + 1, count)
        self.emit(d + 1, f"if {count} == 0:")
        self.emit(d + 2, "break")
        self.emit(d + 1, f"if {count} < 0:")
        self.emit(d + 2, f"{count} = -{count}")
        self.long(d + 2, "n")  # the block's size in bytes: not needed to read it
        self.emit(d + 1, f"for _ in range({count}):")
        if kind == "array":
            self.value(schema["items"], d + 2, item)
            self.emit(d + 2, f"{out}.append({item})")
        else:
            key = self.var()
            self.value("string", d + 2, key)
            self.value(schema["values"], d + 2, item)
            self.emit(d + 2, f"{out}[{key}] = {item}")


def compile_reader(schema: Any) -> Reader:
    """A reader of ``schema``'s binary encoding (parsed or plain JSON schema)."""
    gen = _Gen()
    gen.value(schema, 1, "out")
    body = "\n".join(gen.lines)
    source = f"def read(data, i):\n    size = len(data)\n{body}\n    return out, i\n"
    scope: dict[str, Any] = {
        "_EPOCH": _EPOCH,
        "_timedelta": timedelta,
        "_DOUBLE": _DOUBLE.unpack_from,
        "_FLOAT": _FLOAT.unpack_from,
        "_Unreadable": Unreadable,
    }
    # Generated from a released schema, never from a record's bytes.
    exec(compile(source, f"<avro reader {_name(schema)}>", "exec"), scope)
    read: Reader = scope["read"]
    return read


def _name(schema: Any) -> str:
    return str(schema.get("name", "?")) if isinstance(schema, dict) else "?"


# ------------------------------------------------------------------------------- builders

Check = Callable[[Any], Any]
"""Takes the decoded value of one field, returns the model's value; raises ``ValueError``."""


def _same(v: Any) -> Any:
    """The value Avro decoded is the model's value: nothing to check."""
    return v


_SAME: Check = _same


def _plain(kind: Any) -> str | None:
    """The Avro primitive (or logical) type name of a field schema, if it is one."""
    if isinstance(kind, str):
        return kind
    if isinstance(kind, dict) and isinstance(kind.get("type"), str):
        if kind.get("logicalType"):
            return f"{kind['type']}/{kind['logicalType']}"
        if kind["type"] in ("record", "array", "map"):
            return None
        return str(kind["type"])
    return None


_PROVES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "long": (int,),
    "int": (int,),
    "boolean": (bool,),
    "double": (float,),
    "long/timestamp-micros": (datetime,),
}


class _Bound:
    """A check of numeric bounds; ``compile_checks`` inlines it."""

    def __init__(self, low: tuple[Any, bool] | None, high: tuple[Any, bool] | None, shown: str):
        self.low, self.high, self.shown = low, high, shown

    def test(self, var: str) -> str:
        """Python source true when ``var`` (not None) is outside the bounds."""
        parts = []
        if self.low is not None:
            parts.append(f"{var} {'<' if self.low[1] else '<='} {self.low[0]!r}")
        if self.high is not None:
            parts.append(f"{var} {'>' if self.high[1] else '>='} {self.high[0]!r}")
        return " or ".join(parts) or "False"

    def __call__(self, v: Any) -> Any:
        if v is None:
            return v
        low, high = self.low, self.high
        if low is not None and (v < low[0] if low[1] else v <= low[0]):
            raise ValueError(f"{v!r} is outside {self.shown}")
        if high is not None and (v > high[0] if high[1] else v >= high[0]):
            raise ValueError(f"{v!r} is outside {self.shown}")
        return v


def _bounds(metadata: list[Any]) -> Check | None:
    """A check of the numeric bounds in ``metadata``; None if it holds anything else."""
    low: tuple[Any, bool] | None = None  # (bound, inclusive)
    high: tuple[Any, bool] | None = None
    for item in metadata:
        if isinstance(item, annotated_types.Ge) and low is None:
            low = (item.ge, True)
        elif isinstance(item, annotated_types.Gt) and low is None:
            low = (item.gt, False)
        elif isinstance(item, annotated_types.Le) and high is None:
            high = (item.le, True)
        elif isinstance(item, annotated_types.Lt) and high is None:
            high = (item.lt, False)
        else:
            return None
    if any(b is not None and not isinstance(b[0], int | float) for b in (low, high)):
        return None
    return _Bound(low, high, ", ".join(repr(m) for m in metadata))


def compile_checks(what: str, checks: list[tuple[str, Check]]) -> Callable[[dict[str, Any]], None]:
    """Apply ``checks`` to a decoded record's values in place, as one generated function:
    bounds inline, other checks called; ``ValueError`` naming the field."""
    lines = ["def run(values):"]
    scope: dict[str, Any] = {}
    for i, (name, check) in enumerate(checks):
        label = f"{what}.{name}"
        if isinstance(check, _Bound):
            lines.append(f"    v = values[{name!r}]")
            lines.append(f"    if v is not None and ({check.test('v')}):")
            lines.append(f"        raise ValueError(f'{label}: {{v!r}} is outside {check.shown}')")
        else:
            scope[f"c{i}"] = check
            lines.append("    try:")
            lines.append(f"        values[{name!r}] = c{i}(values[{name!r}])")
            lines.append("    except ValueError as exc:")
            lines.append(f"        raise ValueError(f'{label}: {{exc}}') from None")
    lines.append("    return None")
    exec(compile("\n".join(lines) + "\n", f"<checks {what}>", "exec"), scope)
    run: Callable[[dict[str, Any]], None] = scope["run"]
    return run


def _checker(annotation: Any, avro: Any) -> Check | None:
    """How to turn a value decoded with Avro type ``avro`` into ``annotation``'s value,
    checking what Avro does not prove; None if this module cannot say."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            return None
        if not (isinstance(avro, list) and len(avro) == 2 and "null" in avro):
            return None
        inner = _checker(rest[0], next(b for b in avro if b != "null"))
        if inner is None or inner is _SAME:
            return inner
        return lambda v: None if v is None else inner(v)
    if origin is Literal:
        if _plain(avro) != "string" or not all(isinstance(a, str) for a in args):
            return None
        allowed = frozenset(args)
        shown = ", ".join(repr(a) for a in args)

        def literal(v: Any) -> Any:
            if v not in allowed:
                raise ValueError(f"{v!r} is not one of {shown}")
            return v

        return literal
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        if not (isinstance(avro, dict) and avro.get("type") == "record"):
            return None
        return builder(annotation, avro)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if not (isinstance(avro, dict) and avro.get("type") == "array"):
            return None
        item = _checker(args[0], avro["items"])
        if item is None:
            return None
        return lambda v: tuple(item(x) for x in v)
    if origin is dict and args == (str, str):
        if not (isinstance(avro, dict) and avro.get("type") == "map"):
            return None
        return _SAME if _plain(avro["values"]) == "string" else None
    plain = _plain(avro)
    if plain is None or annotation not in _PROVES.get(plain, ()):
        return None
    if annotation is float:

        def finite(v: Any) -> Any:
            if not math.isfinite(v):
                raise ValueError(f"{v!r} is not a finite number")
            return v

        return finite
    return _SAME


def field_checks(
    model: type[BaseModel], avro_fields: dict[str, Any], *, skip: frozenset[str] = frozenset()
) -> list[tuple[str, Check]] | None:
    """Per field of ``model`` (but ``skip``), how to check its decoded value; None if any
    field is beyond this module (then the model is validated by pydantic)."""
    decorators = model.__pydantic_decorators__
    if (
        decorators.model_validators
        or decorators.field_validators
        or decorators.root_validators
        or decorators.validators
    ):
        return None
    fields = {n: f for n, f in model.model_fields.items() if n not in skip}
    if set(avro_fields) - skip != set(fields):
        return None
    checks: list[tuple[str, Check]] = []
    for name, info in fields.items():
        check = _checker(info.annotation, avro_fields[name])
        if check is None:
            return None
        if info.metadata:
            bound = _bounds(info.metadata)
            if bound is None:
                return None
            check = bound if check is _SAME else (lambda c, b: lambda v: b(c(v)))(check, bound)
        if check is not _SAME:
            checks.append((name, check))
    return checks


def constructor(
    model: type[BaseModel], avro_order: list[str]
) -> Callable[[dict[str, Any]], Any] | None:
    """What ``model.model_construct(**values)`` does for a dict holding exactly the model's
    fields (in ``avro_order``), without its per-field alias and default lookups; None for a
    model that needs them (aliases, private attributes, post-init, extra fields kept)."""
    fields = model.model_fields
    if (
        any(f.alias is not None or f.validation_alias is not None for f in fields.values())
        or model.__pydantic_post_init__
        or model.__private_attributes__
        or model.__pydantic_root_model__
        or model.model_config.get("extra") == "allow"
    ):
        return None
    # One set for every instance: it names all the fields, so pydantic's only change to it
    # (adding an assigned field's name; copies get their own set) leaves it as it is. The
    # function is generated, like the readers and encoders: no call of this module's own
    # runs per event.
    order = list(fields)
    lines = ["def make(values):"]
    if avro_order != order:
        lines.append("    values = {" + ", ".join(f"{n!r}: values[{n!r}]" for n in order) + "}")
    lines += [
        "    m = new(model)",
        "    put(m, '__dict__', values)",
        "    put(m, '__pydantic_fields_set__', names)",
        "    put(m, '__pydantic_extra__', None)",
        "    put(m, '__pydantic_private__', None)",
        "    return m",
    ]
    scope: dict[str, Any] = {
        "new": model.__new__,
        "put": object.__setattr__,
        "model": model,
        "names": set(fields),
    }
    exec(compile("\n".join(lines) + "\n", f"<constructor {model.__name__}>", "exec"), scope)
    make: Callable[[dict[str, Any]], Any] = scope["make"]
    return make


def builder(model: type[BaseModel], record: Any) -> Check | None:
    """``model`` from a decoded record of Avro schema ``record``, or None (use pydantic).

    The decoded dict is the reader's own fresh value: it is checked in place and becomes
    the model's field values, without a copy."""
    checks = field_checks(model, {f["name"]: f["type"] for f in record["fields"]})
    make = constructor(model, [f["name"] for f in record["fields"]])
    if checks is None or make is None:
        return None
    if not checks:
        return make
    run = compile_checks(model.__name__, checks)

    def build(values: Any) -> Any:
        run(values)
        return make(values)

    return build


# ------------------------------ encoders: an Event straight into Avro binary
#
# Avro binary encoders compiled from a writer schema: the writer's per-event encoding.
#
# fastavro's writer takes a dict (so the event's payload is dumped into one first) and walks
# the schema for every record it writes: a lookup and a type dispatch per field, a
# validation pass per union. A writer only ever encodes its types' current schemas, so each
# is compiled once into straight-line Python that reads the ``Event`` and its payload model
# by attribute and appends to one ``bytearray``. Only what our schemas use is compiled
# (records, string, bytes, long, int, boolean, double, ``timestamp-micros``, arrays, maps,
# unions with null, and a content field's union of string and ``runlog.Sealed``, chosen by the
# value's type); a schema with anything else gets no encoder, and ``codec.encode`` uses fastavro.
#
# A compiled encoder raises on any value it does not take exactly as its schema says (a
# wrong type, an int out of range, a missing attribute); ``codec.encode`` then encodes the
# event's dict with fastavro, whose error (or output) stands.
# ``tests/schemas/test_compiled_encoder.py`` checks the two write the same bytes for events
# of every released schema.

Encoder = Callable[[Any, bytearray], None]
"""Appends the Avro encoding of an object to the buffer, or raises: the object holds each
field of a record as an attribute of the field's name (an ``Event``, its payload model)."""

_INT_MIN, _INT_MAX = -(2**31), 2**31 - 1
_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1


class Unsupported(Exception):
    """The schema uses something the compiler does not compile."""


_PRIMITIVES = frozenset({"string", "bytes", "long", "int", "boolean", "double"})


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
            getattr(self, f"enc_{schema}")(expr, depth)
            return
        if isinstance(schema, list):
            self.union(schema, expr, depth)
            return
        kind = schema.get("type")
        logical = schema.get("logicalType")
        if logical is not None:
            if logical == "timestamp-micros" and kind == "long":
                self.enc_timestamp_micros(expr, depth)
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

    # The primitives, inline: each checks its value's type exactly (and an int's range) and
    # appends its encoding; a value of another type raises ``TypeError``.

    def _fail(self, depth: int, what: str, expr: str) -> None:
        self.emit(depth, f"raise TypeError('not an Avro {what}: %r' % ({expr},))")

    def varint(self, expr: str, depth: int) -> None:
        """A zig-zag varint of the int ``expr`` (a variable), already range-checked: one
        byte for 0..63 (most counters, lengths and versions)."""
        z = self.var("z")
        self.emit(depth, f"if 0 <= {expr} < 64:")
        self.emit(depth + 1, f"out.append({expr} << 1)")
        self.emit(depth, "else:")
        self.emit(depth + 1, f"{z} = ({expr} << 1) ^ ({expr} >> 63)")
        self.emit(depth + 1, f"while {z} > 0x7F:")
        self.emit(depth + 2, f"out.append(({z} & 0x7F) | 0x80)")
        self.emit(depth + 2, f"{z} >>= 7")
        self.emit(depth + 1, f"out.append({z})")

    def length(self, expr: str, depth: int) -> None:
        n = self.var("n")
        self.emit(depth, f"{n} = {expr}")
        self.varint(n, depth)

    def enc_long(self, expr: str, depth: int, low: int = _LONG_MIN, high: int = _LONG_MAX) -> None:
        self.emit(depth, f"if type({expr}) is not int or not {low} <= {expr} <= {high}:")
        self._fail(depth + 1, "long" if low == _LONG_MIN else "int", expr)
        self.varint(expr, depth)

    def enc_int(self, expr: str, depth: int) -> None:
        self.enc_long(expr, depth, _INT_MIN, _INT_MAX)  # the same zig-zag varint, narrower

    def enc_string(self, expr: str, depth: int) -> None:
        b = self.var("b")
        self.emit(depth, f"if type({expr}) is str:")
        self.emit(depth + 1, f"{b} = {expr}.encode()")
        self.emit(depth, f"elif isinstance({expr}, str):")  # a str enum (EventType): its value
        self.emit(depth + 1, f"{b} = str.encode({expr})")
        self.emit(depth, "else:")
        self._fail(depth + 1, "string", expr)
        self.length(f"len({b})", depth)
        self.emit(depth, f"out += {b}")

    def enc_bytes(self, expr: str, depth: int) -> None:
        self.emit(depth, f"if type({expr}) is not bytes:")
        self._fail(depth + 1, "bytes", expr)
        self.length(f"len({expr})", depth)
        self.emit(depth, f"out += {expr}")

    def enc_boolean(self, expr: str, depth: int) -> None:
        self.emit(depth, f"if type({expr}) is not bool:")
        self._fail(depth + 1, "boolean", expr)
        self.emit(depth, f"out.append(1 if {expr} else 0)")

    def enc_double(self, expr: str, depth: int) -> None:
        self.emit(depth, f"if type({expr}) is not float:")
        self._fail(depth + 1, "double", expr)
        self.emit(depth, f"out += pack_double({expr})")

    def enc_timestamp_micros(self, expr: str, depth: int) -> None:
        """An aware datetime (or an int of microseconds); a naive one raises: fastavro
        reads it in local time, and is left to."""
        n, d = self.var("t"), self.var("d")
        self.emit(depth, f"if type({expr}) is datetime and {expr}.tzinfo is not None:")
        self.emit(depth + 1, f"{d} = {expr} - EPOCH")
        self.emit(
            depth + 1, f"{n} = ({d}.days * 86400 + {d}.seconds) * 1_000_000 + {d}.microseconds"
        )
        self.emit(depth, f"elif type({expr}) is int:")
        self.emit(depth + 1, f"{n} = {expr}")
        self.emit(depth, "else:")
        self._fail(depth + 1, "timestamp (an aware datetime)", expr)
        self.enc_long(n, depth)

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
                self.enc_string(expr, depth + 1)
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
        self.length(f"len({expr})", depth + 1)
        item = self.var("i")
        if is_map:
            key = self.var("k")
            self.emit(depth + 1, f"for {key}, {item} in {expr}.items():")
            self.enc_string(key, depth + 2)
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
        "pack_double": _DOUBLE.pack,
        "datetime": datetime,
        "EPOCH": _EPOCH,
    }
    exec(compile(source, f"<avro encoder {parsed.get('name')}>", "exec"), namespace)
    encoder: Encoder = namespace["encode"]
    return encoder


def _is_sealed(branch: Any) -> bool:
    return branch == SEALED_NAME or (isinstance(branch, dict) and branch.get("name") == SEALED_NAME)
