"""Typed, frozen settings read from ``RUNLOG_*`` environment variables.

The variable names are a public contract: renaming one breaks every deployment.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict, SettingsError

from runlog.errors import ConfigError

# librdkafka property names that set the same thing: a user's spelling must displace
# runlog's default of the other one, or librdkafka would apply whichever came last.
_ALIASES: tuple[frozenset[str], ...] = (
    frozenset({"linger.ms", "queue.buffering.max.ms"}),
    frozenset({"acks", "request.required.acks"}),
    frozenset({"max.in.flight.requests.per.connection", "max.in.flight"}),
    frozenset({"delivery.timeout.ms", "message.timeout.ms"}),
)


def _spellings(name: str) -> frozenset[str]:
    for group in _ALIASES:
        if name in group:
            return group
    return frozenset({name})


def _guarantee_broken(name: str, value: Any) -> str | None:
    """Why a producer property would break one of runlog's guarantees, or None."""
    text = str(value).strip().lower()
    if name == "enable.idempotence" and text not in ("true", "1"):
        return "the producer must be idempotent (no duplicates or reordering on retry)"
    if name in _spellings("acks") and text not in ("all", "-1"):
        return "acks must be all (-1): an acknowledged event must be on every in-sync replica"
    if name in _spellings("max.in.flight"):
        try:
            n = int(text)
        except ValueError:
            return "max in-flight requests must be an integer from 1 to 5"
        if not 1 <= n <= 5:
            return "more than 5 in-flight requests lose the idempotent producer's ordering"
    if name == "partitioner" and text != "murmur2_random":
        return "readers locate a run by Java's murmur2 hash of its id (murmur2_random)"
    return None


def _invalid(cls: type[BaseSettings], exc: ValidationError) -> str:
    """One line per wrong setting: its variable, what is wrong, and the value given unless
    it is a secret."""
    lines = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err["loc"] else "?"
        field = cls.model_fields.get(name)
        secret = field is not None and "SecretStr" in str(field.annotation)
        given = "" if secret else f" (given {str(err.get('input'))[:80]!r})"
        lines.append(f"RUNLOG_{name.upper()}: {err['msg']}{given}")
    return "invalid settings: " + "; ".join(lines)


class Settings(BaseSettings):
    """Where runlog finds Kafka and Redis, and how it uses them."""

    model_config = SettingsConfigDict(env_prefix="RUNLOG_", frozen=True, extra="ignore")

    def __init__(self, **values: Any) -> None:
        """Read from ``values`` and the ``RUNLOG_*`` environment; ``ConfigError`` naming
        each variable that is wrong, and why (a secret's value is never repeated)."""
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise ConfigError(_invalid(type(self), exc)) from None
        except SettingsError as exc:  # a RUNLOG_* value that must be JSON and is not
            raise ConfigError(f"a RUNLOG_* setting does not parse: {exc}") from None

    bootstrap_servers: str = "127.0.0.1:19092"
    """Kafka bootstrap servers (``RUNLOG_BOOTSTRAP_SERVERS``)."""

    redis_url: str = "redis://127.0.0.1:16379/0"
    """Redis URL for leases, projections and snapshots (``RUNLOG_REDIS_URL``)."""

    redis_cluster: bool = False
    """``RUNLOG_REDIS_CLUSTER``: ``RUNLOG_REDIS_URL`` names a node of a Redis Cluster; the
    client discovers the others and follows the cluster's redirections."""

    topic_prefix: str = "runlog"
    """Prefix of every topic runlog creates (``RUNLOG_TOPIC_PREFIX``): ``<prefix>.events``
    and ``<prefix>.quarantine``."""

    partitions: int = Field(default=6, ge=1)
    """Partitions of the events topic and of the quarantine topic (``RUNLOG_PARTITIONS``).
    Every reader and every new run refuses a topic whose count differs (``ConfigError``)."""

    replication_factor: int = Field(default=1, ge=1)
    """Replication factor of runlog's topics; 3 in production (``RUNLOG_REPLICATION_FACTOR``)."""

    min_insync_replicas: int | None = Field(default=None, ge=1)
    """``min.insync.replicas`` of runlog's topics (``RUNLOG_MIN_INSYNC_REPLICAS``); default
    RF-1, at least 1."""

    lease_ttl_ms: int = Field(default=15_000, ge=200)
    """How long a run's writer lease lives without renewal (``RUNLOG_LEASE_TTL_MS``)."""

    liveness_ttl_ms: int = Field(default=2_000, ge=0)
    """How long a process's liveness key lives without renewal (``RUNLOG_LIVENESS_TTL_MS``;
    renewed eight times a TTL, one command per process whatever the number of its runs).
    A run lease names its owner's session and lasts as long as that key: a dead worker's
    runs are free this long after its last renewal, or 0.4 of it (and 0.3 s) when its
    process is gone (its subscription to the session dropped). The smaller of this and
    ``lease_ttl_ms`` applies. 0: each lease has its own TTL (``lease_ttl_ms``), renewed
    per run."""

    worker_group: str | None = None
    """Consumer group of the worker fleet (``RUNLOG_WORKER_GROUP``); default
    ``<prefix>.workers``. Workers of one group share the runs by partition."""

    worker_session_timeout_ms: int = Field(default=10_000, ge=1_000)
    """How long the group waits for a silent worker before moving its partitions
    (``RUNLOG_WORKER_SESSION_TIMEOUT_MS``; the broker's ``group.min.session.timeout.ms``,
    6 s by default, is the floor). Heartbeats go every third of it."""

    worker_drain_s: float = Field(default=20.0, ge=0)
    """How long a SIGTERMed worker lets its runs finish the step they are in before it exits
    (``RUNLOG_WORKER_DRAIN_S``). Kubernetes kills a pod ``terminationGracePeriodSeconds``
    (30 s by default) after its SIGTERM: keep this below that, with room for the longest
    tool call's completion to be recorded and the process to exit
    (docs/howto/kubernetes.md)."""

    delivery_timeout_ms: int = Field(default=30_000, ge=1_000)
    """How long an append may wait for the broker before its outcome is unknown."""

    redis_key_prefix: str = "runlog"
    """Prefix of every Redis key runlog writes (``RUNLOG_REDIS_KEY_PREFIX``)."""

    snapshot_interval: int = Field(default=0, ge=0)
    """Write a snapshot every N events of a run; 0 disables (``RUNLOG_SNAPSHOT_INTERVAL``)."""

    schema_registry_url: str | None = None
    """A Confluent-compatible schema registry (``RUNLOG_SCHEMA_REGISTRY_URL``): writers then
    emit Confluent's wire format. Unset: single-object encoding. Readers accept both."""
    schema_registry_auth: SecretStr | None = None
    """``user:password`` for the registry's basic auth (``RUNLOG_SCHEMA_REGISTRY_AUTH``)."""
    schema_registry_timeout_ms: int = Field(default=10_000, ge=100)
    """How long one request may wait for the registry's answer
    (``RUNLOG_SCHEMA_REGISTRY_TIMEOUT_MS``): a registry that accepts connections but does
    not answer is then unavailable (readers retry, writers stop), not a hang."""

    # SASL/TLS passthrough. Secrets are SecretStr so they never print or serialise.
    security_protocol: str | None = None
    """librdkafka ``security.protocol`` (``RUNLOG_SECURITY_PROTOCOL``)."""
    sasl_mechanism: str | None = None
    """librdkafka ``sasl.mechanism`` (``RUNLOG_SASL_MECHANISM``)."""
    sasl_username: str | None = None
    """librdkafka ``sasl.username`` (``RUNLOG_SASL_USERNAME``)."""
    sasl_password: SecretStr | None = None
    """librdkafka ``sasl.password`` (``RUNLOG_SASL_PASSWORD``)."""
    ssl_ca_location: str | None = None
    """librdkafka ``ssl.ca.location`` (``RUNLOG_SSL_CA_LOCATION``)."""
    ssl_certificate_location: str | None = None
    """librdkafka ``ssl.certificate.location``."""
    ssl_key_location: str | None = None
    """librdkafka ``ssl.key.location``."""
    ssl_key_password: SecretStr | None = None
    """librdkafka ``ssl.key.password``."""
    redis_password: SecretStr | None = None
    """Redis password, if not in the URL (``RUNLOG_REDIS_PASSWORD``)."""
    redis_username: str | None = None
    """Redis ACL user (``RUNLOG_REDIS_USERNAME``); unset: the ``default`` user."""
    redis_ssl_ca: str | None = None
    """CA file that signed the Redis server's certificate, for ``rediss://`` URLs
    (``RUNLOG_REDIS_SSL_CA``); unset: the system's trust store."""
    kafka_extra: dict[str, SecretStr] = Field(default_factory=dict)
    """Extra librdkafka properties as JSON (``RUNLOG_KAFKA_EXTRA='{"k": "v"}'``).

    Values are secrets (OAuth client secrets, keystore passwords often go here), so they
    never print; the property names do. A producer tunable set here wins over runlog's
    default; one that would break a guarantee (idempotence off, ``acks`` other than all,
    more than 5 requests in flight, another partitioner) is refused with ``ConfigError``.
    """

    approval_deadline_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    """Deadline of the approval an escalated call asks for, in seconds from the request
    (``RUNLOG_APPROVAL_DEADLINE_S``); unset: no deadline. ``run.request_approval`` takes
    its own ``deadline_s``."""

    notify_webhook_url: str | None = None
    """Where ``runlog project notify`` POSTs a notification per approval requested
    (``RUNLOG_NOTIFY_WEBHOOK_URL``); ``--webhook`` overrides it."""

    notify_max_attempts: int = Field(default=10, ge=1)
    """Delivery attempts of one notification before it is recorded as failed
    (``RUNLOG_NOTIFY_MAX_ATTEMPTS``)."""

    notify_backoff_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    """Wait after a notification's first failed attempt, doubled after each one up to
    ``notify_backoff_cap_s`` (``RUNLOG_NOTIFY_BACKOFF_S``)."""

    notify_backoff_cap_s: float = Field(default=300.0, gt=0, allow_inf_nan=False)
    """Longest wait between two attempts (``RUNLOG_NOTIFY_BACKOFF_CAP_S``)."""

    notify_timeout_s: float = Field(default=10.0, gt=0, allow_inf_nan=False)
    """How long one webhook request may take (``RUNLOG_NOTIFY_TIMEOUT_S``)."""

    ui_url: str | None = None
    """Where the console is served (``RUNLOG_UI_URL``): notifications then link to the
    run's page."""

    decider_public_keys: str | None = None
    """File of the trusted deciders' Ed25519 public keys, one ``NAME BASE64-KEY`` a line
    (``RUNLOG_DECIDER_PUBLIC_KEYS``). Set: every reader accepts a decision only if one of
    these keys signed it; an unsigned or badly signed one is a forged decision, kept in the
    log and excluded from state. Unset: decisions are accepted unsigned, as before."""
    tenant_keys: str | None = None
    """Per-tenant record MACs (``RUNLOG_TENANT_KEYS``): a file of ``TENANT KEY_ID
    BASE64-SECRET`` lines (``runlog.schemas._tenant_mac``). A writer adds the MAC of its
    event's tenant; a reader rejects, like a fenced write, a record of a listed tenant
    without a valid one. Give a tenant's workers its line only, readers every line. Unset
    (or a tenant not listed): not checked."""
    decider_key_file: str | None = None
    """A decider's private key (``RUNLOG_DECIDER_KEY_FILE``, mode 0600): the CLI's
    approve/reject, the console and ``runlog.decide`` sign with it. Workers never hold it."""

    encryption: Literal["on", "off"] = "off"
    """``RUNLOG_ENCRYPTION``: ``on`` seals every content field a writer appends with its
    subject's data key (docs/concepts/encryption.md); readers open sealed fields whatever
    this says, as long as a KEK is given. Off by default, so a deployment without a KEK
    keeps working; production deployments that hold personal data turn it on."""
    kek: SecretStr | None = None
    """``RUNLOG_KEK``: the key-encryption keys, ``KEK_ID:BASE64-32-BYTES`` separated by
    commas or new lines; the LAST one wraps new data keys, the others only unwrap (until
    ``runlog keys rotate`` re-wrapped everything under the last). Or ``RUNLOG_KEK_FILE``."""
    kek_file: str | None = None
    """``RUNLOG_KEK_FILE``: a file (mode 0600) holding what ``RUNLOG_KEK`` would."""
    key_store: Literal["kafka", "file"] = "kafka"
    """``RUNLOG_KEY_STORE``: where wrapped data keys live. ``kafka`` (the default, as durable
    as the log): the compacted, replicated topic ``<prefix>.keys``. ``file``: one file per
    key under ``RUNLOG_KEY_DIR``, for development on one machine."""
    key_dir: str | None = None
    """``RUNLOG_KEY_DIR``: the ``file`` key store's directory."""
    keys_refresh_ms: int = Field(default=5_000, ge=0)
    """``RUNLOG_KEYS_REFRESH_MS``: how often a process re-reads the key store's news (a
    shred elsewhere), at most; a key it has never seen is looked up at once."""
    keys_segment_ms: int = Field(default=3_600_000, ge=1)
    """``segment.ms`` of the keys topic: compaction never touches the open segment, so a
    shredded key's wrapped bytes can outlive the shred by this much (plus the lag below)."""
    keys_max_compaction_lag_ms: int = Field(default=86_400_000, ge=1)
    """``max.compaction.lag.ms`` of the keys topic: the longest a shredded key's record may
    wait, once its segment is closed, for compaction to remove it from disk."""
    keys_delete_retention_ms: int = Field(default=86_400_000, ge=0)
    """``delete.retention.ms`` of the keys topic: how long a shred's tombstone stays, so a
    process that was offline still learns of it while catching up."""

    redact_fields: Annotated[tuple[str, ...], NoDecode] = ()
    """Comma-separated field names shown as ``[redacted]`` wherever tool arguments,
    results, evidence or errors are printed (``runlog show``, the console, ``runlog
    uncertain|audit|state``, ``runlog replay --state``), matched by key in any case: in JSON
    at any depth, in JSON held in string values (8 levels) and, in text that is not JSON
    (a cut result), by ``"field": value`` / ``field=value``:
    ``RUNLOG_REDACT_FIELDS=password,card_number``. The log itself keeps what was written."""

    @field_validator("redact_fields", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(f.strip() for f in value.split(",") if f.strip())
        return value

    def fingerprint(self) -> str:
        """A digest of every setting, secrets included (to tell settings apart; never
        printed): two settings that differ only in a secret have different fingerprints."""
        values = {
            name: v.get_secret_value() if isinstance(v, SecretStr) else v
            for name, v in self.model_dump().items()
        }
        values["kafka_extra"] = self.kafka_common()
        text = json.dumps(values, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def events_topic(self) -> str:
        return f"{self.topic_prefix}.events"

    @property
    def quarantine_topic(self) -> str:
        return f"{self.topic_prefix}.quarantine"

    @property
    def keys_topic(self) -> str:
        """The wrapped data keys (compacted; docs/concepts/encryption.md)."""
        return f"{self.topic_prefix}.keys"

    @property
    def fleet_group(self) -> str:
        """The consumer group of the worker fleet (``RUNLOG_WORKER_GROUP`` or the default)."""
        return self.worker_group or f"{self.topic_prefix}.workers"

    @property
    def lifecycle_topic(self) -> str:
        """The fleet's run-lifecycle topic (compacted; docs/concepts/fleet.md)."""
        return f"{self.topic_prefix}.lifecycle"

    @property
    def effective_min_insync_replicas(self) -> int:
        if self.min_insync_replicas is not None:
            return self.min_insync_replicas
        return max(1, self.replication_factor - 1)

    def kafka_common(self) -> dict[str, Any]:
        """librdkafka properties shared by producers, consumers and the admin client."""
        conf: dict[str, Any] = {"bootstrap.servers": self.bootstrap_servers}
        optional = {
            "security.protocol": self.security_protocol,
            "sasl.mechanism": self.sasl_mechanism,
            "sasl.username": self.sasl_username,
            "sasl.password": self.sasl_password.get_secret_value() if self.sasl_password else None,
            "ssl.ca.location": self.ssl_ca_location,
            "ssl.certificate.location": self.ssl_certificate_location,
            "ssl.key.location": self.ssl_key_location,
            "ssl.key.password": (
                self.ssl_key_password.get_secret_value() if self.ssl_key_password else None
            ),
        }
        conf.update({k: v for k, v in optional.items() if v is not None})
        conf.update(
            {
                k: v.get_secret_value() if isinstance(v, SecretStr) else v
                for k, v in self.kafka_extra.items()
            }
        )
        return conf

    def durable_producer_config(self, extra: dict[str, Any] | None = None) -> dict[str, Any]:
        """librdkafka properties of every runlog producer.

        Tunables (``linger.ms``, ``delivery.timeout.ms``...) are runlog's defaults, and
        whatever the user set in ``RUNLOG_KAFKA_EXTRA`` (or a caller in ``extra``) wins.
        A property that would break a guarantee (idempotence, acks=all, at most 5
        requests in flight, the murmur2 partitioner) is refused with ``ConfigError``
        naming it, never silently replaced.
        """
        defaults: dict[str, Any] = {
            # Pipelined appends (those no one waits for) leave in batches; a barrier does
            # not wait out the linger: its wait is a flush, which sends what is queued at
            # once (``EventWriter.wait``).
            "linger.ms": 5,
            "delivery.timeout.ms": self.delivery_timeout_ms,
            "max.in.flight.requests.per.connection": 5,
        }
        required: dict[str, Any] = {
            "enable.idempotence": True,
            "acks": "all",
            # Java's partitioner, so every client agrees where a run lives.
            "partitioner": "murmur2_random",
        }
        given = {**self.kafka_common(), **(extra or {})}
        for name, value in given.items():
            why = _guarantee_broken(name, value)
            if why is not None:
                source = "extra" if extra and name in extra else "RUNLOG_KAFKA_EXTRA"
                raise ConfigError(f"producer property {name}={value!r} (from {source}): {why}")
        conf: dict[str, Any] = {}
        for name, value in {**defaults, **required}.items():
            if not _spellings(name) & given.keys():
                conf[name] = value
        conf.update(given)
        return conf

    def as_env(self) -> dict[str, str]:
        """Non-secret settings as ``RUNLOG_*`` variables, for ``eval "$(runlog stack env)"``."""
        out: dict[str, str] = {}
        for name in (
            "bootstrap_servers",
            "redis_url",
            "topic_prefix",
            "partitions",
            "replication_factor",
            "lease_ttl_ms",
        ):
            out[f"RUNLOG_{name.upper()}"] = str(getattr(self, name))
        return out
