"""Where the local stack lives and listens: its ports, state dirs, nodes and the
status it reports (``StackConfig.from_env``; the environment overrides are in the
package docstring).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from runlog.errors import StackError
from runlog.stack import _secure as _secure

_HERE = Path(__file__).resolve().parent
POM_PATH = _HERE / "pom.xml"
LOG4J2_PATH = _HERE / "log4j2.properties"

DEFAULT_KAFKA_PORT = 19092
DEFAULT_CONTROLLER_PORT = 19093
DEFAULT_REDIS_PORT = 16379
DEFAULT_CLUSTER_KAFKA_PORT = 29092
DEFAULT_CLUSTER_CONTROLLER_PORT = 29093
DEFAULT_CLUSTER_REDIS_PORT = 26379
DEFAULT_SECURE_KAFKA_PORT = 19192
DEFAULT_SECURE_CONTROLLER_PORT = 19193
DEFAULT_SECURE_INTERNAL_PORT = 19194
DEFAULT_SECURE_REDIS_PORT = 16479
_DEFAULT_PORTS = {
    "STACK": {
        "KAFKA": DEFAULT_KAFKA_PORT,
        "CONTROLLER": DEFAULT_CONTROLLER_PORT,
        "REDIS": DEFAULT_REDIS_PORT,
    },
    "CLUSTER": {
        "KAFKA": DEFAULT_CLUSTER_KAFKA_PORT,
        "CONTROLLER": DEFAULT_CLUSTER_CONTROLLER_PORT,
        "REDIS": DEFAULT_CLUSTER_REDIS_PORT,
    },
    "SECURE": {
        "KAFKA": DEFAULT_SECURE_KAFKA_PORT,
        "CONTROLLER": DEFAULT_SECURE_CONTROLLER_PORT,
        "REDIS": DEFAULT_SECURE_REDIS_PORT,
        "INTERNAL": DEFAULT_SECURE_INTERNAL_PORT,
    },
}
HOST = "127.0.0.1"

Echo = Callable[[str], None]


def _pom_kafka_version(pom_text: str) -> str:
    match = re.search(r"<kafka\.version>\s*([^<\s]+)\s*</kafka\.version>", pom_text)
    if match is None:  # pragma: no cover - the pom ships with the package
        raise StackError(f"{POM_PATH} does not define <kafka.version>")
    return match.group(1)


KAFKA_VERSION = _pom_kafka_version(POM_PATH.read_text(encoding="utf-8"))


def _env_int(environ: Mapping[str, str], name: str, default: int) -> int:
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise StackError(f"{name}={raw!r} is not a port number") from exc
    if not 0 < value < 65536:
        raise StackError(f"{name}={value} is not a valid port")
    return value


def _ports_checked(cfg: StackConfig) -> StackConfig:
    """``cfg`` when every port its nodes and Redis use is a port and no two are the same
    (a cluster's node i takes its kind's base ports + 2i); else ``StackError`` naming the
    variables that set them."""
    kafka_var, controller_var, redis_var = cfg.port_vars
    internal_var = kafka_var.replace("_KAFKA_PORT", "_INTERNAL_PORT")
    named = [
        (f"node {n.node_id}'s {what} port", port, var)
        for n in cfg.nodes()
        for what, port, var in (
            ("Kafka", n.kafka_port, kafka_var),
            ("controller", n.controller_port, controller_var),
            ("internal", n.internal_port, internal_var),
        )
        if port
    ]
    named.append(("Redis's port", cfg.redis_port, redis_var))
    seen: dict[int, tuple[str, str]] = {}
    for what, port, var in named:
        if port > 65535:
            raise StackError(f"{what} would be {port}, past 65535: lower {var}")
        if port in seen:
            other, other_var = seen[port]
            raise StackError(
                f"{other} and {what} would both be {port}: set {other_var} and {var} apart"
            )
        seen[port] = (what, var)
    return cfg


def _home_path(raw: str, home: Path) -> Path:
    """``raw`` as an absolute path, ``~`` being ``home`` (the environment's HOME)."""
    if raw == "~" or raw.startswith("~/"):
        raw = str(home) + raw[1:]
    return Path(raw).expanduser().absolute()


def _external_redis(url: str | None, redis_port: int) -> str | None:
    """``RUNLOG_REDIS_URL`` unless it names the stack's own Redis.

    After ``eval "$(runlog stack env)"`` the variable points at our own server; that must
    not turn it into an "external" Redis that ``up`` would not start and ``down`` not stop.
    """
    if not url:
        return None
    parsed = urlsplit(url)
    if parsed.hostname in (HOST, "localhost") and parsed.port == redis_port:
        return None
    return url


@dataclass(frozen=True)
class NodeSpec:
    """One Kafka KRaft node (broker + controller) of the local cluster."""

    node_id: int
    kafka_port: int
    controller_port: int
    dir: Path
    internal_port: int = 0
    """The secure stack's mutual-TLS inter-broker listener (0: none)."""

    @property
    def server_properties(self) -> Path:
        return self.dir / "server.properties"

    @property
    def data_dir(self) -> Path:
        return self.dir / "data"

    @property
    def log_dir(self) -> Path:
        return self.dir / "logs"

    @property
    def pid_file(self) -> Path:
        return self.dir / "kafka.pid"

    @property
    def stdout_log(self) -> Path:
        return self.log_dir / "stdout.log"

    @property
    def server_log(self) -> Path:
        return self.log_dir / "server.log"


@dataclass(frozen=True)
class StackConfig:
    """Where the stack lives and which ports it uses. Build with :meth:`from_env`."""

    state_dir: Path
    cache_dir: Path
    kafka_port: int = DEFAULT_KAFKA_PORT
    controller_port: int = DEFAULT_CONTROLLER_PORT
    redis_port: int = DEFAULT_REDIS_PORT
    external_redis_url: str | None = None
    kafka_heap: str = "512m"
    node_count: int = 1
    allow_install: bool = True
    secure: bool = False
    """TLS + SASL/SCRAM + ACLs on Kafka, TLS + ACL users on Redis (see runlog.stack._secure)."""
    internal_port: int = 0
    redis_key_prefix: str = "runlog"
    """Secure stack: the key prefix its Redis ACL users are limited to."""

    @classmethod
    def from_env(
        cls, environ: Mapping[str, str] | None = None, *, nodes: int = 1, secure: bool = False
    ) -> StackConfig:
        """The single-node stack (``nodes=1``), a cluster of ``nodes`` or the secure stack.

        The cluster and the secure stack have their own ports and state dirs, so each runs
        beside the plain single-node stack.
        """
        e = os.environ if environ is None else environ
        home = Path(e.get("HOME") or Path.home())
        if nodes < 1:
            raise StackError(f"a stack needs at least one node, not {nodes}")
        if secure and nodes != 1:
            raise StackError("the secure stack has one node (--secure with --nodes 1)")
        # Each kind reads its own RUNLOG_<KIND>_* variables and has its own default ports.
        plain = e.get("RUNLOG_STACK_DIR") or str(home / ".local/state/runlog/stack")
        if secure:
            kind, heap = "SECURE", "384m"
            state = e.get("RUNLOG_SECURE_DIR") or f"{plain.rstrip('/')}-secure"
        elif nodes > 1:
            kind, heap = "CLUSTER", "384m"
            state = e.get("RUNLOG_CLUSTER_DIR") or str(
                home / f".local/state/runlog/cluster-{nodes}"
            )
        else:
            kind, heap, state = "STACK", "512m", plain
        cache = e.get("RUNLOG_CACHE_DIR") or str(home / ".cache/runlog")

        def port(service: str) -> int:
            return _env_int(e, f"RUNLOG_{kind}_{service}_PORT", _DEFAULT_PORTS[kind][service])

        base = cls(
            state_dir=_home_path(state, home),
            cache_dir=_home_path(cache, home),
            kafka_port=port("KAFKA"),
            controller_port=port("CONTROLLER"),
            redis_port=port("REDIS"),
            kafka_heap=e.get(f"RUNLOG_{kind}_KAFKA_HEAP") or heap,
            allow_install=e.get("RUNLOG_STACK_NO_INSTALL", "").strip().lower()
            in ("", "0", "false", "no"),
        )
        if secure:
            return _ports_checked(
                replace(
                    base,
                    internal_port=port("INTERNAL"),
                    secure=True,
                    redis_key_prefix=e.get("RUNLOG_REDIS_KEY_PREFIX") or "runlog",
                )
            )
        if nodes > 1:
            return _ports_checked(replace(base, node_count=nodes))
        # Only the plain stack may use an external Redis instead of its own.
        external = _external_redis(e.get("RUNLOG_REDIS_URL"), base.redis_port)
        return _ports_checked(replace(base, external_redis_url=external))

    # Layout -------------------------------------------------------------------------
    @property
    def jars_dir(self) -> Path:
        return self.cache_dir / f"kafka-{KAFKA_VERSION}"

    @property
    def kafka_dir(self) -> Path:
        return self.state_dir / "kafka"

    @property
    def redis_dir(self) -> Path:
        return self.state_dir / "redis"

    @property
    def redis_pid_file(self) -> Path:
        return self.redis_dir / "redis.pid"

    @property
    def redis_log(self) -> Path:
        return self.redis_dir / "redis.log"

    @property
    def redis_conf(self) -> Path:
        return self.redis_dir / "redis.conf"

    @property
    def cluster_id_file(self) -> Path:
        return self.kafka_dir / "cluster.id"

    def nodes(self) -> tuple[NodeSpec, ...]:
        """The cluster's nodes; node i (from 0) uses Kafka port base+2i, controller base+2i."""
        return tuple(
            NodeSpec(
                node_id=i + 1,
                kafka_port=self.kafka_port + 2 * i,
                controller_port=self.controller_port + 2 * i,
                dir=self.kafka_dir / f"node-{i + 1}",
                internal_port=self.internal_port + 2 * i if self.internal_port else 0,
            )
            for i in range(self.node_count)
        )

    def node(self, node_id: int) -> NodeSpec:
        for n in self.nodes():
            if n.node_id == node_id:
                return n
        raise StackError(f"no Kafka node {node_id} in a {self.node_count}-node stack")

    @property
    def port_vars(self) -> tuple[str, str, str]:
        """Environment variables that move the Kafka, controller and Redis ports."""
        if self.secure:
            return (
                "RUNLOG_SECURE_KAFKA_PORT",
                "RUNLOG_SECURE_CONTROLLER_PORT",
                "RUNLOG_SECURE_REDIS_PORT",
            )
        if self.node_count > 1:
            return (
                "RUNLOG_CLUSTER_KAFKA_PORT",
                "RUNLOG_CLUSTER_CONTROLLER_PORT",
                "RUNLOG_CLUSTER_REDIS_PORT",
            )
        return (
            "RUNLOG_STACK_KAFKA_PORT",
            "RUNLOG_STACK_CONTROLLER_PORT",
            "RUNLOG_STACK_REDIS_PORT",
        )

    @property
    def bootstrap_servers(self) -> str:
        return ",".join(f"{HOST}:{n.kafka_port}" for n in self.nodes())

    @property
    def redis_url(self) -> str:
        if self.secure:
            return f"rediss://{HOST}:{self.redis_port}/0"
        return self.external_redis_url or f"redis://{HOST}:{self.redis_port}/0"

    def kafka_client_conf(self) -> dict[str, Any]:
        """librdkafka properties the stack's own checks use (the admin on a secure stack)."""
        if self.secure:
            return _secure.admin_kafka_conf(self)
        return {"bootstrap.servers": self.bootstrap_servers}

    def redis_client_kwargs(self) -> dict[str, Any]:
        """redis-py options the stack's own checks use (the admin user on a secure stack)."""
        return _secure.admin_redis_kwargs(self) if self.secure else {}


@dataclass(frozen=True)
class ServiceStatus:
    """One process of the stack (a Kafka node or Redis)."""

    name: str
    running: bool
    managed: bool
    """False when the service is external (``RUNLOG_REDIS_URL``): runlog never stops it."""
    address: str
    pid: int | None = None
    log_file: Path | None = None
    data_dir: Path | None = None


@dataclass(frozen=True)
class StackStatus:
    services: tuple[ServiceStatus, ...]
    bootstrap_servers: str
    redis_url: str
    state_dir: Path
    jars_dir: Path
    kafka_version: str = KAFKA_VERSION
    notes: tuple[str, ...] = field(default_factory=tuple)
    client_env: dict[str, str] | None = None
    """Secure stack: what a client of the chosen role needs (passwords excepted)."""

    @property
    def running(self) -> bool:
        return all(s.running for s in self.services)

    def env(self) -> dict[str, str]:
        if self.client_env is not None:
            return dict(self.client_env)
        return {
            "RUNLOG_BOOTSTRAP_SERVERS": self.bootstrap_servers,
            "RUNLOG_REDIS_URL": self.redis_url,
        }

    def describe(self) -> str:
        lines = [
            f"stack: {'running' if self.running else 'not running'} "
            f"(Kafka {self.kafka_version}, KRaft)",
        ]
        for s in self.services:
            state = "running" if s.running else "stopped"
            if not s.managed:
                state += " (external, not managed by runlog)"
            pid = f" pid {s.pid}" if s.pid else ""
            lines.append(f"  {s.name:<8} {state:<10} {s.address}{pid}")
            if s.log_file is not None:
                lines.append(f"           log:  {s.log_file}")
            if s.data_dir is not None:
                lines.append(f"           data: {s.data_dir}")
        lines.append(f"  jars:    {self.jars_dir}")
        lines.append(f"  state:   {self.state_dir}")
        lines.extend(f"  note:    {n}" for n in self.notes)
        return "\n".join(lines)
