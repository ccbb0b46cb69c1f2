"""Sealed content fields: which fields of which events carry content, and their envelope.

Content (what users said, what tools returned, what the model wrote) is what a data subject
may ask to have forgotten; structure (ids, types, seq, epoch, keys, timestamps, outcome,
risk) is what ownership, ordering, fencing and the audit need. From the sealed schema
versions on, every content field is an Avro union of ``string`` (plaintext: encryption
off, or a record written before it) and the named record ``runlog.Sealed``::

    {"type": "record", "name": "Sealed", "namespace": "runlog",
     "fields": [{"name": "key_id", "type": "string"},
                {"name": "nonce", "type": "bytes"},
                {"name": "ciphertext", "type": "bytes"}]}

``ciphertext`` is AES-256-GCM of the field's UTF-8 text (tag appended) under the data key
``key_id`` names, with ``nonce`` (12 bytes) and the associated data ``aad(run_id, seq,
field)``: a sealed value moved to another run, event or field does not open.

This module is pure: the codec takes a ``Sealer`` (writers) or an ``Opener`` (readers) as a
parameter; the keys live in the log layer (``runlog.log._keys``). The in-memory ``Event``
always holds plaintext ``str``; a field whose key was shredded decodes to ``ERASED``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from runlog.errors import NoKeys
from runlog.schemas._models import ERASED as ERASED  # the fold's marker, re-exported
from runlog.schemas._models import data_subject
from runlog.schemas._vocabulary import EventType

SEALED_NAME = "runlog.Sealed"
"""The Avro full name of the envelope record."""

SEALED_SCHEMA: dict[str, Any] = {
    "type": "record",
    "name": "Sealed",
    "namespace": "runlog",
    "doc": (
        "A content field sealed with AES-256-GCM under the data key key_id names; associated "
        "data: run_id, seq and the field's path, NUL-separated (runlog.schemas._sealing.aad)."
    ),
    "fields": [
        {"name": "key_id", "type": "string"},
        {"name": "nonce", "type": "bytes"},
        {"name": "ciphertext", "type": "bytes"},
    ],
}

E = EventType

SEALED_FIELDS: dict[EventType, tuple[str, ...]] = {
    E.RUN_STARTED: ("goal", "input_json"),
    E.USER_MESSAGE: ("content",),
    E.MODEL_TURN: ("text", "response_json", "tool_calls[].args_json"),
    E.TOOL_CALL_DENIED: ("args_json", "reason"),
    E.TOOL_CALL_STARTED: ("args_json",),
    E.TOOL_CALL_COMPLETED: ("content",),
    E.TOOL_CALL_UNCERTAIN: ("error",),
    E.RECONCILIATION_ATTEMPTED: ("evidence",),
    E.APPROVAL_REQUESTED: ("reason", "args_json", "last_error", "detail"),
    E.GUARDRAIL_TRIGGERED: ("detail",),
    E.CONTEXT_COMPACTED: ("summary",),
    E.MEMORY_WRITTEN: ("value",),
    E.RUN_FINISHED: ("summary",),
    E.RUN_CANCEL_REQUESTED: ("reason",),
    E.RUN_FORKED: (
        "reason",
        "state",
        "goal",
        "input_json",
        "parent_effects[].args_json",
        "parent_effects[].content",
    ),
    E.FORK_EFFECT_RESOLVED: ("args_json", "content"),
}
"""Every content field, written once: ``name`` (a payload field) or ``list[].name`` (that
field of every item of a payload array). Deliberately clear: ``approval_decided.note`` (a
decider's signature covers it: sealing it would make an erased decision look forged; a
decider must not write personal data there) and every id, name, key, seq, epoch,
timestamp, outcome and risk. ``run_forked.state`` (the parent's packed state: its messages
and tool results) is sealed from RUN_FORKED v3 on, as one field, under the fork's subject,
which is its parent's (``run_forked.subject``)."""

SEALED_SINCE: dict[EventType, int] = {
    E.RUN_STARTED: 3,
    E.USER_MESSAGE: 2,
    E.MODEL_TURN: 3,
    E.TOOL_CALL_DENIED: 2,
    E.TOOL_CALL_STARTED: 3,
    E.TOOL_CALL_COMPLETED: 3,
    E.TOOL_CALL_UNCERTAIN: 2,
    E.RECONCILIATION_ATTEMPTED: 2,
    E.APPROVAL_REQUESTED: 3,
    E.GUARDRAIL_TRIGGERED: 2,
    E.CONTEXT_COMPACTED: 3,
    E.MEMORY_WRITTEN: 2,
    E.RUN_FINISHED: 2,
    E.RUN_CANCEL_REQUESTED: 2,
    E.RUN_FORKED: 2,
    E.FORK_EFFECT_RESOLVED: 2,
}
"""The first schema version of each type whose content fields may be sealed."""


class Sealed(NamedTuple):
    """One sealed value, as the encoder writes the ``runlog.Sealed`` record."""

    key_id: str
    nonce: bytes
    ciphertext: bytes


class Sealer(Protocol):
    """Seals a run's content under its subject's data key (a writer's side)."""

    def seal(self, plaintext: str, aad: bytes) -> Sealed: ...


class Opener(Protocol):
    """Opens sealed values (a reader's side)."""

    def open(self, key_id: str, nonce: bytes, ciphertext: bytes, aad: bytes) -> str | None:
        """The plaintext; None when the key was destroyed (the value is then ``ERASED``);
        raises ``ValueError`` when the value does not authenticate under its key."""
        ...


class NoKeyOpener:
    """The opener of a reader that has no key store (encryption was off when it started, or
    no KEK is configured): every sealed value reads as ``ERASED``, as for a run whose key was
    destroyed. Such a reader folds a sealed run's structure and keeps going, where raising
    ``NoKeys`` would stop it for every other run as well. ``asked`` tells it that a record
    held sealed content (one opener per record), not content that was erased."""

    def __init__(self) -> None:
        self.asked = False

    def open(self, key_id: str, nonce: bytes, ciphertext: bytes, aad: bytes) -> str | None:
        self.asked = True
        return None


NO_KEY_OPENER = NoKeyOpener()
"""One shared by readers that do not ask whether a record was sealed."""


def aad(run_id: str, seq: int, path: str) -> bytes:
    """Associated data of one sealed field: run, seq and the field's path (with the item's
    index inside an array: ``tool_calls[2].args_json``)."""
    return f"{run_id}\x00{seq}\x00{path}".encode()


def top_level(paths: tuple[str, ...]) -> bool:
    """Whether every one of ``paths`` names a payload field itself (no ``list[].name``)."""
    return all(_split(path)[1] is None for path in paths)


def _split(path: str) -> tuple[str, str | None]:
    if "[]." in path:
        outer, inner = path.split("[].", 1)
        return outer, inner
    return path, None


class View:
    """An object read by attribute (what the compiled encoder does) as ``base`` (a pydantic
    model: its fields are its ``__dict__``) with some attributes replaced: a sealed payload
    without copying or validating the model."""

    def __init__(self, base: Any, over: dict[str, Any]) -> None:
        self.__dict__.update(base.__dict__)
        self.__dict__.update(over)


def seal_payload(
    payload: Any, paths: tuple[str, ...], sealer: Sealer, run_id: str, seq: int
) -> Any:
    """The payload as the compiled encoder reads it, every content field that holds text
    replaced by its ``Sealed`` value (None and empty text stay: they carry nothing)."""
    update: dict[str, Any] = {}
    nested: dict[str, dict[str, str]] = {}
    for path in paths:
        outer, inner = _split(path)
        if inner is None:
            value = getattr(payload, outer)
            if value:
                update[outer] = sealer.seal(value, aad(run_id, seq, outer))
        else:
            nested.setdefault(outer, {})[inner] = path
    for outer, inners in nested.items():
        items = getattr(payload, outer)
        if not items:
            continue
        sealed_items = []
        for k, item in enumerate(items):
            sub: dict[str, Any] = {}
            for inner in inners:
                value = getattr(item, inner)
                if value:
                    sub[inner] = sealer.seal(value, aad(run_id, seq, f"{outer}[{k}].{inner}"))
            sealed_items.append(View(item, sub) if sub else item)
        update[outer] = tuple(sealed_items)
    return View(payload, update) if update else payload


def seal_record(
    payload: dict[str, Any], paths: tuple[str, ...], sealer: Sealer, run_id: str, seq: int
) -> None:
    """``seal_payload`` on the dict fastavro writes, in place (sealed values as dicts)."""

    def put(d: dict[str, Any], name: str, path: str) -> None:
        value = d.get(name)
        if isinstance(value, str) and value:
            d[name] = sealer.seal(value, aad(run_id, seq, path))._asdict()

    for path in paths:
        outer, inner = _split(path)
        if inner is None:
            put(payload, outer, outer)
        else:
            for k, item in enumerate(payload.get(outer) or ()):
                put(item, inner, f"{outer}[{k}].{inner}")


def open_record(
    payload: dict[str, Any], paths: tuple[str, ...], opener: Opener | None, run_id: str, seq: int
) -> bool:
    """Open every sealed value of a decoded payload dict, in place; True if one was erased.

    Raises ``NoKeys`` (no ``opener``) or ``ValueError`` (does not authenticate).
    """
    erased = False

    def take(d: dict[str, Any], name: str, path: str) -> None:
        nonlocal erased
        value = d.get(name)
        if not isinstance(value, dict):
            return
        if opener is None:
            raise NoKeys(
                f"{path} is sealed under key {value.get('key_id')!r} and this reader has no "
                "keys (RUNLOG_ENCRYPTION, RUNLOG_KEK)"
            )
        text = opener.open(
            value["key_id"], value["nonce"], value["ciphertext"], aad(run_id, seq, path)
        )
        if text is None:
            erased = True
            text = ERASED
        d[name] = text

    for path in paths:
        outer, inner = _split(path)
        if inner is None:
            take(payload, outer, outer)
        else:
            for k, item in enumerate(payload.get(outer) or ()):
                take(item, inner, f"{outer}[{k}].{inner}")
    return erased


def erased_fields(event: Any) -> list[str]:
    """The content fields of a decoded ``Event`` that hold ``ERASED`` (empty: none)."""
    out: list[str] = []
    for path in SEALED_FIELDS.get(event.type, ()):
        outer, inner = _split(path)
        if inner is None:
            if getattr(event.payload, outer) == ERASED:
                out.append(outer)
        else:
            for k, item in enumerate(getattr(event.payload, outer) or ()):
                if getattr(item, inner) == ERASED:
                    out.append(f"{outer}[{k}].{inner}")
    return out


def readable_fields(event: Any) -> list[str]:
    """The content fields of a decoded ``Event`` that hold text other than ``ERASED``: after
    its subject's keys are shredded, content that was written in plaintext (encryption off,
    or a record written before it was on)."""
    out: list[str] = []
    for path in SEALED_FIELDS.get(event.type, ()):
        outer, inner = _split(path)
        if inner is None:
            value = getattr(event.payload, outer)
            if value and value != ERASED:
                out.append(outer)
        else:
            for k, item in enumerate(getattr(event.payload, outer) or ()):
                value = getattr(item, inner)
                if value and value != ERASED:
                    out.append(f"{outer}[{k}].{inner}")
    return out


def is_erased(event: Any) -> bool:
    """Whether any content field of ``event`` was erased (its subject's key destroyed)."""
    return bool(erased_fields(event))


def subject_of(payload: Any, run_id: str) -> str:
    """The data subject a run's content is sealed for (``models.data_subject``)."""
    return data_subject(run_id, payload)


def _is_sealed_branch(branch: Any) -> bool:
    return branch == SEALED_NAME or (isinstance(branch, dict) and branch.get("name") == SEALED_NAME)


def plain_view(schema: Any) -> Any:
    """``schema`` (fastavro-parsed) with every ``runlog.Sealed`` branch of a union removed:
    the shape of a record once its sealed values are opened (what the payload models read)."""
    if isinstance(schema, list):
        rest = [plain_view(b) for b in schema if not _is_sealed_branch(b)]
        return rest[0] if len(rest) == 1 else rest
    if isinstance(schema, dict):
        kind = schema.get("type")
        if kind == "record":
            fields = [{**f, "type": plain_view(f["type"])} for f in schema["fields"]]
            return {**schema, "fields": fields}
        if kind == "array":
            return {**schema, "items": plain_view(schema["items"])}
        if kind == "map":
            return {**schema, "values": plain_view(schema["values"])}
    return schema
