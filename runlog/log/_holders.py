"""Who holds which run's lease now: the live half of a run's status.

Read straight from the leases in Redis (one pipelined GET + PTTL per run), never from a
projection: ownership is the lease's, and a projection cannot know that an owner died.
``runlog.projections._state_view`` turns this and the log's part into the one status.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

import redis

from runlog._settings import Settings
from runlog.errors import RedisUnavailable
from runlog.log._clients import REDIS_ERRORS
from runlog.projections._run_state import RunState
from runlog.projections._state_view import Holder, RunStatus, run_status
from runlog.schemas._keys import handover_key, lease_key, live_key, session_of


def holders(
    client: redis.Redis, settings: Settings, runs: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], Holder | None]:
    """``(tenant, run_id)`` -> its lease's holder, or None when nobody holds it."""
    wanted = list(dict.fromkeys(runs))
    if not wanted:
        return {}
    now = datetime.now(UTC)
    try:
        pipe = client.pipeline(transaction=False)
        for tenant, run_id in wanted:
            key = lease_key(settings.redis_key_prefix, tenant, run_id)
            pipe.get(key)
            pipe.pttl(key)
            pipe.get(handover_key(settings.redis_key_prefix, tenant, run_id))
        replies = pipe.execute()
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"run leases: {exc}") from exc
    values = [_text(raw) for raw in replies[0::3]]
    lives = _liveness(client, settings, {session_of(v) for v in values if v is not None})
    out: dict[tuple[str, str], Holder | None] = {}
    for i, run in enumerate(wanted):
        value, pttl, handed = values[i], int(replies[3 * i + 1]), _text(replies[3 * i + 2])
        alive = True
        sid = None if value is None else session_of(value)
        if value is not None and sid is not None:
            # A lease bound to its owner's session lives as long as the session's key; one
            # whose session is gone names a dead owner: the run is an orphan.
            pttl = lives.get(sid, -2)
            alive = pttl >= 0
            value, pttl = value.rpartition("|")[0], max(pttl, 0)
        if value is None and handed is not None:
            # Free, and its last owner let it go (a drain): the note names who.
            by = handed.split("|")[0]
            out[run] = Holder(owner="", epoch=0, expires_at=now, handed_over_by=by)
            continue
        if value is None or pttl < 0:
            out[run] = None
            continue
        owner, _, epoch = value.rpartition("|")
        out[run] = Holder(
            owner=owner,
            epoch=int(epoch) if epoch.isdigit() else 0,
            expires_at=now + timedelta(milliseconds=int(pttl)),
            alive=alive,
        )
    return out


def _text(raw: object) -> str | None:
    return None if raw is None else raw.decode() if isinstance(raw, bytes) else str(raw)


def _liveness(client: redis.Redis, settings: Settings, sessions: set[str | None]) -> dict[str, int]:
    """Each session's liveness key's PTTL (-2: gone): one pipelined PTTL per session."""
    named = sorted(s for s in sessions if s is not None)
    if not named:
        return {}
    try:
        pipe = client.pipeline(transaction=False)
        for sid in named:
            pipe.pttl(live_key(settings.redis_key_prefix, sid))
        return {sid: int(p) for sid, p in zip(named, pipe.execute(), strict=True)}
    except REDIS_ERRORS as exc:
        raise RedisUnavailable(f"liveness keys: {exc}") from exc


def holder(client: redis.Redis, settings: Settings, tenant: str, run_id: str) -> Holder | None:
    """The holder of one run's lease (None: nobody)."""
    return holders(client, settings, [(tenant, run_id)])[(tenant, run_id)]


def status_now(client: redis.Redis, settings: Settings, st: RunState) -> RunStatus:
    """``run_status`` of the run folded into ``st``, with its lease read now."""
    held = None
    if st.status != "finished" and st.run_id:
        held = holder(client, settings, st.tenant, st.run_id)
    return run_status(st, held)
