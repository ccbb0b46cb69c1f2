"""Typed, frozen settings read from ``RUNLOG_*`` environment variables.

The variable names are a public contract: renaming one breaks every deployment.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    """Where runlog finds Kafka and Redis, and how it uses them."""

    model_config = SettingsConfigDict(env_prefix="RUNLOG_", frozen=True, extra="ignore")

    bootstrap_servers: str = "127.0.0.1:19092"
    """Kafka bootstrap servers (``RUNLOG_BOOTSTRAP_SERVERS``)."""

    redis_url: str = "redis://127.0.0.1:16379/0"
    """Redis URL for leases, projections and snapshots (``RUNLOG_REDIS_URL``)."""

    topic_prefix: str = "runlog"
    """Prefix of every topic runlog creates (``RUNLOG_TOPIC_PREFIX``)."""

    partitions: int = Field(default=6, ge=1)
    """Partitions of the events topic (``RUNLOG_PARTITIONS``)."""

    replication_factor: int = Field(default=1, ge=1)
    """Replication factor of runlog's topics; 3 in production (``RUNLOG_REPLICATION_FACTOR``)."""

    min_insync_replicas: int | None = Field(default=None, ge=1)
    """``min.insync.replicas`` of the events topic; default RF-1, at least 1."""

    lease_ttl_ms: int = Field(default=15_000, ge=200)
    """How long a run's writer lease lives without renewal (``RUNLOG_LEASE_TTL_MS``)."""

    delivery_timeout_ms: int = Field(default=30_000, ge=1_000)
    """How long an append may wait for the broker before its outcome is unknown."""

    redis_key_prefix: str = "runlog"
    """Prefix of every Redis key runlog writes (``RUNLOG_REDIS_KEY_PREFIX``)."""

    snapshot_interval: int = Field(default=0, ge=0)
    """Write a snapshot every N events of a run; 0 disables (``RUNLOG_SNAPSHOT_INTERVAL``)."""

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
    kafka_extra: dict[str, str] = Field(default_factory=dict)
    """Extra librdkafka properties as JSON (``RUNLOG_KAFKA_EXTRA='{"k": "v"}'``)."""

    redact_fields: Annotated[tuple[str, ...], NoDecode] = ()
    """JSON fields shown as ``[redacted]`` wherever tool arguments or results are shown
    (``runlog show``, the console), matched by key in any case:
    ``RUNLOG_REDACT_FIELDS=password,card_number``. The log itself keeps what was written."""

    @field_validator("redact_fields", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(f.strip() for f in value.split(",") if f.strip())
        return value

    @property
    def events_topic(self) -> str:
        return f"{self.topic_prefix}.events"

    @property
    def quarantine_topic(self) -> str:
        return f"{self.topic_prefix}.quarantine"

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
        conf.update(self.kafka_extra)
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
