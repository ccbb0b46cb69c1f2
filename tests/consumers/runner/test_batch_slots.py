"""Every key one projection transaction touches is in one Redis Cluster slot.

Redis Cluster runs a MULTI/EXEC (and WATCH) only over keys of one slot. The runner's
transaction per partition batch must therefore name only keys with the partition's hash
tag, whatever the batch holds (new runs, quarantined records, the run index). Checked with
the server's own key extraction (``COMMAND GETKEYS``) on what the runner really sends.
"""

from __future__ import annotations

from typing import Any

import redis
from redis.crc import key_slot

from runlog._settings import Settings
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from tools.loadgen import LoadGenerator


def test_each_projection_transaction_stays_in_one_slot(
    test_settings: Settings, redis_client: redis.Redis, monkeypatch
) -> None:
    LoadGenerator(test_settings, seed=21).generate(runs=8, events_per_run=40)
    transactions: list[list[tuple[Any, ...]]] = []
    watched: list[tuple[Any, ...]] = []
    real_watch = redis.client.Pipeline.watch
    real_execute = redis.client.Pipeline.execute

    def watch(self: Any, *names: Any) -> Any:
        watched.append(names)
        return real_watch(self, *names)

    def execute(self: Any, raise_on_error: bool = True) -> Any:
        if self.transaction:
            transactions.append([args for args, _ in self.command_stack])
        return real_execute(self, raise_on_error)

    monkeypatch.setattr(redis.client.Pipeline, "watch", watch)
    monkeypatch.setattr(redis.client.Pipeline, "execute", execute)
    ProjectionRunner(test_settings, redis_client, PROJECTIONS).catch_up(timeout_s=60)
    monkeypatch.undo()

    commits = [t for t in transactions if any(a[0] == "SET" and a[1].endswith(":pos") for a in t)]
    assert commits, "the catch-up committed nothing"
    assert len(watched) >= len(commits)
    for names in watched:
        assert len({key_slot(str(k).encode()) for k in names}) == 1, names
    for commands in commits:
        keys: set[str] = set()
        for args in commands:
            if args[0] in ("MULTI", "EXEC"):
                continue
            got = redis_client.command_getkeys(*args)
            keys |= {k.decode() if isinstance(k, bytes) else str(k) for k in got}
        slots = {key_slot(k.encode()) for k in keys}
        assert len(slots) == 1, sorted(keys)[:20]
        # And that slot is the partition's tag, not a coincidence.
        assert all("{" + test_settings.events_topic + ":" in k for k in keys), sorted(keys)[:5]
