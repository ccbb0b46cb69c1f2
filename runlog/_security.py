"""Least-privilege roles: the Kafka ACLs and Redis ACL rules each runlog role needs.

One declaration serves the local secure stack (``runlog stack up --secure`` creates the
principals and the Redis users) and production (``runlog topics create`` run by an admin
against a SASL cluster sets the topic ACLs; :func:`redis_acl_rules` prints the Redis
users). docs/howto/security.md lists the same table for people.

Roles:

* **worker** (agent workers): append to the events topic (idempotent producer), read it
  back through runlog's readers, and in Redis only the run keys (``<prefix>:{tenant:run}``:
  lease, epoch, start index, decision inbox, snapshots), including the lease scripts.
* **projections** (projection services): read the events topic in their own consumer
  groups, write the quarantine topic, and in Redis only the projection keys
  (``<prefix>:proj:...``); no scripts, so no lease can be touched.
* **analytics** (analytics readers): read the events topic in their own groups; no Redis.
* **operator** (the CLI's reads, approve/reject, rebuilds): a decision is recorded like a
  worker's append (it takes the free run's lease), a rebuild is a projection catch-up,
  so it has both sets of keys; it cannot create, delete or reconfigure topics or ACLs.
* **admin**: a super user of the broker (creates topics and ACLs) and of Redis.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from runlog._settings import Settings
from runlog.errors import ConfigError

__all__ = [
    "DEFAULT_PRINCIPALS",
    "READER_GROUP_PREFIX",
    "ROLES",
    "AclSpec",
    "analytics_group_prefix",
    "clients_authenticate",
    "ensure_acls",
    "kafka_acls",
    "projection_group_prefix",
    "redis_acl_rules",
]

_log = logging.getLogger("runlog._security")

ROLES = ("worker", "projections", "analytics", "operator")
"""The least-privilege roles; ``admin`` is a super user and needs no ACL."""

DEFAULT_PRINCIPALS: Mapping[str, str] = {role: f"User:runlog-{role}" for role in ROLES}
"""Kafka principals of the roles; SASL/SCRAM user ``runlog-<role>`` gives ``User:runlog-<role>``."""

# The group ids runlog's own consumers use (runlog.log._reader, consumers.runner,
# consumers._projection_metrics): an ACL on a prefix covers every generated suffix. Readers
# that only assign() and never commit still need it: librdkafka asks the group coordinator.
READER_GROUP_PREFIX = "runlog-reader-"
METRICS_GROUP_PREFIX = "runlog-metrics-"


def projection_group_prefix(settings: Settings) -> str:
    """Projection services' groups: ``<prefix>.projection.<names>`` and their catch-ups."""
    return f"{settings.topic_prefix}.projection."


def analytics_group_prefix(settings: Settings) -> str:
    """Analytics readers' groups: ``<prefix>.analytics...`` (choose any suffix)."""
    return f"{settings.topic_prefix}.analytics"


@dataclass(frozen=True)
class AclSpec:
    """One ALLOW ACL: ``principal`` may ``operation`` on ``resource`` from any host."""

    principal: str
    resource_type: str
    """``topic``, ``group`` or ``cluster``."""
    name: str
    pattern: str
    """``literal`` or ``prefixed``."""
    operation: str
    """Kafka operation name: ``read``, ``write``, ``describe``, ``idempotent_write``..."""

    def __str__(self) -> str:
        how = "" if self.pattern == "literal" else f" ({self.pattern})"
        return (
            f"{self.principal}: {self.operation.upper()} on {self.resource_type} {self.name}{how}"
        )


def kafka_acls(
    settings: Settings, principals: Mapping[str, str] | None = None
) -> tuple[AclSpec, ...]:
    """The ALLOW ACLs of every role for ``settings``' topics; nothing else is allowed."""
    p = {**DEFAULT_PRINCIPALS, **(principals or {})}
    events, quarantine = settings.events_topic, settings.quarantine_topic
    out: list[AclSpec] = []

    def add(role: str, rtype: str, name: str, ops: Iterable[str], pattern: str = "literal") -> None:
        out.extend(AclSpec(p[role], rtype, name, pattern, op) for op in ops)

    # Idempotent producers: Write on the topic is what Kafka 3+ checks for InitProducerId;
    # IdempotentWrite on the cluster keeps older brokers (and their docs) happy.
    add("worker", "topic", events, ("write", "read", "describe"))
    add("worker", "cluster", "kafka-cluster", ("idempotent_write",))
    add("worker", "group", READER_GROUP_PREFIX, ("read",), "prefixed")
    # The fleet (docs/concepts/fleet.md): `runlog worker` follows the lifecycle topic in
    # its group and writes waits and tombstones; starts, decisions and resumes write to it.
    lifecycle = settings.lifecycle_topic
    add("worker", "topic", lifecycle, ("write", "read", "describe"))
    add("worker", "group", settings.fleet_group, ("read",))

    # The wrapped data keys (docs/concepts/encryption.md): workers make keys and read them
    # back; projection services only open (read); operators shred and rotate (write).
    # Analytics readers get none: they see the sealed envelope, or a key granted outside.
    keys = settings.keys_topic
    add("worker", "topic", keys, ("write", "read", "describe"))

    add("projections", "topic", events, ("read", "describe"))
    add("projections", "topic", keys, ("read", "describe"))
    add("projections", "topic", quarantine, ("write", "describe"))
    add("projections", "group", projection_group_prefix(settings), ("read",), "prefixed")

    add("analytics", "topic", events, ("read", "describe"))
    add("analytics", "group", analytics_group_prefix(settings), ("read",), "prefixed")

    # Decisions are appends (the free run's lease is taken), rebuilds are projection
    # catch-ups, `runlog topics check` describes configs: nothing that changes a topic.
    # Reading the quarantine topic lets an operator inspect the original records with
    # standard Kafka tools; analytics readers never see them.
    add("operator", "topic", events, ("write", "read", "describe", "describe_configs"))
    add("operator", "topic", quarantine, ("write", "read", "describe", "describe_configs"))
    add("operator", "topic", lifecycle, ("write", "describe"))
    add("operator", "topic", keys, ("write", "read", "describe", "describe_configs"))
    add("operator", "cluster", "kafka-cluster", ("idempotent_write",))
    for group in (READER_GROUP_PREFIX, METRICS_GROUP_PREFIX, projection_group_prefix(settings)):
        add("operator", "group", group, ("read",), "prefixed")
    return tuple(out)


def clients_authenticate(settings: Settings) -> bool:
    """True when the client authenticates (so the broker may enforce ACLs)."""
    return (settings.security_protocol or "").upper() in ("SASL_SSL", "SASL_PLAINTEXT", "SSL")


def _binding(spec: AclSpec) -> Any:
    from confluent_kafka.admin import (  # type: ignore[attr-defined]
        AclBinding,
        AclOperation,
        AclPermissionType,
        ResourcePatternType,
        ResourceType,
    )

    # librdkafka names Kafka's CLUSTER resource type BROKER (the same wire value, 4).
    rtype = "BROKER" if spec.resource_type == "cluster" else spec.resource_type.upper()
    return AclBinding(
        ResourceType[rtype],
        spec.name,
        ResourcePatternType[spec.pattern.upper()],
        spec.principal,
        "*",
        AclOperation[spec.operation.upper()],
        AclPermissionType.ALLOW,
    )


def ensure_acls(
    admin: Any,
    settings: Settings,
    principals: Mapping[str, str] | None = None,
    *,
    timeout: float = 30.0,
) -> tuple[AclSpec, ...]:
    """Create the roles' ACLs with ``admin`` (an AdminClient of a super user); idempotent.

    Kafka keeps one copy of an identical binding, so running it twice changes nothing.
    """
    from confluent_kafka import KafkaException

    # One principal may hold two roles (e.g. a small deployment's worker also operates);
    # the admin API refuses a request that names the same binding twice.
    specs = tuple(dict.fromkeys(kafka_acls(settings, principals)))
    try:
        futures = admin.create_acls([_binding(s) for s in specs], request_timeout=timeout)
        for fut in futures.values():
            fut.result(timeout=timeout)
    except KafkaException as exc:
        err = exc.args[0] if exc.args else exc
        raise ConfigError(
            f"creating the roles' ACLs on {settings.bootstrap_servers} as "
            f"{settings.sasl_username or 'an anonymous client'} was refused: {err} "
            "(`runlog topics create` sets ACLs only when run by a super user)"
        ) from exc
    return specs


# --------------------------------------------------------------------------- Redis

# Commands a role may run besides what its categories give. Scripts are named one by one
# (EVAL_RO, FUNCTION, SCRIPT FLUSH/KILL are not needed); @dangerous (FLUSHALL, KEYS,
# CONFIG, MONITOR, DEBUG, MIGRATE...) is removed from everybody but the admin: FLUSHALL
# and KEYS ignore key patterns.
_BASE = "resetkeys resetchannels -@all +@connection +@read +@write +@transaction"
_SCRIPTS = "+eval +evalsha +script|load +script|exists"


def redis_acl_rules(key_prefix: str) -> dict[str, str]:
    """ACL SETUSER rules (without ``on``/passwords) per role with a Redis user.

    Run keys are ``<prefix>:{tenant:run}...`` (schemas._keys.run_tag), projection keys
    ``<prefix>:proj:...`` (consumers._store.ProjectionKeys); analytics has no Redis user.
    """
    if not key_prefix or any(c in key_prefix for c in " *?[]\\{}"):
        raise ConfigError(f"Redis key prefix {key_prefix!r} cannot be used in an ACL pattern")
    runs = f"~{key_prefix}:{{*"
    projections = f"~{key_prefix}:proj:*"
    # A process's session (producers._lease: the liveness key its leases refer to, the
    # hash of sessions) and a worker's held set (the runs another worker adopts when the
    # session dies): every process that takes a lease, or tells who holds one, needs them.
    # A process also subscribes to its session's channel (named as the liveness key), and
    # a worker counts a silent session's subscribers (``LeaseManager.bury``).
    sessions = (
        f"~{key_prefix}:live:* ~{key_prefix}:sessions ~{key_prefix}:held:* "
        f"&{key_prefix}:live:* +subscribe +unsubscribe +pubsub|numsub"
    )
    # The fleet: each worker's presence entry (which agents it serves, read by a start
    # that requires a worker), a reconcile request's reply (the worker writes it, the
    # operator reads it), the list a draining worker announces its runs on, and the one it
    # says which runs are coming on (``fleet.handoffs``).
    fleet = (
        f"~{key_prefix}:workers:* ~{key_prefix}:reconcile:* ~{key_prefix}:handoffs "
        f"~{key_prefix}:handoffs:coming"
    )
    # Records an operator set aside (runlog.log._setaside): every reader of runs skips them,
    # so every role that reads runs reads the list; only the operator writes it.
    set_aside = f"{key_prefix}:setaside:*"
    operator_only = f"~{set_aside} ~{key_prefix}:retention"
    return {
        "worker": f"{_BASE} {_SCRIPTS} -@dangerous {runs} {sessions} {fleet} %R~{set_aside}",
        "projections": f"{_BASE} -@dangerous {projections} %R~{set_aside}",
        "operator": (
            f"{_BASE} {_SCRIPTS} -@dangerous {runs} {projections} {sessions} {fleet} "
            f"{operator_only}"
        ),
        "admin": "resetkeys resetchannels +@all ~* &*",
    }
