"""Identities: run ids, idempotency keys, Kafka partitions.

The idempotency key format is the deduplication identity receivers store. A released key
scheme never changes: a changed scheme would make every in-flight retry look like a new
business operation. A new scheme is added beside the old ones (``KEY_SCHEMES``), and a run
whose log already holds keys of an older scheme goes on computing keys of that scheme.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import time
import unicodedata
from collections.abc import Iterable

from runlog.errors import InvalidRecordKey, InvalidRunId, InvalidTenant

MAX_RUN_ID_LEN = 200
"""Longest run id accepted, in characters (the id is the Kafka key of every event)."""

RUN_ID_CHARS = "ASCII letters, digits and - _ . : @"
"""The documented run id alphabet, as the error messages spell it."""

_RUN_ID = re.compile(r"[A-Za-z0-9_.:@-]+")


def new_run_id() -> str:
    """Time-ordered run id: ``r`` + 12 hex digits of Unix ms + 16 random hex digits.

    The time prefix lets a reader find where the run starts with ``offsets_for_times``.
    """
    return f"r{int(time.time() * 1000):012x}{os.urandom(8).hex()}"


def run_id_time_ms(run_id: str) -> int | None:
    """The creation time embedded in a runlog run id; None for caller-chosen ids."""
    if len(run_id) == 29 and run_id[0] == "r":
        try:
            return int(run_id[1:13], 16)
        except ValueError:
            return None
    return None


def check_run_id(run_id: str) -> str:
    """``run_id`` if it is a valid run id, else ``InvalidRunId`` naming what is wrong.

    A run id is 1 to ``MAX_RUN_ID_LEN`` characters from ``RUN_ID_CHARS``. It is the Kafka
    key, part of every Redis key of the run and of the uncertain-call field
    ``<run>\x1f<key>``: an empty id, a control character (``\x1f`` splits that field),
    a glob character (``*?[]`` would widen a key scan) or braces (a Redis Cluster hash tag)
    would let one run's keys be read as another's. Ids from ``new_run_id`` always pass.
    """
    if not isinstance(run_id, str):
        raise InvalidRunId(f"run id must be a string, not {type(run_id).__name__}")
    if not run_id:
        raise InvalidRunId("run id is empty")
    if len(run_id) > MAX_RUN_ID_LEN:
        raise InvalidRunId(
            f"run id {run_id[:40]!r}... is {len(run_id)} characters long; "
            f"at most {MAX_RUN_ID_LEN} are allowed"
        )
    if _RUN_ID.fullmatch(run_id) is None:
        bad = next(c for c in run_id if _RUN_ID.fullmatch(c) is None)
        raise InvalidRunId(
            f"run id {run_id!r} holds {bad!r}; a run id may hold only {RUN_ID_CHARS}"
        )
    return run_id


def decode_key(raw: bytes | None) -> str:
    """The run id a record's Kafka key names; ``InvalidRecordKey`` if it names none.

    Every reader that turns a key into a run id goes through here, so a key that is
    missing, not UTF-8 or not a valid run id never becomes a run (decoding with
    replacement would merge distinct byte strings into one run id).
    """
    if raw is None:
        raise InvalidRecordKey("record has no key; every event is keyed by its run id")
    try:
        text = bytes(raw).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidRecordKey(
            f"record key {bytes(raw)[:60]!r} is not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from exc
    try:
        return check_run_id(text)
    except InvalidRunId as exc:
        raise InvalidRecordKey(f"record key is not a valid run id: {exc}") from exc


TENANT_FORBIDDEN = ":{}*"
"""Characters no tenant name may hold (besides the invisible ones, ``tenant_problem``)."""

_INVISIBLE_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})
# Bidirectional controls, named although they are all Cf: the reason the rule exists.
_BIDI_CONTROLS = frozenset([*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F])


def tenant_problem(tenant: str) -> str | None:
    """Why ``tenant`` cannot be a tenant name, or None if it can (``check_tenant``)."""
    if not isinstance(tenant, str):
        return f"a tenant name must be a string, not {type(tenant).__name__}"
    if not tenant:
        return "a tenant name must not be empty"
    for c in tenant:
        if c == ":":
            # Redis keys spell {tenant:run_id}: tenant "a:x" with run "y" would share the
            # lease (and so fence) tenant "a" with run "x:y".
            return "':' separates the tenant from the run id in Redis keys"
        if c in "{}":
            # {tenant:run_id} is the Redis Cluster hash tag of the run's keys: a brace
            # would empty it or move it, and scatter one run's keys over several slots.
            return f"{c!r} would break the Redis Cluster hash tag {{tenant:run_id}}"
        if c == "*":
            return "'*' means every tenant to the console's tokens"
        if ord(c) in _BIDI_CONTROLS:
            return f"{c!a} is a bidirectional control: the name would not read as it is"
        category = unicodedata.category(c)
        if category in _INVISIBLE_CATEGORIES or (category == "Zs" and c != " "):
            name = unicodedata.name(c, f"U+{ord(c):04X}")
            return f"{c!a} ({name}, category {category}) is invisible or a control character"
    return None


@functools.lru_cache(maxsize=1024)
def check_tenant(tenant: str) -> str:
    """``tenant`` if it is a valid tenant name, else ``InvalidTenant`` naming it and why.

    A tenant name is a non-empty string of visible characters (plain spaces allowed)
    without ``:``, ``{``, ``}`` or ``*``. It is part of every Redis key of its runs and
    of every idempotency key, it is shown to the people who decide on its runs, and
    ``*`` is the console's "all tenants": a name outside the rule could share another
    tenant's keys, break the Redis Cluster hash tag, widen a console token to every
    tenant, or pass for another tenant on screen (bidirectional overrides, zero-width
    characters). Remembered: every key of every step checks its tenant, and a process
    serves few tenants (a refused name raises, so it is never remembered).
    """
    problem = tenant_problem(tenant)
    if problem is not None:
        shown = ascii(tenant) if isinstance(tenant, str) else type(tenant).__name__
        raise InvalidTenant(f"tenant {shown} is refused: {problem}")
    return tenant


def run_tag(key_prefix: str, tenant: str, run_id: str) -> str:
    """``<prefix>:{tenant:run_id}``: every Redis key of a run starts with it.

    The braces are a Redis Cluster hash tag, so a run's lease, epoch, start index,
    decisions and snapshots live on one slot and its Lua scripts stay single-slot.
    """
    return f"{key_prefix}:{{{check_tenant(tenant)}:{run_id}}}"


def lease_key(key_prefix: str, tenant: str, run_id: str) -> str:
    """The run's lease: ``owner|epoch`` with a TTL, or ``owner|epoch|session`` bound to its
    owner's session (``producers._lease``)."""
    return f"{run_tag(key_prefix, tenant, run_id)}:lease"


def handover_key(key_prefix: str, tenant: str, run_id: str) -> str:
    """A note a draining owner leaves as it lets the run go (``LeaseManager.hand_over``):
    who let it go, for a short while (what a run's status shows as ``handed_over_by``)."""
    return f"{run_tag(key_prefix, tenant, run_id)}:handover"


def live_key(key_prefix: str, session: str) -> str:
    """A process session's liveness key (a short TTL its process renews)."""
    return f"{key_prefix}:live:{session}"


def session_of(value: str) -> str | None:
    """The session a lease value (``owner|epoch|session``) is bound to; None: its own TTL."""
    parts = value.split("|")
    return parts[2] if len(parts) == 3 else None


def start_key(key_prefix: str, tenant: str, run_id: str) -> str:
    """The run's start index: ``partition:offset`` of its acknowledged RUN_STARTED."""
    return f"{run_tag(key_prefix, tenant, run_id)}:start"


KEY_SCHEME = 2
"""The scheme of new runs' keys. 1: 32 hex digits of sha256 over the fields joined with
``\x1f``, unescaped, so a scope or tool name holding ``\x1f`` could make two different
actions share a key. 2: ``k2_`` + 32 hex digits of sha256 over the canonical JSON array of
the fields: every field's boundaries are unambiguous."""

KEY_SCHEMES = (1, 2)
SCHEME_2_PREFIX = "k2_"


def idempotency_key(
    tenant: str, scope: str, tool: str, args_json: str, ordinal: int, *, scheme: int = KEY_SCHEME
) -> str:
    """Key of one logical action.

    ``scope`` is the run id, or a caller-given operation id that outlives the run;
    ``args_json`` is canonical JSON; ``ordinal`` numbers intentional repeats of the same
    (scope, tool, args) so that the second charge of seven dollars is a new action while
    a re-execution after a crash recomputes the same keys. Never include a model call id.
    ``scheme`` is the run's key scheme (``key_scheme_of`` its recorded keys).
    """
    check_tenant(tenant)
    if scheme == 1:
        # Released scheme: kept bit for bit so that runs begun under it resume with the
        # keys their receivers already hold.
        material = "\x1f".join((tenant, scope, tool, args_json, str(ordinal)))
        return hashlib.sha256(material.encode()).hexdigest()[:32]
    if scheme == 2:
        fields = ["runlog-key", 2, tenant, scope, tool, args_json, ordinal]
        text = json.dumps(fields, ensure_ascii=True, separators=(",", ":"))
        return SCHEME_2_PREFIX + hashlib.sha256(text.encode()).hexdigest()[:32]
    raise ValueError(f"unknown idempotency key scheme {scheme!r}; known: {KEY_SCHEMES}")


def scheme_of_key(key: str) -> int:
    """The scheme that produced ``key``."""
    return 2 if key.startswith(SCHEME_2_PREFIX) else 1


def key_scheme_of(recorded: Iterable[str]) -> int:
    """The scheme a run computes its keys with, given the keys its log already holds.

    A run that recorded a key of scheme 1 (begun before scheme 2 existed) stays on scheme
    1, so a re-execution after a crash recomputes the keys it already sent; any other run
    uses ``KEY_SCHEME``.
    """
    schemes = {scheme_of_key(k) for k in recorded}
    return min(schemes) if schemes else KEY_SCHEME


COMPENSATION_SUFFIX = "/compensate"
"""A compensation is recorded as a call of ``<tool>/compensate`` whose ``operation_id`` is
the key of the call it undoes; tool names may not end with it."""


def compensation_name(tool: str) -> str:
    """The name a compensation of ``tool``'s effects is recorded under."""
    return tool + COMPENSATION_SUFFIX


def compensated_tool(name: str) -> str | None:
    """The tool whose effect a call named ``name`` undoes; None for an ordinary call."""
    return name.removesuffix(COMPENSATION_SUFFIX) if name.endswith(COMPENSATION_SUFFIX) else None


def _murmur2(data: bytes) -> int:
    """Kafka's murmur2 (the Java client's default partitioner hash)."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (
            (data[i4 + 0] & 0xFF)
            + ((data[i4 + 1] & 0xFF) << 8)
            + ((data[i4 + 2] & 0xFF) << 16)
            + ((data[i4 + 3] & 0xFF) << 24)
        )
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    index = length & ~3
    if extra == 3:
        h ^= (data[index + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[index + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[index] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def partition_for(run_id: str, partitions: int) -> int:
    """The partition a run's events land in (murmur2, as ``partitioner=murmur2_random``)."""
    return (_murmur2(run_id.encode()) & 0x7FFFFFFF) % partitions
