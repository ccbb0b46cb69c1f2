"""The released Avro schemas (``runlog.schemas._registry``): what writers emit and how a
record names its schema.

* The registry holds exactly the shipped files ``schemas/avro/<event_type>/v<N>.avsc``,
  each type's versions 1..N without a gap; a type's writer schema is its highest version,
  and every released version is still found by type and version.
* A record names its writer schema by fingerprint: the CRC-64-AVRO (Avro specification)
  of the schema's parsing canonical form, as its 8 little-endian bytes (single-object
  encoding's byte order); documentation and defaults do not change it, and no two released
  schemas share one.
* Every version of a type keeps the record's full name, so Avro resolution applies between
  them (docs/concepts/schema-evolution.md).

Released files never changing, and the current version of each type:
tests/schemas/test_evolution.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import fastavro
import fastavro.schema

import runlog.schemas
from runlog.schemas import _registry
from runlog.schemas._registry import fingerprint_of, registry
from runlog.schemas._vocabulary import EventType

AVRO = Path(runlog.schemas.__file__).parent / "avro"

# CRC-64-AVRO exactly as the Avro specification writes it ("Schema Fingerprints").
EMPTY = 0xC15D213AA4D7A795


def _table() -> list[int]:
    table = []
    for i in range(256):
        fp = i
        for _ in range(8):
            fp = (fp >> 1) ^ (EMPTY & -(fp & 1))
        table.append(fp & 0xFFFFFFFFFFFFFFFF)
    return table


TABLE = _table()


def crc64_avro(data: bytes) -> int:
    fp = EMPTY
    for byte in data:
        fp = (fp >> 8) ^ TABLE[(fp ^ byte) & 0xFF]
    return fp


def _shipped() -> dict[tuple[EventType, int], Any]:
    """(type, version) -> the file's JSON, read from the tree on its own."""
    return {
        (EventType(f.parent.name), int(f.stem[1:])): json.loads(f.read_text())
        for f in AVRO.glob("*/v*.avsc")
    }


def test_the_registry_holds_exactly_the_shipped_files() -> None:
    shipped = _shipped()
    reg = registry()
    assert reg.by_type_version.keys() == shipped.keys()
    for (et, version), raw in shipped.items():
        ws = reg.by_type_version[(et, version)]
        assert (ws.event_type, ws.version) == (et, version)
        assert ws.fingerprint == fingerprint_of(fastavro.parse_schema(raw))


def test_each_type_writes_its_highest_version_and_keeps_every_older_one() -> None:
    reg = registry()
    versions: dict[EventType, set[int]] = {}
    for et, version in _shipped():
        versions.setdefault(et, set()).add(version)
    assert versions.keys() == set(EventType)  # every type has a schema
    for et, held in versions.items():
        top = max(held)
        assert held == set(range(1, top + 1)), f"{et.value}: a gap in {sorted(held)}"
        assert reg.current[et] == top
        assert reg.writer(et) is reg.by_type_version[(et, top)]
        assert reg.writer(et).version == top
        for v in held:
            assert reg.writer(et, v).version == v and reg.writer(et, v).event_type is et


def test_every_released_schema_is_found_by_its_own_fingerprint() -> None:
    reg = registry()
    schemas = list(reg.by_type_version.values())
    assert len({ws.fingerprint for ws in schemas}) == len(schemas)
    for ws in schemas:
        assert len(ws.fingerprint) == 8
        assert reg.by_fingerprint[ws.fingerprint] is ws


def test_the_fingerprint_is_crc64_avro_of_the_canonical_form_little_endian() -> None:
    documented = {
        "type": "record",
        "name": "Ping",
        "namespace": "test.ns",
        "doc": "a record",
        "fields": [
            {"name": "n", "type": "long", "doc": "a count", "default": 0},
            {"name": "s", "type": ["null", "string"], "default": None},
        ],
    }
    canonical = (
        '{"name":"test.ns.Ping","type":"record","fields":'
        '[{"name":"n","type":"long"},{"name":"s","type":["null","string"]}]}'
    )
    expected = crc64_avro(canonical.encode()).to_bytes(8, "little")
    assert fingerprint_of(fastavro.parse_schema(documented)) == expected
    bare = {**documented, "doc": "another text"}
    assert fingerprint_of(fastavro.parse_schema(bare)) == expected
    changed = {**documented, "fields": [{"name": "n", "type": "int"}]}
    assert fingerprint_of(fastavro.parse_schema(changed)) != expected
    # And so for every released schema.
    for ws in registry().by_type_version.values():
        form = fastavro.schema.to_parsing_canonical_form(ws.parsed)
        assert ws.fingerprint == crc64_avro(form.encode()).to_bytes(8, "little")


def test_every_version_of_a_type_keeps_its_record_name() -> None:
    names: dict[EventType, set[str]] = {}
    for (et, _), raw in _shipped().items():
        names.setdefault(et, set()).add(f"{raw['namespace']}.{raw['name']}")
    for et, held in names.items():
        assert len(held) == 1, f"{et.value}: record renamed across versions: {sorted(held)}"


def test_threads_asking_for_the_registry_at_once_load_it_once(monkeypatch: Any) -> None:
    """A burst of opens at a worker's start asks for the registry from many threads before
    it is loaded. One of them loads it (each schema's encoder compiled once) and all get
    that one registry: a load per thread held the interpreter's lock in ``compile`` for
    seconds, and the process's liveness renewal with it."""
    compiled: list[str] = []
    real = _registry.compile_encoder

    def counting(parsed: Any) -> Any:
        compiled.append(parsed["name"])
        return real(parsed)

    monkeypatch.setattr(_registry, "compile_encoder", counting)
    monkeypatch.setattr(_registry, "_LOADED", [])
    threads, gate, got = 16, threading.Barrier(16), []

    def ask() -> None:
        gate.wait()
        got.append(registry())

    workers = [threading.Thread(target=ask) for _ in range(threads)]
    registry.cache_clear()
    try:
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        registry.cache_clear()  # the process's own registry again (restored with _LOADED)
    assert len(got) == threads and all(r is got[0] for r in got)
    assert len(compiled) == len(got[0].by_fingerprint)
