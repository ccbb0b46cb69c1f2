"""Every released Avro schema, by fingerprint, plus the evolution rules between versions.

Files live at ``schemas/avro/<event_type>/v<N>.avsc``. A released file never changes:
its fingerprint is written into every record encoded with it.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

import fastavro
import fastavro.schema

from runlog.schemas._compiled import Encoder, compile_encoder
from runlog.schemas._vocabulary import EventType


@dataclass(frozen=True)
class WriterSchema:
    event_type: EventType
    version: int
    fingerprint: bytes
    """CRC-64-AVRO of the parsing canonical form, as the 8 little-endian bytes on the wire."""
    parsed: Any
    """The fastavro-parsed schema."""
    encoder: Encoder | None = field(default=None, compare=False, repr=False)
    """Its compiled encoder (``compiled.compile_encoder``), None where fastavro encodes it."""


def fingerprint_of(schema: Any) -> bytes:
    canonical = fastavro.schema.to_parsing_canonical_form(schema)
    # fastavro renders the 64-bit CRC as the hex of its little-endian bytes, which is
    # exactly the byte order single-object encoding puts on the wire.
    return bytes.fromhex(fastavro.schema.fingerprint(canonical, "CRC-64-AVRO"))


@dataclass(frozen=True)
class Registry:
    by_fingerprint: dict[bytes, WriterSchema]
    by_type_version: dict[tuple[EventType, int], WriterSchema]
    current: dict[EventType, int]
    writers: dict[EventType, WriterSchema] = field(default_factory=dict)
    """Each type's current schema: the one writers emit (a lookup on every append)."""

    def __post_init__(self) -> None:
        self.writers.update((et, self.by_type_version[(et, v)]) for et, v in self.current.items())

    def writer(self, event_type: EventType, version: int | None = None) -> WriterSchema:
        """The writer schema of ``event_type`` at ``version`` (None: its current one);
        ``KeyError`` naming both for a version that was never released."""
        if version is None:
            return self.writers[event_type]
        found = self.by_type_version.get((event_type, version))
        if found is None:
            raise KeyError(
                f"{event_type.value} has no released schema v{version} "
                f"(released: v1 to v{self.current[event_type]})"
            )
        return found


@cache
def released() -> list[tuple[EventType, int, Any]]:
    """Every released ``.avsc`` as ``(type, version, parsed JSON)``, read once."""
    root = resources.files("runlog.schemas").joinpath("avro")
    found: list[tuple[EventType, int, Any]] = []
    for type_dir in root.iterdir():
        if not type_dir.is_dir():
            continue
        et = EventType(type_dir.name)
        for f in type_dir.iterdir():
            if f.name.startswith("v") and f.name.endswith(".avsc"):
                version = int(f.name[1:-5])
                found.append((et, version, json.loads(f.read_text())))
    return found


_LOADING = threading.Lock()
_LOADED: list[Registry] = []


@cache
def registry() -> Registry:
    """All schemas shipped with this release; loaded once, on first use, by one thread.

    ``functools.cache`` alone lets every thread that calls it before the first call returns
    build the whole registry too: a burst of opens at a worker's start (64 threads)
    compiled every schema's encoder 64 times over, holding the interpreter's lock in
    ``compile`` long enough that the process's liveness renewal was late by seconds and
    its session, with every lease bound to it, was lost. Those callers wait for one load
    here; the cache then answers every later call (an append asks once per event)."""
    with _LOADING:
        if not _LOADED:
            _LOADED.append(_load())
        return _LOADED[0]


def _load() -> Registry:
    by_fp: dict[bytes, WriterSchema] = {}
    by_tv: dict[tuple[EventType, int], WriterSchema] = {}
    current: dict[EventType, int] = {}
    for et, version, raw in released():
        parsed = fastavro.parse_schema(raw)
        ws = WriterSchema(et, version, fingerprint_of(parsed), parsed, compile_encoder(parsed))
        by_fp[ws.fingerprint] = ws
        by_tv[(et, version)] = ws
        current[et] = max(current.get(et, 0), version)
    missing = set(EventType) - set(current)
    if missing:  # pragma: no cover - a packaging error, not a runtime condition
        raise RuntimeError(f"no schema shipped for {sorted(m.value for m in missing)}")
    for et, top in current.items():
        for v in range(1, top + 1):
            if (et, v) not in by_tv:  # pragma: no cover
                raise RuntimeError(f"{et.value}: version {v} is missing below v{top}")
    return Registry(by_fp, by_tv, current)
