"""Purging an erased run's plaintext from the projections' Redis keys, driven by the log.

A projection runner learns of an erasure by folding the run's CONTENT_ERASED: the fold
writes ``ERASED`` over every content field of the run state (``run_state.erase_content``),
the store rewrites the run's state whole from it (``Handler.step``), and each projection
names here the other keys that hold copies of the run's content (the audit log, the
uncertain-call queue, the notifications, the quarantine): ``SCRUB_LUA`` rewrites their
JSON values with every content field replaced, in the same MULTI as the projection's
position. So the purge is exactly-once like any projection write, is redone by a runner
restarted after a kill -9 (its position is before the CONTENT_ERASED), and a rebuild from
offset zero ends with the same purged keys.

After a batch that purged, the runner asks Redis to rewrite its own persistence
(``rewrite_persistence``): the AOF and the RDB hold the old values until then.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis

from runlog.schemas._models import ERASED

log = logging.getLogger(__name__)

CONTENT_FIELDS: tuple[str, ...] = (
    "content",
    "args_json",
    "reason",
    "note",
    "detail",
    "summary",
    "evidence",
    "last_evidence",
    "error",
    "last_error",
    "text",
    "standing_note",
    "decision_note",
    "input_json",
    "value_b64",
    "message",
    "other_timeline",
    "result",
    "value",
)
"""Names of the JSON fields that carry content in the projections' values (at any depth)."""

_FIELDS = frozenset(CONTENT_FIELDS)


def scrub(value: Any) -> Any:
    """``value`` (JSON-like) with every content field at any depth replaced by ``ERASED``:
    what ``SCRUB_LUA`` does in Redis, for a reader that tells an erased run (``show``)."""
    if isinstance(value, dict):
        return {
            k: (ERASED if k in _FIELDS and v not in ("", None, ERASED) else scrub(v))
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [scrub(v) for v in value]
    return value


SCRUB_LUA = """
local marker = ARGV[1]
local run = ARGV[2]
local upto = tonumber(ARGV[3])
local fields = {}
for i = 4, #ARGV do fields[ARGV[i]] = true end
local function scrub(t)
  local changed = false
  for k, v in pairs(t) do
    if fields[k] and ((type(v) == 'string' and v ~= '' and v ~= marker) or type(v) == 'table') then
      t[k] = marker
      changed = true
    elseif type(v) == 'table' then
      if scrub(v) then changed = true end
    end
  end
  return changed
end
local function mine(e)
  if run == '' or e['run_id'] == run then return true end
  local n = e['notification']
  return type(n) == 'table' and n['run_id'] == run
end
local function fix(raw)
  local ok, e = pcall(cjson.decode, raw)
  if not ok or type(e) ~= 'table' or not mine(e) then return nil end
  if upto and type(e['offset']) == 'number' and e['offset'] > upto then return nil end
  if scrub(e) then return cjson.encode(e) end
  return nil
end
local kind = redis.call('TYPE', KEYS[1])['ok']
local n = 0
if kind == 'list' then
  local items = redis.call('LRANGE', KEYS[1], 0, -1)
  for i, raw in ipairs(items) do
    local new = fix(raw)
    if new then redis.call('LSET', KEYS[1], i - 1, new); n = n + 1 end
  end
elseif kind == 'hash' then
  local items = redis.call('HGETALL', KEYS[1])
  for i = 1, #items, 2 do
    local new = fix(items[i + 1])
    if new then redis.call('HSET', KEYS[1], items[i], new); n = n + 1 end
  end
elseif kind == 'string' then
  local new = fix(redis.call('GET', KEYS[1]))
  if new then redis.call('SET', KEYS[1], new, 'KEEPTTL'); n = 1 end
end
return n
"""
"""KEYS[1]: a list, hash or string of JSON values; ARGV: the marker, the run id whose
values to scrub ('' every value of the key), the erasure's offset ('' none: a value with
an ``offset`` above it, written after the erasure, is left as it is), the content field
names. Returns how many values it rewrote."""


def queue_scrub(pipe: Any, key: str, run_id: str = "", *, upto: int | None = None) -> None:
    """Queue ``SCRUB_LUA`` on ``key`` (inside a MULTI): the values of ``run_id`` (or all)
    with their content fields replaced by ``ERASED``; with ``upto`` (the erasure's offset)
    only the values recorded at or before it, so the result does not depend on whether
    a later record (one quarantined after the erasure) was in the same batch."""
    # EVAL by name: a Redis Cluster pipeline has no eval() of its own.
    bound = "" if upto is None else str(upto)
    pipe.execute_command("EVAL", SCRUB_LUA, 1, key, ERASED, run_id, bound, *CONTENT_FIELDS)


PERSISTENCE_WAIT_S = 60.0


def _issue(command: Any) -> bool:
    try:
        command()
        return True
    except redis.ResponseError as exc:  # one is under way: ours starts after it
        log.info("Redis persistence: %s", exc)
        return False


def rewrite_persistence(client: redis.Redis, wait_s: float = PERSISTENCE_WAIT_S) -> bool:
    """``rewrite_node`` on Redis, or on every primary of a Redis Cluster."""
    primaries = getattr(client, "get_primaries", None)
    if primaries is None:
        return rewrite_node(client, wait_s)
    nodes = [n.redis_connection for n in primaries()]
    return all([rewrite_node(n, wait_s) for n in nodes if n is not None])


def rewrite_node(client: redis.Redis, wait_s: float = PERSISTENCE_WAIT_S) -> bool:
    """Rewrite Redis's AOF (BGREWRITEAOF) and RDB (BGSAVE) and wait for both to finish, so
    the values a purge overwrote are gone from Redis's files too. True when both are done;
    False on a timeout (the next purge rewrites them; ``runlog forget`` reports it).

    Only a rewrite that began after this call counts (Redis >= 7 counts them: ``aof_rewrites``
    and ``rdb_saves``): one already under way forked before the purge and may hold the old
    values, so ours is issued once it ended. One issued but never started (a schedule
    Redis dropped) is issued again once Redis has been idle for a second."""
    started = time.monotonic()
    now: dict[str, Any] = dict(client.info("persistence"))
    aof = bool(int(now.get("aof_enabled", 0)))
    aof_base: int | None = None if aof else -1
    rdb_base: int | None = None
    idle_since: float | None = None
    while time.monotonic() - started < wait_s:
        now = dict(client.info("persistence"))
        aof_busy = int(now.get("aof_rewrite_in_progress", 0)) or int(
            now.get("aof_rewrite_scheduled", 0)
        )
        rdb_busy = int(now.get("rdb_bgsave_in_progress", 0))
        rewrites, saves = int(now.get("aof_rewrites", 0)), int(now.get("rdb_saves", 0))
        if aof_base is None and not aof_busy and _issue(client.bgrewriteaof):
            aof_base = rewrites
        if rdb_base is None and not rdb_busy and _issue(lambda: client.bgsave(schedule=True)):
            rdb_base = saves
        done_aof = aof_base == -1 or (aof_base is not None and rewrites > aof_base and not aof_busy)
        done_rdb = rdb_base is not None and saves > rdb_base and not rdb_busy
        if done_aof and done_rdb:
            return True
        if aof_busy or rdb_busy:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > 1.0:
            # Issued, yet nothing runs and nothing was counted: issue what is missing again.
            if not done_aof:
                aof_base = None
            if not done_rdb:
                rdb_base = None
            idle_since = None
        time.sleep(0.05)
    log.warning(
        "Redis did not rewrite its AOF and RDB in %.0fs: %s",
        wait_s,
        {k: v for k, v in now.items() if k.startswith(("aof_rewrite", "rdb_"))},
    )
    return False
