"""The projection runner: Kafka in, pure folds, one atomic Redis write per partition batch.

Exactly-once effects on an at-least-once log: Redis, not Kafka, holds each projection's
position per (topic, partition). A partition batch is applied, for all the runner's
projections at once, as

1. ``WATCH`` every projection's ``pos`` and ``gen``; read them; stop if a generation moved
   (a rebuild) or a position is below what this runner applied (below); drop, per
   projection, the records at or below its position;
2. take the batch's runs from the runner's cache (``store.Handler``), loading only those it
   does not hold; fold the records with each pure projection (a record at or below its
   run's applied offset is skipped);
3. ``MULTI`` -> what the records changed (hash fields, list appends, counters, quarantine
   records) and every ``SET pos`` -> ``EXEC``.

All these keys carry the partition's hash tag, so the transaction stays in one slot.

Effect and position commit together or not at all, so a SIGKILL at any moment loses
nothing and applies nothing twice. ``WATCH`` makes a zombie (a runner that lost the
partition in a rebalance but is still finishing a batch) harmless: if anyone moved the
position meanwhile, EXEC fails and the batch is recomputed from the new position.

On assignment every partition is seeked to ``min(position over the projections) + 1``.
Kafka offset commits are advisory (for ``kafka-consumer-groups`` lag) and never read.

A batch is written only if it continues the stored position. Redis can go back in time (a
failover to a replica that missed the last writes, an AOF that lost its last second, a
key deleted by hand): the position then names an offset below what this runner already
applied, and writing the next batch on top of it would skip the records in between for
good. The runner instead seeks back to the stored position + 1 and refolds from there;
each run's state remembers the offset of its last record (``store.APPLIED``), so records
whose effects survived are not folded twice. The same check runs every few seconds while
a partition is idle.

A rebuild fences live runners: it increments each partition's generation, and a runner
writes only while the generation it read at assignment is still current (checked in the
same transaction as the position). A fenced runner pauses its partitions until the
rebuild's marker is gone, then reads the rebuilt positions and continues from them. A
rebuild that died leaves a second marker, *incomplete* (no TTL): a runner never resumes
on that projection; the first to see it with the rebuild's own marker expired completes
the rebuild from zero (``rebuild``, in a thread beside the paused consumer).

A record that cannot be decoded, or whose key is not its event's run id, is quarantined:
produced (original key, value and headers) to the quarantine topic and acknowledged
*before* the Redis write that records it and advances the position. A crash between the
two re-quarantines it on restart: the topic is at-least-once, Redis exactly-once.
Transient Redis and broker errors are retried with capped exponential backoff; they
never turn into skipped records. Transient includes the replies of a Redis that is up but
cannot take writes now: READONLY (a replica, or a primary demoted by failover), OOM
(``maxmemory`` reached under ``noeviction``), BUSY (a long script), LOADING, MASTERDOWN,
TRYAGAIN.

The runner is composed, not inherited. ``ProjectionRunner`` (``loop``: the consumer,
``run`` and ``catch_up``, and ``rebuild`` with it) owns one of each collaborator and is
the only one that touches the consumer: a ``Retrier`` and the ``PositionStore`` (in
``batch``, beside the commit they guard: retries; positions, generations and the one
verdict of whether a stored position may be written on), the ``RebuildFence``
(``fencing``: rebuild markers, completing a rebuild that died through the refold the loop
hands it) and the ``BatchApplier`` (``batch``: decode, quarantine, fold and commit one
partition batch; it reports a refused batch and the loop refetches or pauses).
``rebuilding`` deletes and refolds a projection, live runners fenced, with the runner it is
given: it never names the loop, which names it.
"""

from runlog.consumers.runner._core import RunnerStats, Stopped, default_group, transient_redis_error
from runlog.consumers.runner._fencing import ProjectionRebuilt, RebuildBusy, RebuildIncomplete
from runlog.consumers.runner._loop import ProjectionRunner, rebuild, streaming_gc
from runlog.consumers.runner._rebuilding import delete_projection

__all__ = [
    "ProjectionRebuilt",
    "ProjectionRunner",
    "RebuildBusy",
    "RebuildIncomplete",
    "RunnerStats",
    "Stopped",
    "default_group",
    "delete_projection",
    "rebuild",
    "streaming_gc",
    "transient_redis_error",
]
