"""Delivering the notifications the notify projection owes: a person learns a decision waits.

The projection (``stores.notify``) queues one notification per approval requested,
atomically with its position. This loop delivers them to a hook: a Python callable that
takes the notification (a JSON-ready dict) and raises if it did not take it, or a
``Webhook`` that POSTs it as JSON with an ``Idempotency-Key`` header equal to the
request's identity (``projections._notify.identity``).

Each delivery is claimed first (a Lua script moves its due time past a claim timeout), so
any number of loops, in any number of processes, share the queue without delivering one
notification twice at once. A failed attempt (a 5xx, 408, 425 or 429, a timeout, a
refused connection, any exception of a Python hook) is retried with capped exponential
backoff until ``notify_max_attempts``; another 4xx fails it at once. Every attempt is
recorded, and the delivery (status, attempts, last error, delivered_at) with it.

Delivery is at least once: a loop that dies after the hook took a notification and before
it recorded that (a SIGKILL, a lost connection) leaves it claimed; once the claim times out
it is delivered again, with the same ``Idempotency-Key``, which is what a receiver
deduplicates on. A request decided before its notification was delivered is dropped.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlsplit

import redis

from runlog._settings import Settings
from runlog.consumers._store import ProjectionKeys, dumps
from runlog.consumers.stores import NOTIFY
from runlog.errors import ConfigError, NotificationFailed, RedisUnavailable
from runlog.log._clients import REDIS_ERRORS

log = logging.getLogger(__name__)

Hook = Callable[[dict[str, Any]], object]
"""Takes one notification; returns if it was taken, raises if not (``NotificationFailed``
with ``retryable=False`` for a refusal that no retry can change)."""

RETRYABLE_STATUS = frozenset({408, 425, 429})
"""4xx answers that mean "later", not "never"; every 5xx is retried too."""

# ARGV: now, claimed until, owner, how many to claim. Entries settled meanwhile (a
# decision dropped them) leave the queue on the way.
CLAIM_LUA = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', ARGV[1], 'LIMIT', 0, 100)
local out = {}
for _, id in ipairs(ids) do
  if #out >= tonumber(ARGV[4]) then break end
  local raw = redis.call('HGET', KEYS[1], id)
  local r = raw and cjson.decode(raw)
  if not r or (r['status'] ~= 'queued' and r['status'] ~= 'retrying') then
    redis.call('ZREM', KEYS[2], id)
  else
    redis.call('ZADD', KEYS[2], ARGV[2], id)
    r['claimed_by'] = ARGV[3]
    r['claimed_until'] = tonumber(ARGV[2])
    raw = cjson.encode(r)
    redis.call('HSET', KEYS[1], id, raw)
    table.insert(out, raw)
  end
end
return out
"""

# ARGV: id, attempt JSON, outcome (delivered | retry | failed), next due time, error,
# delivered_at. A delivery recorded as delivered stays so; a dropped one is not retried.
DONE_LUA = """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local r = cjson.decode(raw)
r['attempts'] = (tonumber(r['attempts']) or 0) + 1
r['claimed_by'] = nil
r['claimed_until'] = nil
redis.call('RPUSH', KEYS[3], ARGV[2])
if ARGV[3] == 'delivered' then
  if r['status'] ~= 'delivered' then
    r['status'] = 'delivered'
    r['delivered_at'] = ARGV[6]
  end
  redis.call('ZREM', KEYS[2], ARGV[1])
else
  r['last_error'] = ARGV[5]
  if r['status'] == 'queued' or r['status'] == 'retrying' then
    if ARGV[3] == 'retry' then
      r['status'] = 'retrying'
      redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
    else
      r['status'] = 'failed'
      redis.call('ZREM', KEYS[2], ARGV[1])
    end
  else
    redis.call('ZREM', KEYS[2], ARGV[1])
  end
end
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(r))
return r['attempts']
"""


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is an answer, not a delivery: urllib would follow a 302 to a POST with a
    GET without the body, and a 200 there would count as delivered."""

    def redirect_request(self, *args: Any, **kw: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect)


class Webhook:
    """A hook that POSTs each notification as JSON to ``url`` (standard library only).

    Headers: ``Content-Type: application/json`` and ``Idempotency-Key`` (the request's
    identity, the same on every attempt). A 2xx answer delivers it; a redirect is not
    followed (it fails the delivery); see the module for what is retried.
    """

    def __init__(self, url: str, *, timeout_s: float = 10.0) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"notification webhook must be an http(s) URL, not {url!r}")
        self.url = url
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        parts = urlsplit(self.url)  # never print credentials or a query's token
        return f"Webhook({parts.scheme}://{parts.hostname}:{parts.port or ''}{parts.path})"

    def __call__(self, notification: dict[str, Any]) -> int:
        body = json.dumps(notification, sort_keys=True, separators=(",", ":")).encode()
        request = urllib.request.Request(
            self.url,
            data=body,
            method="POST",
            headers={
                "Content-Type": "application/json",
                "Idempotency-Key": str(notification["id"]),
                "User-Agent": "runlog-notify",
            },
        )
        try:
            with _OPENER.open(request, timeout=self.timeout_s) as response:
                response.read()
                status = int(response.status)
        except urllib.error.HTTPError as exc:
            status = int(exc.code)
            retry = status >= 500 or status in RETRYABLE_STATUS
            raise NotificationFailed(
                f"webhook answered {status}", retryable=retry, status=status
            ) from exc
        except (urllib.error.URLError, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise NotificationFailed(
                f"webhook unreachable: {type(reason).__name__}: {reason}"
            ) from exc
        if not 200 <= status < 300:
            raise NotificationFailed(f"webhook answered {status}", status=status)
        return status


def hook_from_settings(settings: Settings, url: str | None = None) -> Hook | None:
    """The webhook ``url`` (else ``RUNLOG_NOTIFY_WEBHOOK_URL``) names, or None."""
    target = url or settings.notify_webhook_url
    return None if not target else Webhook(target, timeout_s=settings.notify_timeout_s)


@dataclass(frozen=True)
class Attempt:
    """What one attempt came to."""

    outcome: str
    """delivered | retry | failed"""
    error: str | None
    status: int | None


class Notifier:
    """Delivers the queued notifications of every partition to ``hook``, until stopped.

    ``claim_s``: how long a claimed notification is this loop's alone (default: twice the
    webhook timeout, plus a second); a Python hook that takes longer may be called again.
    ``partitions``: which partitions to serve, asked before each pass (default: all). A
    ``ProjectionRunner`` with a hook gives the partitions it holds and has folded to
    within a batch of the end of the log, so the members of a group share the work and a
    notify projection catching up on an old log does not notify requests whose decision it
    has not reached yet.
    """

    def __init__(
        self,
        client: redis.Redis,
        settings: Settings,
        hook: Hook,
        *,
        claim_s: float | None = None,
        poll_s: float = 0.25,
        batch: int = 20,
        owner: str | None = None,
        partitions: Callable[[], Iterable[int]] | None = None,
    ) -> None:
        self.redis = client
        self.settings = settings
        self.hook = hook
        self.keys = ProjectionKeys(settings.redis_key_prefix, NOTIFY, settings.events_topic)
        self.claim_s = claim_s if claim_s is not None else 2 * settings.notify_timeout_s + 1
        self.poll_s = poll_s
        self.batch = batch
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}:{id(self):x}"
        self.partitions = partitions or (lambda: range(settings.partitions))
        """The partitions to serve now (a runner gives those it holds and has caught up)."""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # Control -----------------------------------------------------------------------------
    def start(self) -> Notifier:
        """Deliver in a daemon thread of its own (``stop`` ends it)."""
        self._thread = threading.Thread(target=self.run, name="runlog-notify", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def run(self) -> None:
        """Deliver what is due, then wait a little, until ``stop``; Redis errors back off."""
        delay = self.poll_s
        while not self._stop.is_set():
            try:
                done = self.deliver_due()
                delay = self.poll_s
            except REDIS_ERRORS as exc:
                log.warning("notifications: Redis: %s (retrying in %.1fs)", exc, delay)
                done = 0
                delay = min(delay * 2, 5.0)
            except RedisUnavailable as exc:
                log.warning("notifications: Redis: %s (retrying in %.1fs)", exc, delay)
                done = 0
                delay = min(delay * 2, 5.0)
            except Exception:  # a bug must not end delivery for good: say it, go on
                log.exception("notifications: delivery pass failed (retrying in %.1fs)", delay)
                done = 0
                delay = min(delay * 2, 5.0)
            if not done:
                self._stop.wait(delay)

    # One pass ----------------------------------------------------------------------------
    def deliver_due(self, now: float | None = None) -> int:
        """Claim and deliver what is due in every partition; how many attempts it made."""
        made = 0
        for p in sorted(self.partitions()):
            # One claim per delivery: a claim made now covers this attempt alone, however
            # long the ones before it took. At most ``batch`` per partition and pass.
            for _ in range(self.batch):
                if self._stop.is_set():
                    return made
                claimed = self._claim(p, time.time() if now is None else now)
                if not claimed:
                    break
                self._deliver(p, json.loads(claimed[0]))
                made += 1
        return made

    def _claim(self, partition: int, now: float) -> list[Any]:
        k = self.keys
        claimed: list[Any] = self.redis.eval(
            CLAIM_LUA,
            2,
            k.deliveries(partition),
            k.outbox(partition),
            repr(now),
            repr(now + self.claim_s),
            self.owner,
            1,
        )
        return claimed

    def _deliver(self, partition: int, record: dict[str, Any]) -> None:
        notification = self.payload(record["notification"])
        attempt_no = int(record.get("attempts") or 0) + 1
        started = time.time()
        try:
            answer = self.hook(notification)
            status = answer if isinstance(answer, int) and not isinstance(answer, bool) else None
            result = Attempt("delivered", None, status)
        except NotificationFailed as exc:
            result = self._failed(attempt_no, str(exc), exc.retryable, exc.status)
        except Exception as exc:  # noqa: BLE001 - a hook's bug is a failed attempt, not our crash
            result = self._failed(attempt_no, f"{type(exc).__name__}: {exc}", True, None)
        ended = time.time()
        wait = self.backoff_s(attempt_no)
        entry = {
            "attempt": attempt_no,
            "at": _iso(started),
            "ms": round((ended - started) * 1000, 1),
            "outcome": result.outcome,
            "status": result.status,
            "error": result.error,
            "by": self.owner,
        }
        k = self.keys
        self.redis.eval(
            DONE_LUA,
            3,
            k.deliveries(partition),
            k.outbox(partition),
            k.attempts(partition, record["id"]),
            record["id"],
            dumps(entry),
            result.outcome,
            repr(ended + wait),
            result.error or "",
            _iso(ended),
        )
        level = logging.INFO if result.outcome == "delivered" else logging.WARNING
        log.log(
            level,
            "notification %s attempt %d: %s %s",
            record["id"],
            attempt_no,
            result.outcome,
            result.error or "",
        )

    def _failed(self, attempt_no: int, error: str, retryable: bool, status: int | None) -> Attempt:
        final = not retryable or attempt_no >= self.settings.notify_max_attempts
        return Attempt("failed" if final else "retry", error, status)

    def backoff_s(self, attempt_no: int) -> float:
        """Wait after failed attempt ``attempt_no`` (1, 2, ...): doubled each time, capped."""
        s = self.settings
        return float(min(s.notify_backoff_cap_s, s.notify_backoff_s * 2 ** (attempt_no - 1)))

    def payload(self, notification: dict[str, Any]) -> dict[str, Any]:
        """What the hook gets: the stored notification plus the console's link to the run."""
        out = dict(notification)
        if self.settings.ui_url:
            base = self.settings.ui_url.rstrip("/")
            out["url"] = f"{base}/runs/{quote(str(notification['run_id']), safe='')}"
        return out
