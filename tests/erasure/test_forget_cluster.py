"""``runlog forget`` on a Redis Cluster: the projections' purge (a Lua scrub inside each
partition's MULTI, on that partition's slot) and the rewrite of every master's files."""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from ci_support import IN_CI
from test_forget import TENANT, make_run

import runlog._api
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.log._clients import redis_client as make_client
from runlog.stack import StackConfig
from runlog.stack import _redis_cluster as redis_cluster

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None and not IN_CI, reason="no redis-server"
)


@pytest.fixture
def on_cluster(test_settings: Settings) -> Iterator[Settings]:
    state = StackConfig.from_env().state_dir
    url = redis_cluster.up(state)
    s = test_settings.model_copy(update={"redis_url": url, "redis_cluster": True})
    try:
        yield s
    finally:
        Services.close_shared(redis_url=url)  # no lease renewal left retrying a gone cluster
        redis_cluster.down(state)


def _all_bytes(client: Any) -> bytes:
    out: list[bytes] = []
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        out.append(key if isinstance(key, bytes) else key.encode())
        if kind == b"string":
            out.append(client.get(key))
        elif kind == b"hash":
            out += [x for kv in client.hgetall(key).items() for x in kv]
        elif kind == b"list":
            out += client.lrange(key, 0, -1)
        elif kind == b"set":
            out += list(client.smembers(key))
        elif kind == b"zset":
            out += client.zrange(key, 0, -1)
    return b"\n".join(x if isinstance(x, bytes) else str(x).encode() for x in out)


def test_forget_on_a_redis_cluster(on_cluster: Settings) -> None:
    s = on_cluster
    gone, kept = f"GONE{uuid.uuid4().hex}", f"KEPT{uuid.uuid4().hex}"
    forgotten = make_run(s, gone, snapshot=True)
    make_run(s, kept)
    client = make_client(s)
    ProjectionRunner(s, client, PROJECTIONS).catch_up(timeout_s=120)
    assert gone.encode() in _all_bytes(client)
    # No runner folds the erasure yet (the catch-up below does): the forget says so after
    # its short wait instead of waiting out the default minute.
    report = runlog._api.forget(
        tenant=TENANT, run_id=forgotten, reason="x", by="dpo", settings=s, wait_s=2
    )
    assert report.copies_deleted >= 2
    assert report.projections_purged is False
    ProjectionRunner(s, client, PROJECTIONS).catch_up(timeout_s=120)
    report = runlog._api.forget(tenant=TENANT, run_id=forgotten, reason="x", by="dpo", settings=s)
    assert report.runs[0].already
    assert report.projections_purged is True and report.persistence_rewritten is True
    scan = _all_bytes(client)
    assert gone.encode() not in scan and kept.encode() in scan
    client.close()
