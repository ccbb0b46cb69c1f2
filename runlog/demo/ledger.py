"""The demo's ledger service: a separate process the agent changes over HTTP.

    python -m runlog.demo ledger --namespace NS [--port 0] [--faults JSON]

A tiny stdlib JSON API on 127.0.0.1 whose state lives in Redis under
``<RUNLOG_REDIS_KEY_PREFIX>:demo:<namespace>:``. Every write is one Lua script, so each
request either commits completely in one Redis transaction or not at all.

Endpoints (all bodies JSON):

``GET  /ledgers/{n}``                 a ledger's balance and entries (reads; counted in ``reads``)
``POST /corrections/idempotent``      needs ``Idempotency-Key``: the first stored response is
                                      returned on every repetition (Stripe-style; a reused key
                                      with a different body is refused with 422)
``POST /corrections/plain``           does NOT deduplicate: every accepted request applies again
``GET  /corrections/{id}``            authoritative lookup of a plain correction, or 404
``POST /tickets``                     irreversible, no lookup, no deduplication
``GET  /effects``                     applied effects per correction id and per ticket
``POST /fence``                       raise a run's fencing token (a person, before inspecting)

Why a 404 from ``GET /corrections/{id}`` is authoritative absence
-----------------------------------------------------------------
"Absent" is only useful if the original request can no longer commit. Two rules make that
true here, one for each way an earlier request can still be alive:

1. **Deadline (same writer).** Every mutating request carries ``X-Deadline-Ms``, an absolute
   time (Unix ms) computed by the client when it issues the request; the client's timeout
   ends at that deadline. The commit script compares it with Redis' own clock (``TIME``)
   inside the transaction and refuses after it. So once the deadline has passed, a request
   that did not commit never will, however long it sat in a socket buffer, the accept queue
   or a slow handler. The agent's reconciler waits until the deadline of its own last
   attempt has passed before it looks.
2. **Fencing token (other writers).** Every mutating request and every lookup carries the
   run's epoch (``X-Run-Id`` + ``X-Fencing-Token``, the lease's fencing token from runlog).
   The service keeps the highest token seen per run and refuses anything older (409), in the
   same transaction as the commit. A lookup by a newer owner therefore cuts off every
   request of a previous owner still in flight, including one from a worker that was paused
   (SIGSTOP, GC, VM migration) *before* it sent anything and wakes up later.

Assumptions, stated: the client's and Redis' clocks agree to within ``CLOCK_MARGIN_MS``
(same host in the demo; in production, bounded skew from NTP plus that margin), and Redis is
the only place a correction can commit. Without rule 2 a paused worker could commit after a
newer owner's "absent"; without rule 1 a slow request of the current owner could.

Faults (``--faults``) make the demo's uncertain outcomes deterministic. Each fires once per
id (recorded in Redis, so a restarted ledger does not fire it again):
``drop_after_commit`` (commit, then close the connection without answering),
``drop_before_commit`` (close without committing), ``slow`` ({id: seconds} sleep before the
commit, which the deadline then refuses) and ``lookup_unavailable`` (the first lookup of the
id answers 503).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import redis

from runlog.log.clients import redis_client
from runlog.settings import Settings

log = logging.getLogger(__name__)

LEDGERS = 14
CLOCK_MARGIN_MS = 50
"""Allowed disagreement between a client's clock and Redis' clock."""

# Each write script starts with these two checks, inside the same transaction as the write.
# KEYS[1] is the fences hash; ARGV[1] run id, ARGV[2] fencing token, ARGV[3] deadline (ms).
_CHECK_DEADLINE = """
local t = redis.call('TIME')
if tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) > tonumber(ARGV[3]) then
  return {'expired', ''}
end
"""
# A token older than the run's highest refuses the request; a newer one raises the fence.
_CHECK_FENCE = """
local fence = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) < fence then return {'stale', tostring(fence)} end
if tonumber(ARGV[2]) > fence then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
"""

# KEYS: fences, idem:<key>, corrections, effects, balances
# ARGV: run, token, deadline_ms, request_json, response_json, correction_id, ledger, amount
_IDEMPOTENT = (
    _CHECK_DEADLINE
    + _CHECK_FENCE
    + """
local prev = redis.call('GET', KEYS[2])
if prev then
  local stored = cjson.decode(prev)
  if stored['request'] ~= ARGV[4] then return {'mismatch', ''} end
  return {'replay', stored['response']}
end
redis.call('SET', KEYS[2], cjson.encode({request = ARGV[4], response = ARGV[5]}))
redis.call('HSET', KEYS[3], ARGV[6], ARGV[4])
redis.call('HINCRBY', KEYS[4], 'correction:' .. ARGV[6], 1)
redis.call('HINCRBY', KEYS[5], ARGV[7], ARGV[8])
return {'applied', ARGV[5]}
"""
)

# KEYS: fences, corrections, effects, balances
# ARGV: run, token, deadline_ms, request_json, correction_id, ledger, amount
_PLAIN = (
    _CHECK_DEADLINE
    + _CHECK_FENCE
    + """
redis.call('HSET', KEYS[2], ARGV[5], ARGV[4])
local n = redis.call('HINCRBY', KEYS[3], 'correction:' .. ARGV[5], 1)
redis.call('HINCRBY', KEYS[4], ARGV[6], ARGV[7])
return {'applied', tostring(n)}
"""
)

# KEYS: fences, effects, tickets
# ARGV: run, token, deadline_ms, request_json, ref
_TICKET = (
    _CHECK_DEADLINE
    + _CHECK_FENCE
    + """
local n = redis.call('HINCRBY', KEYS[2], 'ticket:' .. ARGV[5], 1)
redis.call('RPUSH', KEYS[3], ARGV[4])
return {'applied', tostring(n)}
"""
)

# KEYS: fences, corrections. ARGV: run, token, correction_id
_LOOKUP = (
    _CHECK_FENCE
    + """
local found = redis.call('HGET', KEYS[2], ARGV[3])
if found then return {'found', found} end
return {'absent', ''}
"""
)

# KEYS: fences. ARGV: run, token
_FENCE = _CHECK_FENCE + "return {'ok', ''}"


class Keys:
    """Every Redis key of one ledger namespace."""

    def __init__(self, prefix: str, namespace: str) -> None:
        self.base = base = f"{prefix}:demo:{namespace}"
        self.fences = f"{base}:fences"
        """run id -> highest fencing token seen."""
        self.corrections = f"{base}:corrections"
        self.effects = f"{base}:effects"
        """``correction:<id>`` / ``ticket:<ref>`` -> times applied."""
        self.balances = f"{base}:balances"
        self.reads = f"{base}:reads"
        self.tickets = f"{base}:tickets"
        self.fired = f"{base}:fired"

    def idem(self, key: str) -> str:
        return f"{self.base}:idem:{key}"


@dataclass
class Faults:
    drop_after_commit: set[str] = field(default_factory=set)
    drop_before_commit: set[str] = field(default_factory=set)
    slow: dict[str, float] = field(default_factory=dict)
    lookup_unavailable: set[str] = field(default_factory=set)

    @classmethod
    def parse(cls, text: str) -> Faults:
        raw: dict[str, Any] = json.loads(text) if text else {}
        return cls(
            drop_after_commit=set(raw.get("drop_after_commit", [])),
            drop_before_commit=set(raw.get("drop_before_commit", [])),
            slow={str(k): float(v) for k, v in raw.get("slow", {}).items()},
            lookup_unavailable=set(raw.get("lookup_unavailable", [])),
        )


class Ledger:
    """The service's logic, independent of HTTP (the handler only translates)."""

    def __init__(self, client: redis.Redis, keys: Keys, faults: Faults) -> None:
        self.redis = client
        self.keys = keys
        self.faults = faults
        self._idempotent = client.register_script(_IDEMPOTENT)
        self._plain = client.register_script(_PLAIN)
        self._ticket = client.register_script(_TICKET)
        self._lookup = client.register_script(_LOOKUP)
        self._fence = client.register_script(_FENCE)

    def seed(self) -> None:
        """Opening balances of the 14 ledgers (only if this namespace has none yet)."""
        for n in range(1, LEDGERS + 1):
            self.redis.hsetnx(self.keys.balances, str(n), 100_000 * n + 4_321 * (n % 5))

    def fire(self, kind: str, ident: str) -> bool:
        """True exactly once per (fault kind, id) if the fault is configured."""
        configured: set[str] | dict[str, float] = getattr(self.faults, kind)
        if ident not in configured:
            return False
        return bool(self.redis.set(f"{self.keys.fired}:{kind}:{ident}", "1", nx=True))

    def read(self, n: int) -> dict[str, Any] | None:
        if not 1 <= n <= LEDGERS:
            return None
        self.redis.hincrby(self.keys.reads, str(n), 1)
        balance = int(self.redis.hget(self.keys.balances, str(n)) or 0)
        return {"ledger": n, "balance_cents": balance}

    def effects(self) -> dict[str, Any]:
        def decode(raw: dict[Any, Any]) -> dict[str, int]:
            return {
                (k.decode() if isinstance(k, bytes) else str(k)): int(v) for k, v in raw.items()
            }

        effects = decode(self.redis.hgetall(self.keys.effects))
        reads = decode(self.redis.hgetall(self.keys.reads))
        tickets = [json.loads(t) for t in self.redis.lrange(self.keys.tickets, 0, -1)]
        return {"effects": effects, "reads": reads, "tickets": tickets}

    def fence(self, run: str, token: int) -> int | None:
        """Raise ``run``'s token; returns the higher current one if ``token`` is stale."""
        outcome, detail = _strs(self._fence(keys=[self.keys.fences], args=[run, token]))
        return int(detail) if outcome == "stale" else None


CORRECTION_FIELDS = ("correction_id", "tenant", "ledger", "account", "amount_cents", "period")
TICKET_FIELDS = ("ref", "tenant", "subject", "body")


def validate(body: Any, fields: tuple[str, ...]) -> str | None:
    if not isinstance(body, dict):
        return "body must be a JSON object"
    missing = [f for f in fields if f not in body]
    if missing:
        return f"missing fields: {', '.join(missing)}"
    extra = sorted(set(body) - set(fields))
    if extra:
        return f"unknown fields: {', '.join(extra)}"
    if "ledger" in body and not (
        isinstance(body["ledger"], int) and 1 <= body["ledger"] <= LEDGERS
    ):
        return f"ledger must be 1..{LEDGERS}"
    if "amount_cents" in body and not isinstance(body["amount_cents"], int):
        return "amount_cents must be an integer"
    return None


def canonical(body: dict[str, Any]) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"))


class Drop(Exception):
    """Close the connection without an answer (an injected fault)."""


Mutation = tuple[dict[str, Any], str, int, int]
"""A valid mutating request: its body, run id, fencing token and deadline (ms)."""


class Handler(BaseHTTPRequestHandler):
    server: LedgerServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:
        log.debug("%s " + fmt, self.address_string(), *args)

    # Plumbing ------------------------------------------------------------------------
    def _send(self, status: int, payload: Any) -> None:
        data = json.dumps(payload, sort_keys=True).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _drop(self) -> None:
        self.close_connection = True
        self.connection.shutdown(2)

    def _body(self) -> Any:
        length = int(self.headers.get("Content-Length") or 0)
        try:
            return json.loads(self.rfile.read(length) or b"null")
        except ValueError:
            return None

    def _fencing(self) -> tuple[str, int] | str:
        run = self.headers.get("X-Run-Id")
        token = self.headers.get("X-Fencing-Token")
        if not run or token is None or not token.isdigit():
            return "X-Run-Id and a numeric X-Fencing-Token are required"
        return run, int(token)

    def _deadline(self) -> int | str:
        raw = self.headers.get("X-Deadline-Ms")
        if raw is None or not raw.isdigit():
            return "a numeric X-Deadline-Ms is required"
        return int(raw) + CLOCK_MARGIN_MS

    def _dispatch(self, method: str) -> None:
        url = urlparse(self.path)
        try:
            route = ROUTES.get((method, _route_name(url.path)))
            if route is None:
                self._send(HTTPStatus.NOT_FOUND, {"error": f"no route {method} {url.path}"})
                return
            route(self, url.path, parse_qs(url.query))
        except Drop:
            self._drop()
        except redis.RedisError as exc:
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": f"storage unavailable: {exc}"})

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # Routes ---------------------------------------------------------------------------
    def get_ledger(self, path: str, query: dict[str, list[str]]) -> None:
        n = path.rsplit("/", 1)[1]
        found = self.server.ledger.read(int(n)) if n.isdigit() else None
        if found is None:
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no ledger {n}"})
        else:
            self._send(HTTPStatus.OK, found)

    def get_effects(self, path: str, query: dict[str, list[str]]) -> None:
        self._send(HTTPStatus.OK, self.server.ledger.effects())

    def post_fence(self, path: str, query: dict[str, list[str]]) -> None:
        body = self._body()
        if not isinstance(body, dict) or not isinstance(body.get("epoch"), int):
            self._send(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": "need run and epoch"})
            return
        stale = self.server.ledger.fence(str(body.get("run")), body["epoch"])
        self._send(HTTPStatus.OK, {"fenced": True, "current": stale or body["epoch"]})

    def _mutation(self, fields: tuple[str, ...]) -> Mutation | None:
        """Validate a mutating request; answers 4xx itself and returns None if invalid."""
        body = self._body()
        problem = validate(body, fields)
        fencing = self._fencing()
        deadline = self._deadline()
        if problem is None and isinstance(fencing, str):
            problem = fencing
        if problem is None and isinstance(deadline, str):
            problem = deadline
        if problem is not None:
            self._send(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": problem})
            return None
        assert isinstance(fencing, tuple) and isinstance(deadline, int)
        return body, fencing[0], fencing[1], deadline

    def _refused(self, outcome: str, detail: str) -> bool:
        if outcome == "expired":
            self._send(HTTPStatus.CONFLICT, {"error": "deadline passed; not committed"})
        elif outcome == "stale":
            self._send(HTTPStatus.CONFLICT, {"error": f"stale fencing token (current {detail})"})
        elif outcome == "mismatch":
            self._send(
                HTTPStatus.UNPROCESSABLE_ENTITY,
                {"error": "Idempotency-Key reused with a different request"},
            )
        else:
            return False
        return True

    def _commit(
        self,
        got: Mutation,
        ident: str,
        script: Any,
        *,
        keys: list[str],
        args: list[Any],
    ) -> tuple[str, str] | None:
        """Run a mutation's script for ``ident`` inside the configured faults: its
        (outcome, detail), or None when it was refused (the refusal is already answered).
        A fault may drop the request before the commit or its answer after it.

        Every mutation script checks the fence first: the fences hash goes before ``keys``,
        and run, token, deadline and the canonical request before ``args``."""
        body, run, token, deadline = got
        ledger = self.server.ledger
        if ledger.fire("drop_before_commit", ident):
            raise Drop
        if ledger.fire("slow", ident):
            time.sleep(ledger.faults.slow[ident])
        outcome, detail = _strs(
            script(
                keys=[ledger.keys.fences, *keys],
                args=[run, token, deadline, canonical(body), *args],
            )
        )
        if self._refused(outcome, detail):
            return None
        if ledger.fire("drop_after_commit", ident):
            raise Drop
        return outcome, detail

    def post_idempotent(self, path: str, query: dict[str, list[str]]) -> None:
        key = self.headers.get("Idempotency-Key")
        got = self._mutation(CORRECTION_FIELDS)
        if got is None:
            return
        if not key:
            self._send(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": "Idempotency-Key required"})
            return
        body = got[0]
        cid = str(body["correction_id"])
        ledger = self.server.ledger
        response = canonical({"correction": body, "status": "applied"})
        committed = self._commit(
            got,
            cid,
            ledger._idempotent,
            keys=[
                ledger.keys.idem(key),
                ledger.keys.corrections,
                ledger.keys.effects,
                ledger.keys.balances,
            ],
            args=[response, cid, body["ledger"], body["amount_cents"]],
        )
        if committed is None:
            return
        outcome, detail = committed
        status = HTTPStatus.CREATED if outcome == "applied" else HTTPStatus.OK
        self._send(status, {**json.loads(detail), "replayed": outcome == "replay"})

    def post_plain(self, path: str, query: dict[str, list[str]]) -> None:
        got = self._mutation(CORRECTION_FIELDS)
        if got is None:
            return
        body = got[0]
        cid = str(body["correction_id"])
        ledger = self.server.ledger
        committed = self._commit(
            got,
            cid,
            ledger._plain,
            keys=[ledger.keys.corrections, ledger.keys.effects, ledger.keys.balances],
            args=[cid, body["ledger"], body["amount_cents"]],
        )
        if committed is not None:
            self._send(HTTPStatus.CREATED, {"correction": body, "status": "applied"})

    def get_correction(self, path: str, query: dict[str, list[str]]) -> None:
        cid = path.rsplit("/", 1)[1]
        fencing = self._fencing()
        if isinstance(fencing, str):
            self._send(HTTPStatus.UNPROCESSABLE_ENTITY, {"error": fencing})
            return
        ledger = self.server.ledger
        if ledger.fire("lookup_unavailable", cid):
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, {"error": "replica lagging; try later"})
            return
        outcome, detail = _strs(
            ledger._lookup(
                keys=[ledger.keys.fences, ledger.keys.corrections],
                args=[fencing[0], fencing[1], cid],
            )
        )
        if self._refused(outcome, detail):
            return
        if outcome == "absent":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no correction {cid}", "absent": True})
        else:
            self._send(HTTPStatus.OK, {"correction": json.loads(detail)})

    def post_ticket(self, path: str, query: dict[str, list[str]]) -> None:
        got = self._mutation(TICKET_FIELDS)
        if got is None:
            return
        ref = str(got[0]["ref"])
        ledger = self.server.ledger
        committed = self._commit(
            got, ref, ledger._ticket, keys=[ledger.keys.effects, ledger.keys.tickets], args=[ref]
        )
        if committed is not None:
            self._send(HTTPStatus.CREATED, {"ticket": ref, "status": "filed"})


def _strs(raw: Any) -> tuple[str, str]:
    a, b = raw
    return (
        a.decode() if isinstance(a, bytes) else str(a),
        b.decode() if isinstance(b, bytes) else str(b),
    )


_PATTERNS = (
    (re.compile(r"^/ledgers/[^/]+$"), "/ledgers/{n}"),
    (re.compile(r"^/corrections/idempotent$"), "/corrections/idempotent"),
    (re.compile(r"^/corrections/plain$"), "/corrections/plain"),
    (re.compile(r"^/corrections/[^/]+$"), "/corrections/{id}"),
    (re.compile(r"^/tickets$"), "/tickets"),
    (re.compile(r"^/effects$"), "/effects"),
    (re.compile(r"^/fence$"), "/fence"),
)


def _route_name(path: str) -> str:
    for pattern, name in _PATTERNS:
        if pattern.match(path):
            return name
    return path


ROUTES = {
    ("GET", "/ledgers/{n}"): Handler.get_ledger,
    ("GET", "/effects"): Handler.get_effects,
    ("GET", "/corrections/{id}"): Handler.get_correction,
    ("POST", "/corrections/idempotent"): Handler.post_idempotent,
    ("POST", "/corrections/plain"): Handler.post_plain,
    ("POST", "/tickets"): Handler.post_ticket,
    ("POST", "/fence"): Handler.post_fence,
}


class LedgerServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], ledger: Ledger) -> None:
        super().__init__(address, Handler)
        self.ledger = ledger


def make_server(
    settings: Settings, namespace: str, *, port: int = 0, faults: Faults | None = None
) -> LedgerServer:
    """A bound (not yet serving) ledger server; ``server.server_port`` is its port."""
    client = redis_client(settings)
    ledger = Ledger(client, Keys(settings.redis_key_prefix, namespace), faults or Faults())
    ledger.seed()
    return LedgerServer(("127.0.0.1", port), ledger)


def serve_in_thread(server: LedgerServer) -> threading.Thread:
    thread = threading.Thread(target=server.serve_forever, name="ledger", daemon=True)
    thread.start()
    return thread


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runlog.demo ledger", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--namespace", required=True, help="isolates this ledger's Redis keys")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--faults", default="", help="JSON fault plan (see the module doc)")


def run(args: argparse.Namespace) -> int:
    server = make_server(
        Settings(), args.namespace, port=args.port, faults=Faults.parse(args.faults)
    )
    # The supervisor reads this line to learn the port.
    print(f"ledger listening on 127.0.0.1:{server.server_port}", flush=True)

    def stop(signum: int, frame: object) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        server.ledger.redis.close()
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
