"""7. The two encodings side by side: single-object (no server) and Confluent's wire format.

* CPU per event to encode and to decode, in process (schema ids cached, as in a writer);
  and ``sealed``: single-object with encryption on (``RUNLOG_ENCRYPTION=on``), its content
  fields sealed with the run's data key on encode and opened on decode (the key made and
  cached first, as a writer and a fold hold it): the difference to ``single_object`` is
  what encryption adds per event (target: <= 15 us on each side);
* durable append latency, ``Run.append`` p50/p99, with the registry-configured writer
  against the default one, when a registry answers (``RUNLOG_SCHEMA_REGISTRY_URL`` or the
  stack's own, ``runlog stack up --registry``).
"""

from __future__ import annotations

import base64
import dataclasses
import os
import tempfile
import time
import uuid
from typing import Any

from runlog import stack
from runlog._settings import Settings
from runlog.log._keys import FileKeyStore, Keks
from runlog.log._registry import RegistryIds
from runlog.producers._engine import RunDeps
from runlog.schemas import _codec as codec
from runlog.schemas._registry import WriterSchema, registry
from runlog.stack import _registry as stack_registry
from tools.benchmarks.common import make_events, percentile, summary, timed_appends


class _LocalIds:
    """Ids from a table: the cost of the framing alone, with no registry involved."""

    def __init__(self) -> None:
        self.by_id = dict(enumerate(registry().by_type_version.values(), 1))
        self.ids = {(ws.event_type, ws.version): i for i, ws in self.by_id.items()}

    def id_for(self, schema: WriterSchema) -> int:
        return self.ids[(schema.event_type, schema.version)]

    def schema_for(self, schema_id: int) -> WriterSchema:
        return self.by_id[schema_id]


def _cpu(n: int, repeats: int) -> dict[str, Any]:
    events = make_events(f"r-bench-{uuid.uuid4().hex[:8]}", n)
    ids = _LocalIds()
    out: dict[str, Any] = {}
    for name, chosen in (("single_object", None), ("confluent", ids)):
        enc_us: list[float] = []
        dec_us: list[float] = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            blobs = [codec.encode(ev, chosen) for ev in events]
            enc_us.append((time.perf_counter() - t0) / n * 1e6)
            t0 = time.perf_counter()
            for blob in blobs:
                codec.decode(blob, chosen)
            dec_us.append((time.perf_counter() - t0) / n * 1e6)
        out[name] = {"encode_us": summary(enc_us), "decode_us": summary(dec_us)}
    with tempfile.TemporaryDirectory() as keydir:
        kek = base64.b64encode(os.urandom(32)).decode()
        store = FileKeyStore(keydir, Keks.parse(f"bench:{kek}", where="bench"), refresh_s=60)
        sealer = store.sealer(events[0].tenant, events[0].run_id)
        enc_us, dec_us = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            blobs = [codec.encode(ev, None, sealer) for ev in events]
            enc_us.append((time.perf_counter() - t0) / n * 1e6)
            t0 = time.perf_counter()
            for blob in blobs:
                codec.decode(blob, None, store)
            dec_us.append((time.perf_counter() - t0) / n * 1e6)
        out["sealed"] = {"encode_us": summary(enc_us), "decode_us": summary(dec_us)}
    # What encryption adds, repeat by repeat (the same events, the same process).
    plain = out["single_object"]
    out["encryption_adds"] = {
        key: summary(
            [
                on - off
                for on, off in zip(out["sealed"][key]["values"], plain[key]["values"], strict=True)
            ]
        )
        for key in ("encode_us", "decode_us")
    }
    return out


def _registry_url(settings: Settings) -> str | None:
    if settings.schema_registry_url:
        return settings.schema_registry_url
    return stack_registry.url_if_running(stack.StackConfig.from_env())


def measure(deps: RunDeps, settings: Settings, *, n: int, repeats: int) -> dict[str, Any]:
    out: dict[str, Any] = {"events": n, "cpu": _cpu(max(n, 500), repeats)}
    url = _registry_url(settings)
    if url is None:
        out["append"] = {"status": "not measured: no schema registry answers"}
        return out
    ids = RegistryIds(url, settings.events_topic)
    ids.register_all()
    with_registry = dataclasses.replace(deps, ids=ids)
    rows: dict[str, list[float]] = {"single_object_p50_ms": [], "confluent_p50_ms": []}
    p99: dict[str, list[float]] = {"single_object_p99_ms": [], "confluent_p99_ms": []}
    for _ in range(repeats):
        for name, chosen in (
            ("single_object", dataclasses.replace(deps, ids=None)),
            ("confluent", with_registry),
        ):
            samples = timed_appends(chosen, n)
            rows[f"{name}_p50_ms"].append(percentile(samples, 50) * 1000)
            p99[f"{name}_p99_ms"].append(percentile(samples, 99) * 1000)
    out["append"] = {k: summary(v) for k, v in {**rows, **p99}.items()}
    out["append"]["registry"] = url
    return out
