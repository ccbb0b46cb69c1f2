"""A state view stored whole by the older store is split on its next write, losing nothing."""

from __future__ import annotations

import json

import redis
from projections_support import dump

from runlog._settings import Settings
from runlog.consumers import _queries as queries
from runlog.consumers._store import APPLIED, ProjectionKeys
from runlog.consumers.runner import ProjectionRunner
from runlog.schemas._keys import partition_for
from tools.loadgen import LoadGenerator


def test_a_view_stored_whole_is_split_on_its_next_write(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    gen = LoadGenerator(test_settings, seed=17)
    run = gen.new_run()
    for _ in range(60):
        gen.step(run)
    gen.flush()
    ProjectionRunner(test_settings, redis_client, ("state",)).catch_up(timeout_s=60)

    # Rewrite the run the way the older store kept it: one JSON, conversation inline.
    keys = ProjectionKeys(test_settings.redis_key_prefix, "state", test_settings.events_topic)
    p = partition_for(run.run_id, test_settings.partitions)
    view = queries.get_state(redis_client, test_settings, run.run_id)
    assert view is not None and view["state"]["messages"]
    view["version"] = 1
    redis_client.set(keys.run(p, run.run_id), json.dumps(view, sort_keys=True))
    redis_client.delete(keys.messages(p, run.run_id), keys.completed(p, run.run_id))
    old = queries.get_state(redis_client, test_settings, run.run_id)
    assert old is not None and old["state"]["messages"] == view["state"]["messages"]

    for _ in range(30):
        gen.step(run)
    gen.finish(run)
    gen.flush()
    ProjectionRunner(test_settings, redis_client, ("state",)).catch_up(timeout_s=60)

    ref = test_settings.model_copy(
        update={"redis_key_prefix": test_settings.redis_key_prefix + "-ref"}
    )
    ProjectionRunner(ref, redis_client, ("state",)).catch_up(timeout_s=60)
    assert dump(redis_client, test_settings, ("state",)) == dump(redis_client, ref, ("state",))
    got = queries.get_state(redis_client, test_settings, run.run_id)
    assert got is not None and APPLIED in got and got["state"]["status"] == "finished"
