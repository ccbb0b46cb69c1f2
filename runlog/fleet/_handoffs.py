"""The list a draining worker announces its runs on, so that another takes them at once.

A drained worker's partitions reach the others only once the group has rebalanced (the
others learn of it at their next heartbeat, then read the partitions' records), and a
handed-over run's ``open`` record is written after its lease is released. Instead, each
run the drainer lets go (and each durable sleep of its partitions about to end) is pushed
on ``handoffs_key`` the moment its lease is free; every live worker blocks on that list
(``BLPOP``, one command a second when idle) and dispatches what it pops. The lease still
decides who runs each: an announcement only says "try now".

When its drain begins, the worker also says which runs are coming (``announce_coming``, one
entry per partition on ``coming_key``): the worker that pops it reads each partition once
for them while their last steps run (``Prefetch``), so that when the handovers come in a
burst their claims replay from that pass, read on to the partition's end, and not from a
pass of their own each.
"""

from __future__ import annotations

import logging

import redis

from runlog._settings import Settings
from runlog.fleet._lifecycle import Record
from runlog.log._clients import REDIS_ERRORS

log = logging.getLogger(__name__)

TTL_MS = 60_000
"""How long an announcement nobody popped is kept (the partitions' owners have the runs by
then through the lifecycle records)."""


def handoffs_key(settings: Settings) -> str:
    return f"{settings.redis_key_prefix}:handoffs"


def announce(client: redis.Redis, settings: Settings, runs: list[tuple[str, Record]]) -> None:
    """Push ``runs`` (run id, a record without input: ``open`` or ``waiting_until``) for the
    live workers. Best effort: the lifecycle records still reach the partitions' owners."""
    if not runs:
        return
    for _, rec in runs:
        if rec.input_json is not None or rec.input_sealed is not None:
            raise ValueError("a start request is never announced: it moves with its partition")
    key = handoffs_key(settings)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.rpush(key, *[rid.encode() + b"\0" + rec.encode() for rid, rec in runs])
        pipe.pexpire(key, TTL_MS)
        pipe.execute()
    except REDIS_ERRORS as exc:
        log.warning("could not announce %d runs handed over: %s", len(runs), exc)


def coming_key(settings: Settings) -> str:
    return f"{settings.redis_key_prefix}:handoffs:coming"


def announce_coming(
    client: redis.Redis, settings: Settings, runs: dict[int, dict[str, str]]
) -> None:
    """Push the runs a drain is about to hand over (partition -> run id -> tenant), one
    entry per partition. Best effort: without it, each handover's claim reads for itself."""
    entries = [
        str(p).encode() + b"\0" + "\n".join(f"{rid}\t{t}" for rid, t in group.items()).encode()
        for p, group in runs.items()
        if group
    ]
    if not entries:
        return
    key = coming_key(settings)
    try:
        pipe = client.pipeline(transaction=False)
        pipe.rpush(key, *entries)
        pipe.pexpire(key, TTL_MS)
        pipe.execute()
    except REDIS_ERRORS as exc:
        log.warning("could not announce %d runs about to be handed over: %s", len(runs), exc)


def parse_coming(raw: bytes) -> tuple[int, dict[str, str]]:
    """An ``announce_coming`` entry's partition and runs (run id -> tenant); ``ValueError``
    if it is not one."""
    part, sep, body = raw.partition(b"\0")
    if not sep:
        raise ValueError("not an announcement of runs coming")
    runs: dict[str, str] = {}
    for line in body.decode().split("\n"):
        rid, tab, tenant = line.partition("\t")
        if not tab or not rid:
            raise ValueError("not an announcement of runs coming")
        runs[rid] = tenant
    return int(part), runs


def parse(raw: bytes) -> tuple[str, Record]:
    """An announcement's run id and record (``ValueError`` if it is not one)."""
    rid, sep, value = raw.partition(b"\0")
    if not sep:
        raise ValueError("not a handoff announcement")
    return rid.decode(), Record.decode(value)
