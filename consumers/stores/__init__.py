"""The registry of projections: the store iterates it, one line registers a projection.

A projection is one module here: its name, its pure fold (``projections/``) and its store
half (a ``store.Handler``), declared together as ``PROJECTION``. Adding one is that module
plus its line below.
"""

from __future__ import annotations

import json
import time
from typing import Any

import redis

from runlog._settings import Settings
from runlog.consumers._store import RUN_STATE, Handler, Projection, ProjectionKeys
from runlog.consumers.stores import _audit as audit
from runlog.consumers.stores import _notify as notify
from runlog.consumers.stores import _state as state
from runlog.consumers.stores import _uncertain as uncertain
from runlog.schemas._signing import NO_AUTHORITY, DecisionAuthority

REGISTRY: dict[str, Projection] = {
    p.name: p
    for p in (
        state.PROJECTION,
        uncertain.PROJECTION,
        audit.PROJECTION,
        notify.PROJECTION,
    )
}
"""Every projection by name, in the order ``runlog project all`` runs them."""

PROJECTIONS = tuple(name for name, p in REGISTRY.items() if p.in_all)
"""The projections ``runlog project all`` runs."""
NOTIFY = notify.NAME
"""The notification projection: runs on its own (``runlog project notify``), with a hook."""
KNOWN = tuple(REGISTRY)


def make_handler(
    name: str, prefix: str, topic: str, authority: DecisionAuthority = NO_AUTHORITY
) -> Handler[Any]:
    projection = REGISTRY.get(name)
    if projection is None:
        raise ValueError(f"unknown projection {name!r}; expected one of {', '.join(KNOWN)}")
    return projection.handler(ProjectionKeys(prefix, name, topic), authority)


# ------------------------------------------------------------------ erasure's progress


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


def unpurged(client: redis.Redis, settings: Settings, partition: int, run_id: str) -> list[str]:
    """The projections that keep ``run_id`` and have not folded its erasure yet (each stores
    the run's state as erased once it did; one that never stored the run has no copy)."""
    out = []
    for name in REGISTRY:
        keys = ProjectionKeys(settings.redis_key_prefix, name, settings.events_topic)
        raw = _text(client.get(keys.run(partition, run_id)))
        if raw is not None and json.loads(raw).get(RUN_STATE, {}).get("erased") is None:
            out.append(name)
    return out


def purged(client: redis.Redis, settings: Settings, partition: int, run_id: str) -> bool:
    """Whether every projection that keeps ``run_id`` has folded its erasure."""
    return not unpurged(client, settings, partition, run_id)


def wait_purged(
    client: redis.Redis, settings: Settings, runs: list[tuple[int, str]], wait_s: float
) -> list[str]:
    """Wait up to ``wait_s`` until every projection folded the erasure of each of ``runs``
    (partition, run id); the projections that had not when it ended (empty: all purged; a
    runner that is down or behind purges when it folds the record, and rewrites Redis's
    files then)."""
    deadline = time.monotonic() + wait_s
    left = list(runs)
    while True:
        behind = {(p, rid): unpurged(client, settings, p, rid) for p, rid in left}
        left = [run for run, names in behind.items() if names]
        if not left or time.monotonic() >= deadline:
            return sorted({n for names in behind.values() for n in names})
        time.sleep(0.1)
