"""The notification projection: the requests waiting for a person and the notifications
owed for them (the fold: ``projections/notify``); ``consumers._notify`` delivers them."""

from __future__ import annotations

from typing import Any

from runlog.consumers._store import Batch, Decoded, Handler, Projection, dumps
from runlog.projections import _notify as notify
from runlog.projections._run_state import RunState, Step

NAME = "notify"
"""Runs on its own (``runlog project notify``), with a hook: not in ``project all``."""


# A notification owed: created once per request (HSETNX), so a rebuild that folds the
# request again finds its delivery and queues nothing.
ENQUEUE_LUA = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('ZADD', KEYS[2], 0, ARGV[1])
  return 1
end
return 0
"""

# A request was decided: a notification not delivered yet is dropped; the first decision
# is the one recorded.
DECIDED_LUA = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local r = cjson.decode(raw)
if r['decision'] ~= nil then return 0 end
r['decision'] = cjson.decode(ARGV[2])
if r['status'] == 'queued' or r['status'] == 'retrying' then
  r['status'] = 'dropped'
  r['dropped_because'] = 'decided before delivery'
  redis.call('ZREM', KEYS[2], ARGV[1])
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r))
return 1
"""


def new_delivery(notification: notify.Notification) -> dict[str, Any]:
    """The delivery record of a notification just owed."""
    return {
        "id": notification["id"],
        "notification": notification,
        "status": "queued",
        "attempts": 0,
        "last_error": None,
        "delivered_at": None,
    }


class NotifyHandler(Handler[notify.NotifyRun]):
    """Keeps the requests waiting for a person (``pending``, rebuilt from the log like any
    projection) and owes one notification per valid APPROVAL_REQUESTED: queued in the
    same MULTI/EXEC as the position, so a redelivered record queues nothing, and created
    at most once per request, so a rebuild queues nothing either. A decision drops a
    notification not delivered yet. ``consumers._notify`` delivers the queue."""

    name = NAME

    def empty(self) -> notify.NotifyRun:
        return notify.NotifyRun()

    def validator(self, state: notify.NotifyRun) -> RunState:
        return state.validator

    def share(self, state: notify.NotifyRun, validator: RunState) -> None:
        state.validator = validator

    def own(self, state: notify.NotifyRun) -> dict[str, Any]:
        return {}

    def restore(self, own: dict[str, Any], validator: RunState) -> notify.NotifyRun:
        return notify.NotifyRun(validator=validator)

    def on_step(
        self, batch: Batch[notify.NotifyRun], state: notify.NotifyRun, rec: Decoded, step: Step
    ) -> None:
        if not step.accepted or step.approval is None:
            return
        ops: list[tuple[str, str, dict[str, Any]]] = batch.extra.setdefault("ops", [])
        asked = notify.requested(state.validator, rec.event)
        if asked is not None:
            ops.append(("asked", asked["id"], asked))
            return
        settled = notify.decided(state.validator, rec.event)
        if settled is not None:
            ops.append(("decided", *settled))

    def purge_keys(self, partition: int, run_id: str) -> list[tuple[str, str]]:
        # Requests waiting for a person and the notifications owed or delivered for them.
        return [
            *super().purge_keys(partition, run_id),
            (self.keys.pending(partition), run_id),
            (self.keys.deliveries(partition), run_id),
        ]

    def write_batch(self, pipe: Any, batch: Batch[notify.NotifyRun]) -> None:
        p, k = batch.partition, self.keys
        for op, ident, data in batch.extra.get("ops", []):
            if op == "asked":
                pipe.hset(k.pending(p), ident, dumps(data))
                script, arg = ENQUEUE_LUA, dumps(new_delivery(data))
            else:
                pipe.hdel(k.pending(p), ident)
                script, arg = DECIDED_LUA, dumps(data)
            # EVAL by name: a Redis Cluster pipeline has no eval() of its own.
            pipe.execute_command("EVAL", script, 2, k.deliveries(p), k.outbox(p), ident, arg)


# A forged decision must not drop a notification owed: it gets the same trusted keys as
# every projection (``make_handler``).
PROJECTION = Projection(NAME, fold=notify, handler=NotifyHandler, in_all=False)
