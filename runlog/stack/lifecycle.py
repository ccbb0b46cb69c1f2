"""A local Kafka (KRaft) + Redis stack without Docker: ``runlog stack up|down|status|env``.

Kafka's broker is resolved from Maven Central with ``mvn`` (see ``pom.xml`` beside this file)
into a cache outside the source tree and run as ``java -cp 'JARS/*' kafka.Kafka``: one
combined broker+controller node on 127.0.0.1. Redis is Debian's ``redis-server`` with an
append-only file, or an existing server named by ``RUNLOG_REDIS_URL``.

Everything is idempotent: ``up`` on a running stack returns the running stack; ``up`` never
starts a second copy. State (data, logs, pid files) lives in ``RUNLOG_STACK_DIR``
(default ``~/.local/state/runlog/stack``); jars in ``RUNLOG_CACHE_DIR`` (default
``~/.cache/runlog``).

Environment overrides: ``RUNLOG_STACK_DIR``, ``RUNLOG_CACHE_DIR``,
``RUNLOG_STACK_KAFKA_PORT`` (19092), ``RUNLOG_STACK_CONTROLLER_PORT`` (19093),
``RUNLOG_STACK_REDIS_PORT`` (16379), ``RUNLOG_STACK_KAFKA_HEAP`` (512m),
``RUNLOG_STACK_NO_INSTALL`` (do not ``apt-get install redis-server``), ``RUNLOG_REDIS_URL``
(use that Redis instead of starting one).

Cluster mode (``runlog stack up --nodes 3``, ``StackConfig.from_env(nodes=3)``): three
combined nodes (ids 1-3) voting in one KRaft quorum, RF 3 and ``min.insync.replicas=2``
for every topic, on other ports (Kafka 29092/29094/29096, controllers 29093/29095/29097,
Redis 26379) and in another state dir (``~/.local/state/runlog/cluster-3``), so it runs
beside the single-node stack. It is what the fault tests use; :func:`kill_node`,
:func:`start_node`, :func:`kill_redis` and :func:`start_redis` inject their faults.
Its overrides: ``RUNLOG_CLUSTER_DIR``, ``RUNLOG_CLUSTER_KAFKA_PORT`` (29092),
``RUNLOG_CLUSTER_CONTROLLER_PORT`` (29093), ``RUNLOG_CLUSTER_REDIS_PORT`` (26379),
``RUNLOG_CLUSTER_KAFKA_HEAP`` (384m). ``RUNLOG_REDIS_URL`` never applies to a cluster:
its Redis is always its own, so restarting it never touches a shared server.

Secure mode (``runlog stack up --secure``, ``StackConfig.from_env(secure=True)``): one node
with a SASL_SSL listener (SCRAM-SHA-512), mutual-TLS inter-broker and controller listeners,
the StandardAuthorizer denying what no ACL allows, and a TLS-only Redis with ACL users; see
:mod:`runlog.stack.secure`. Its own ports and state dir, beside the plain stack:
``RUNLOG_SECURE_DIR`` (default: the plain stack's dir + ``-secure``),
``RUNLOG_SECURE_KAFKA_PORT`` (19192), ``RUNLOG_SECURE_CONTROLLER_PORT`` (19193),
``RUNLOG_SECURE_INTERNAL_PORT`` (19194), ``RUNLOG_SECURE_REDIS_PORT`` (16479),
``RUNLOG_SECURE_KAFKA_HEAP`` (384m); ``RUNLOG_REDIS_KEY_PREFIX`` at start sets the key
patterns of its Redis users. ``RUNLOG_REDIS_URL`` never applies to it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from runlog.errors import StackError
from runlog.stack import secure as _secure

__all__ = [
    "KAFKA_VERSION",
    "NodeSpec",
    "ServiceStatus",
    "StackConfig",
    "StackStatus",
    "down",
    "env",
    "init_secure",
    "kill_node",
    "kill_redis",
    "node_pid",
    "redis_pid",
    "resolve_jars",
    "start_node",
    "start_redis",
    "status",
    "stop_node",
    "up",
]

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

_log = logging.getLogger("runlog.stack")


def _pom_kafka_version(pom_text: str) -> str:
    match = re.search(r"<kafka\.version>\s*([^<\s]+)\s*</kafka\.version>", pom_text)
    if match is None:  # pragma: no cover - the pom ships with the package
        raise StackError(f"{POM_PATH} does not define <kafka.version>")
    return match.group(1)


KAFKA_VERSION = _pom_kafka_version(POM_PATH.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- configuration


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
    """TLS + SASL/SCRAM + ACLs on Kafka, TLS + ACL users on Redis (see runlog.stack.secure)."""
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
            state_dir=Path(state).expanduser().absolute(),
            cache_dir=Path(cache).expanduser().absolute(),
            kafka_port=port("KAFKA"),
            controller_port=port("CONTROLLER"),
            redis_port=port("REDIS"),
            kafka_heap=e.get(f"RUNLOG_{kind}_KAFKA_HEAP") or heap,
            allow_install=not e.get("RUNLOG_STACK_NO_INSTALL"),
        )
        if secure:
            return replace(
                base,
                internal_port=port("INTERNAL"),
                secure=True,
                redis_key_prefix=e.get("RUNLOG_REDIS_KEY_PREFIX") or "runlog",
            )
        if nodes > 1:
            return replace(base, node_count=nodes)
        # Only the plain stack may use an external Redis instead of its own.
        external = _external_redis(e.get("RUNLOG_REDIS_URL"), base.redis_port)
        return replace(base, external_redis_url=external)

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


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so two concurrent ``up`` calls start one stack."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _port_answers(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def _reap(pid: int) -> None:
    """Collect a dead child of this process so it stops looking alive (zombie)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _pid_alive(pid: int, marker: str) -> bool:
    """True if ``pid`` is a live (non-zombie) process whose command line contains ``marker``."""
    _reap(pid)
    proc = Path(f"/proc/{pid}")
    if proc.is_dir():
        try:
            stat = (proc / "stat").read_text()
            state = stat.rsplit(")", 1)[1].split()[0]
            cmdline = (proc / "cmdline").read_bytes()
            # redis-server rewrites its process title at startup; for a few microseconds
            # the command line reads empty, and a freshly started Redis looked dead.
            for _ in range(5):
                if cmdline.strip(b"\0"):
                    break
                time.sleep(0.01)
                cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            return False
        text = cmdline.replace(b"\0", b" ").decode(errors="replace")
        return state not in ("Z", "X") and marker in text
    try:  # no /proc (not Linux): trust the pid file
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _live_pid(pid_file: Path, marker: str) -> int | None:
    pid = _read_pid(pid_file)
    if pid is not None and _pid_alive(pid, marker):
        return pid
    return None


def _tail(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no {path})"
    return "\n".join(text.splitlines()[-lines:]) or f"({path} is empty)"


def _spawn(argv: list[str], *, cwd: Path, stdout: Path, env: Mapping[str, str]) -> int:
    """Start ``argv`` detached from this process (own session), stdout/stderr to a file."""
    stdout.parent.mkdir(parents=True, exist_ok=True)
    with stdout.open("ab") as out, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=devnull,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            close_fds=True,
        )
    return proc.pid


def _stop_pid(pid: int, marker: str, timeout: float) -> None:
    if not _pid_alive(pid, marker):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid, marker):
            return
        time.sleep(0.1)
    _log.warning("pid %s did not stop after SIGTERM within %.0fs; sending SIGKILL", pid, timeout)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _pid_alive(pid, marker):
        time.sleep(0.1)


# --------------------------------------------------------------------------- Java and jars


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin/java").is_file():
        return str(Path(java_home) / "bin/java")
    java = shutil.which("java")
    if java is None:
        raise StackError(
            "no `java` on PATH (the Kafka broker needs Java 17+): "
            "install it, e.g. `apt-get install -y openjdk-17-jre-headless`, or set JAVA_HOME"
        )
    return java


def _check_java_version(java: str) -> None:
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as exc:
        raise StackError(f"cannot run {java}: {exc}") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if match is None:
        return
    major = int(match.group(1))
    if major == 1 and match.group(2):
        major = int(match.group(2))
    if major < 17:
        raise StackError(
            f"{java} is Java {major}; Kafka {KAFKA_VERSION} needs Java 17+ "
            "(e.g. `apt-get install -y openjdk-17-jre-headless`, or set JAVA_HOME)"
        )


def _pom_hash() -> str:
    return hashlib.sha256(POM_PATH.read_bytes()).hexdigest()


def resolve_jars(config: StackConfig, echo: Echo | None = None) -> Path:
    """The broker's jars, resolved with Maven once per pom content and reused afterwards."""
    target = config.jars_dir
    stamp = target / ".pom-sha256"
    want = _pom_hash()
    if stamp.is_file() and stamp.read_text().strip() == want:
        return target
    with _locked(config.cache_dir / ".lock"):
        if stamp.is_file() and stamp.read_text().strip() == want:
            return target
        mvn = shutil.which("mvn")
        if mvn is None:
            raise StackError(
                "no `mvn` on PATH: Maven resolves the Kafka broker's jars from Maven Central "
                f"once (into {target}); install it, e.g. `apt-get install -y maven`"
            )
        if echo:
            echo(f"resolving Kafka {KAFKA_VERSION} jars with Maven into {target} (once) ...")
        work = config.cache_dir / f".resolve-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            shutil.copyfile(POM_PATH, work / "pom.xml")
            cmd = [
                mvn,
                "-B",
                "-q",
                "-Dstyle.color=never",
                "-f",
                str(work / "pom.xml"),
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={work / 'jars'}",
            ]
            try:
                proc = subprocess.run(
                    cmd, cwd=work, capture_output=True, text=True, timeout=900, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise StackError(
                    f"Maven resolution of Kafka {KAFKA_VERSION} failed: {exc}"
                ) from exc
            jars = sorted((work / "jars").glob("*.jar")) if (work / "jars").is_dir() else []
            if proc.returncode != 0 or not jars:
                output = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
                raise StackError(
                    f"Maven could not resolve Kafka {KAFKA_VERSION} (exit {proc.returncode}); "
                    f"is Maven Central reachable (proxy in ~/.m2/settings.xml)?\n"
                    f"command: {' '.join(cmd)}\n{output}"
                )
            if not any(j.name.startswith(f"kafka_2.13-{KAFKA_VERSION}") for j in jars):
                raise StackError(f"Maven resolved no kafka_2.13-{KAFKA_VERSION} jar")
            (work / "jars" / ".pom-sha256").write_text(want + "\n")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(work / "jars", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


# --------------------------------------------------------------------------- Kafka


def _server_properties(config: StackConfig, node: NodeSpec) -> str:
    voters = ",".join(f"{n.node_id}@{HOST}:{n.controller_port}" for n in config.nodes())
    rf = min(3, config.node_count)
    min_isr = max(1, rf - 1)
    props = {
        # Combined KRaft node on loopback.
        "process.roles": "broker,controller",
        "node.id": str(node.node_id),
        "controller.quorum.voters": voters,
        "listeners": f"PLAINTEXT://{HOST}:{node.kafka_port},CONTROLLER://{HOST}:{node.controller_port}",
        "advertised.listeners": f"PLAINTEXT://{HOST}:{node.kafka_port}",
        "controller.listener.names": "CONTROLLER",
        "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(node.data_dir),
        # Internal topics must fit the cluster size (defaults 3 / 2 break one broker).
        "offsets.topic.replication.factor": str(rf),
        "transaction.state.log.replication.factor": str(rf),
        "transaction.state.log.min.isr": str(min_isr),
        "share.coordinator.state.topic.replication.factor": str(rf),
        "share.coordinator.state.topic.min.isr": str(min_isr),
        "default.replication.factor": str(rf),
        "min.insync.replicas": str(min_isr),
        "unclean.leader.election.enable": "false",
        # runlog creates its topics explicitly (runlog topics create).
        "auto.create.topics.enable": "false",
        "num.partitions": "1",
        # Fast tests: no rebalance delay; small footprint on a 2-core laptop/CI runner.
        "group.initial.rebalance.delay.ms": "0",
        "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
        "log.cleaner.threads": "1",
        "num.network.threads": "2",
        "num.io.threads": "4",
        "num.recovery.threads.per.data.dir": "1",
        "background.threads": "4",
        "offsets.topic.num.partitions": "10",
        "log.retention.hours": "-1",
        "log.retention.bytes": "-1",
    }
    if config.secure:
        props.update(_secure.kafka_properties(config, node))
    if config.node_count > 1:
        # Fault tests kill nodes: notice a dead broker (and move leaders off it) in seconds,
        # not the default 9 s, without flapping on a busy 2-core machine.
        props["broker.session.timeout.ms"] = "6000"
        props["broker.heartbeat.interval.ms"] = "1000"
        props["replica.lag.time.max.ms"] = "10000"
    body = "\n".join(f"{k}={v}" for k, v in props.items())
    return (
        "# Written by `runlog stack up`; rewritten on every start. Do not edit.\n"
        "# One combined broker+controller per node. Note: Kafka does not fsync each message\n"
        "# by default: an acknowledged write is in the page cache of the replicas.\n"
        f"{body}\n"
    )


def _kafka_marker(node: NodeSpec) -> str:
    return str(node.server_properties)


def _java_argv(config: StackConfig, java: str, jars: Path, node: NodeSpec) -> list[str]:
    return [
        java,
        f"-Xmx{config.kafka_heap}",
        "-XX:+UseG1GC",
        "-XX:MaxGCPauseMillis=20",
        "-Djava.awt.headless=true",
        f"-Dlog4j2.configurationFile={LOG4J2_PATH}",
        f"-Drunlog.log.dir={node.log_dir}",
        f"-Dkafka.logs.dir={node.log_dir}",
        "-cp",
        f"{jars}/*",
    ]


def _ensure_cluster_id(config: StackConfig, java: str, jars: Path, node: NodeSpec) -> str:
    if config.cluster_id_file.is_file():
        cid = config.cluster_id_file.read_text().strip()
        if cid:
            return cid
    argv = [*_java_argv(config, java, jars, node), "kafka.tools.StorageTool", "random-uuid"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not lines:
        raise StackError(f"kafka.tools.StorageTool random-uuid failed:\n{proc.stdout}{proc.stderr}")
    cid = lines[-1]
    config.cluster_id_file.parent.mkdir(parents=True, exist_ok=True)
    config.cluster_id_file.write_text(cid + "\n")
    return cid


def _format_storage(
    config: StackConfig, java: str, jars: Path, node: NodeSpec, cluster_id: str
) -> None:
    if (node.data_dir / "meta.properties").is_file():
        return
    argv = [
        *_java_argv(config, java, jars, node),
        "kafka.tools.StorageTool",
        "format",
        "-t",
        cluster_id,
        "-c",
        str(node.server_properties),
        "-g",
    ]
    if config.secure:
        argv += _secure.scram_format_args(config)
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    if proc.returncode != 0:
        output = f"{proc.stdout}{proc.stderr}"
        if config.secure:  # the command line held the SCRAM passwords; its output may echo it
            for role in _secure.ALL_ROLES:
                pw = _secure.credentials(config, role)["RUNLOG_SASL_PASSWORD"]
                output = output.replace(pw, "[hidden]")
        raise StackError(f"formatting {node.data_dir} failed (exit {proc.returncode}):\n{output}")


def _start_kafka_node(config: StackConfig, java: str, jars: Path, node: NodeSpec) -> int:
    node.dir.mkdir(parents=True, exist_ok=True)
    node.log_dir.mkdir(parents=True, exist_ok=True)
    node.server_properties.write_text(_server_properties(config, node))
    cluster_id = _ensure_cluster_id(config, java, jars, node)
    _format_storage(config, java, jars, node, cluster_id)
    argv = [*_java_argv(config, java, jars, node), "kafka.Kafka", str(node.server_properties)]
    pid = _spawn(argv, cwd=node.dir, stdout=node.stdout_log, env=os.environ)
    node.pid_file.write_text(f"{pid}\n")
    return pid


def _kafka_ready(bootstrap: str, brokers: int = 1, conf: Mapping[str, Any] | None = None) -> bool:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    quiet = logging.getLogger("runlog.stack.librdkafka")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    admin = AdminClient({**(conf or {}), "bootstrap.servers": bootstrap}, logger=quiet)
    try:
        md = admin.list_topics(timeout=5)
    except KafkaException:
        return False
    return len(md.brokers) >= brokers


# --------------------------------------------------------------------------- Redis


def _redis_ping(url: str, **kw: Any) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, **kw)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def _redis_server(config: StackConfig, echo: Echo | None) -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    hint = (
        "install Debian's redis-server (`apt-get install -y redis-server`) or set RUNLOG_REDIS_URL"
    )
    if not config.allow_install or os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise StackError(f"no `redis-server` on PATH: {hint}")
    if echo:
        echo("redis-server missing: apt-get install -y redis-server ...")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "--no-install-recommends", "redis-server"]
    proc = subprocess.run(install, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, env=env, check=False)
        proc = subprocess.run(install, capture_output=True, text=True, env=env, check=False)
    found = shutil.which("redis-server") or (
        "/usr/bin/redis-server" if Path("/usr/bin/redis-server").is_file() else None
    )
    if proc.returncode != 0 or found is None:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
        raise StackError(f"apt-get install redis-server failed; {hint}\n{tail}")
    return found


# redis-server rewrites its process title ("redis-server 127.0.0.1:PORT"), so the config
# path is not in /proc/PID/cmdline; the pid file in our state dir identifies our server.
_REDIS_MARKER = "redis-server"


def _redis_conf(config: StackConfig) -> str:
    listen = (
        "\n".join(_secure.redis_conf_lines(config))
        if config.secure
        else f"port {config.redis_port}"
    )
    return (
        "# Written by `runlog stack up`. Durability: AOF, fsync once per second\n"
        "# (a crash of the machine may lose up to ~1 s of lease/projection writes).\n"
        f"bind {HOST}\n"
        f"{listen}\n"
        "protected-mode yes\n"
        "daemonize no\n"
        f"dir {config.redis_dir / 'data'}\n"
        f"logfile {config.redis_log}\n"
        "appendonly yes\n"
        "appendfsync everysec\n"
        'appenddirname "appendonly"\n'
        'save ""\n'
        "databases 16\n"
    )


def _start_redis(config: StackConfig, server: str) -> int:
    (config.redis_dir / "data").mkdir(parents=True, exist_ok=True)
    if config.secure:
        _secure.write_redis_acl(config)
    config.redis_conf.write_text(_redis_conf(config))
    pid = _spawn(
        [server, str(config.redis_conf)],
        cwd=config.redis_dir,
        stdout=config.redis_dir / "stdout.log",
        env=os.environ,
    )
    config.redis_pid_file.write_text(f"{pid}\n")
    return pid


# --------------------------------------------------------------------------- public API


def _port_taken_error(port: int, what: str, env_var: str) -> StackError:
    return StackError(
        f"port {HOST}:{port} ({what}) is in use by a process that is not runlog's stack "
        f"in this state dir; stop it or choose another port with {env_var}=..."
    )


def status(config: StackConfig | None = None, *, role: str = "admin") -> StackStatus:
    """What is running, where. Never starts or stops anything.

    On a secure stack, ``env()`` of the result is what a client of ``role`` needs.
    """
    cfg = config or StackConfig.from_env()
    services: list[ServiceStatus] = []
    for node in cfg.nodes():
        pid = _live_pid(node.pid_file, _kafka_marker(node))
        services.append(
            ServiceStatus(
                name=f"kafka-{node.node_id}" if cfg.node_count > 1 else "kafka",
                running=pid is not None and _port_answers(node.kafka_port),
                managed=True,
                address=(
                    f"{HOST}:{node.kafka_port} SASL_SSL (internal mTLS {HOST}:"
                    f"{node.internal_port}, controller mTLS {HOST}:{node.controller_port})"
                    if cfg.secure
                    else f"{HOST}:{node.kafka_port} (controller {HOST}:{node.controller_port})"
                ),
                pid=pid,
                log_file=node.server_log,
                data_dir=node.data_dir,
            )
        )
    if cfg.external_redis_url:
        services.append(
            ServiceStatus(
                name="redis",
                running=_redis_ping(cfg.external_redis_url),
                managed=False,
                address=cfg.external_redis_url,
            )
        )
    else:
        pid = _live_pid(cfg.redis_pid_file, _REDIS_MARKER)
        services.append(
            ServiceStatus(
                name="redis",
                running=pid is not None and _port_answers(cfg.redis_port),
                managed=True,
                address=f"{HOST}:{cfg.redis_port}" + (" TLS, ACL users" if cfg.secure else ""),
                pid=pid,
                log_file=cfg.redis_log,
                data_dir=cfg.redis_dir / "data",
            )
        )
    return StackStatus(
        services=tuple(services),
        bootstrap_servers=cfg.bootstrap_servers,
        redis_url=cfg.redis_url,
        state_dir=cfg.state_dir,
        jars_dir=cfg.jars_dir,
        notes=(_durability_note(cfg), *_secure_notes(cfg)),
        client_env=_secure.client_env(cfg, role) if cfg.secure else None,
    )


def _secure_notes(cfg: StackConfig) -> tuple[str, ...]:
    if not cfg.secure:
        return ()
    folder = _secure.secrets_dir(cfg)
    return (
        f"CA certificate: {_secure.ca_file(cfg)}",
        f"passwords (0600, never printed): {folder}/<role>.env for roles "
        f"{', '.join(_secure.ALL_ROLES)}; export with: set -a; . {folder}/ROLE.env; set +a",
    )


def _durability_note(cfg: StackConfig) -> str:
    if cfg.node_count == 1:
        return (
            "single node: no replication, and Kafka does not fsync per message, so an "
            "acknowledged write is in one machine's page cache (production: RF 3, "
            "min.insync.replicas=2)"
        )
    rf = min(3, cfg.node_count)
    isr = max(1, rf - 1)
    return (
        f"{cfg.node_count} nodes on one machine (RF {rf}, min.insync.replicas={isr}): an "
        f"acknowledged write is in the page cache of at least {isr} broker processes, so "
        "it survives kill -9 of a broker, not a power loss of this machine; for fault tests"
    )


def up(
    config: StackConfig | None = None,
    *,
    timeout: float = 90.0,
    echo: Echo | None = None,
) -> StackStatus:
    """Start the stack if it is not running; wait until Kafka and Redis answer real calls."""
    cfg = config or StackConfig.from_env()
    say: Echo = echo or (lambda _msg: None)
    with _locked(cfg.state_dir / "stack.lock"):
        started: list[str] = []
        # Find (or install) everything before starting anything, so a missing tool
        # does not leave half a stack running.
        redis_bin: str | None = None
        if cfg.secure:
            _secure.ensure_material(cfg)
        if not cfg.external_redis_url and _live_pid(cfg.redis_pid_file, _REDIS_MARKER) is None:
            redis_bin = _redis_server(cfg, say)
        # Kafka ---------------------------------------------------------------------
        kafka_pids: dict[int, int] = {}
        to_start: list[NodeSpec] = []
        for node in cfg.nodes():
            pid = _live_pid(node.pid_file, _kafka_marker(node))
            if pid is not None:
                if node.server_properties.read_text() != _server_properties(cfg, node):
                    raise StackError(
                        f"Kafka node {node.node_id} (pid {pid}) is running with other settings "
                        f"than requested (see {node.server_properties}); "
                        "run `runlog stack down` first"
                    )
                kafka_pids[node.node_id] = pid
                continue
            ports = [
                (node.kafka_port, "Kafka", cfg.port_vars[0]),
                (node.controller_port, "Kafka controller", cfg.port_vars[1]),
            ]
            if node.internal_port:
                ports.append(
                    (node.internal_port, "Kafka inter-broker", "RUNLOG_SECURE_INTERNAL_PORT")
                )
            for port, what, var in ports:
                if _port_answers(port):
                    raise _port_taken_error(port, what, var)
            to_start.append(node)
        if to_start:
            java = _java()
            _check_java_version(java)
            jars = resolve_jars(cfg, echo=say)
            for node in to_start:
                kafka_pids[node.node_id] = _start_kafka_node(cfg, java, jars, node)
                started.append(f"kafka node {node.node_id}")
        # Redis ---------------------------------------------------------------------
        if cfg.external_redis_url:
            if not _redis_ping(cfg.external_redis_url):
                raise StackError(
                    f"RUNLOG_REDIS_URL={cfg.external_redis_url} does not answer PING; "
                    "start that Redis or unset RUNLOG_REDIS_URL to let runlog start one"
                )
        elif (redis_pid := _live_pid(cfg.redis_pid_file, _REDIS_MARKER)) is not None:
            if cfg.redis_conf.read_text() != _redis_conf(cfg):
                raise StackError(
                    f"redis-server (pid {redis_pid}) is running with other settings than "
                    f"requested (see {cfg.redis_conf}); run `runlog stack down` first"
                )
        else:
            if _port_answers(cfg.redis_port):
                raise _port_taken_error(cfg.redis_port, "Redis", cfg.port_vars[2])
            _start_redis(cfg, redis_bin or _redis_server(cfg, say))
            started.append("redis")
        if started:
            say(f"starting {', '.join(started)} ...")
        # Wait for real client calls --------------------------------------------------
        _wait_ready(cfg, timeout)
    st = status(cfg)
    if not st.running:  # pragma: no cover - _wait_ready checked the same things
        raise StackError(f"stack did not come up:\n{st.describe()}")
    return st


def _wait_ready(cfg: StackConfig, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    pending_kafka = list(cfg.nodes())
    redis_ok = False
    while True:
        for node in list(pending_kafka):
            if _live_pid(node.pid_file, _kafka_marker(node)) is None:
                raise StackError(
                    f"Kafka node {node.node_id} exited during startup.\n"
                    f"--- {node.server_log} (tail) ---\n{_tail(node.server_log)}\n"
                    f"--- {node.stdout_log} (tail) ---\n{_tail(node.stdout_log, 20)}"
                )
            if _port_answers(node.kafka_port) and _kafka_ready(
                f"{HOST}:{node.kafka_port}", cfg.node_count, cfg.kafka_client_conf()
            ):
                pending_kafka.remove(node)
        if not redis_ok:
            if not cfg.external_redis_url and _live_pid(cfg.redis_pid_file, _REDIS_MARKER) is None:
                raise StackError(
                    f"redis-server exited during startup.\n--- {cfg.redis_log} (tail) ---\n"
                    f"{_tail(cfg.redis_log)}\n{_tail(cfg.redis_dir / 'stdout.log', 10)}"
                )
            redis_ok = _redis_ping(cfg.redis_url, **cfg.redis_client_kwargs())
        if not pending_kafka and redis_ok:
            return
        if time.monotonic() > deadline:
            parts = [f"stack not ready after {timeout:.0f}s"]
            for node in pending_kafka:
                parts.append(
                    f"Kafka {HOST}:{node.kafka_port} does not answer a metadata request "
                    f"listing {cfg.node_count} broker(s).\n"
                    f"--- {node.server_log} (tail) ---\n{_tail(node.server_log)}\n"
                    f"--- {node.stdout_log} (tail) ---\n{_tail(node.stdout_log, 20)}"
                )
            if not redis_ok:
                parts.append(
                    f"Redis {cfg.redis_url} does not answer PING.\n"
                    f"--- {cfg.redis_log} (tail) ---\n{_tail(cfg.redis_log)}"
                )
            raise StackError("\n".join(parts))
        time.sleep(0.25)


def down(config: StackConfig | None = None, *, timeout: float = 60.0) -> StackStatus:
    """Stop Kafka and (runlog's own) Redis: SIGTERM, wait, then SIGKILL. Data is kept."""
    cfg = config or StackConfig.from_env()
    with _locked(cfg.state_dir / "stack.lock"):
        # SIGTERM every node at once: stopped one by one, the last nodes of a cluster lose
        # their controller quorum and wait out the timeout in a controlled shutdown.
        running = [
            (node, pid)
            for node in reversed(cfg.nodes())
            if (pid := _live_pid(node.pid_file, _kafka_marker(node))) is not None
        ]
        for _node, pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for node, pid in running:
            _stop_pid(pid, _kafka_marker(node), timeout)
        for node in cfg.nodes():
            node.pid_file.unlink(missing_ok=True)
        if not cfg.external_redis_url:
            pid = _live_pid(cfg.redis_pid_file, _REDIS_MARKER)
            if pid is not None:
                _stop_pid(pid, _REDIS_MARKER, timeout)
            cfg.redis_pid_file.unlink(missing_ok=True)
    return status(cfg)


def init_secure(config: StackConfig) -> Path:
    """Make the secure stack's certificates, passwords and Redis ACL file; start nothing.

    For running the same stack from ``docker-compose.yml`` (profile ``secure``), which
    mounts them. Idempotent; returns the state dir that holds them.
    """
    if not config.secure:
        raise StackError("init is for the secure stack (--secure)")
    with _locked(config.state_dir / "stack.lock"):
        _secure.ensure_material(config)
        _secure.write_redis_acl(config)
    return config.state_dir


def env(config: StackConfig | None = None, *, role: str = "admin") -> dict[str, str]:
    """``RUNLOG_*`` variables that point clients at this stack (a secure one: as ``role``).

    Never a password: those stay in the secure stack's ``secrets/<role>.env``.
    """
    return status(config, role=role).env()


# --------------------------------------------------------------------------- fault injection
#
# For the fault tests (tests/faults): kill or stop one node of a cluster, start it again,
# kill or start the stack's own Redis. Never used on an external Redis.


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Wait until ``pid`` has really exited (reaped or a zombie), whatever its command line.

    A JVM tearing down can already show an empty command line while it still holds its
    data dir lock and ports; a restart in that window fails.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return
        time.sleep(0.05)


def node_pid(config: StackConfig, node_id: int) -> int | None:
    """Pid of Kafka node ``node_id`` if it is running (a stopped, SIGSTOPped one counts)."""
    node = config.node(node_id)
    return _live_pid(node.pid_file, _kafka_marker(node))


def _signal_and_wait(pid_file: Path, marker: str, sig: int, *, stop_timeout: float) -> int | None:
    """Signal the live process of ``pid_file`` and wait until it has exited: SIGKILL at
    once, any other signal as a clean stop (SIGKILL after ``stop_timeout``). Returns the
    pid signalled, or None if it was not running."""
    pid = _live_pid(pid_file, marker)
    if pid is None:
        return None
    if sig == signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    else:
        _stop_pid(pid, marker, timeout=stop_timeout)
    _wait_gone(pid)
    return pid


def kill_node(config: StackConfig, node_id: int, *, sig: int = signal.SIGKILL) -> int | None:
    """Send ``sig`` (default ``kill -9``) to node ``node_id``; wait until it is gone.

    Returns the pid signalled, or None if the node was not running. With SIGTERM the
    broker shuts down cleanly (leadership moves first); with SIGKILL it just vanishes.
    """
    node = config.node(node_id)
    return _signal_and_wait(node.pid_file, _kafka_marker(node), sig, stop_timeout=60)


def stop_node(config: StackConfig, node_id: int) -> int | None:
    """Stop node ``node_id`` cleanly (SIGTERM, then SIGKILL after 60 s)."""
    return kill_node(config, node_id, sig=signal.SIGTERM)


def start_node(config: StackConfig, node_id: int, *, timeout: float = 90.0) -> int:
    """(Re)start node ``node_id`` on its existing data; returns once it answers metadata.

    The node catches up its replicas in the background: callers that need it back in
    every ISR wait for that themselves.
    """
    node = config.node(node_id)
    spawns = 0
    deadline = time.monotonic() + timeout
    while True:
        with _locked(config.state_dir / "stack.lock"):
            pid_or_none = _live_pid(node.pid_file, _kafka_marker(node))
            if pid_or_none is None:
                # A node that died at once (e.g. its previous process was still letting
                # go of the data dir) gets two more tries before this is an error.
                if spawns == 3:
                    raise StackError(
                        f"Kafka node {node_id} exited during startup (3 tries).\n"
                        f"--- {node.server_log} (tail) ---\n{_tail(node.server_log)}\n"
                        f"--- {node.stdout_log} (tail) ---\n{_tail(node.stdout_log, 20)}"
                    )
                if spawns:
                    time.sleep(2)
                spawns += 1
                pid_or_none = _start_kafka_node(config, _java(), resolve_jars(config), node)
        pid = pid_or_none
        if _port_answers(node.kafka_port) and _kafka_ready(
            f"{HOST}:{node.kafka_port}", conf=config.kafka_client_conf()
        ):
            return pid
        if time.monotonic() > deadline:
            raise StackError(
                f"Kafka node {node_id} not ready after {timeout:.0f}s.\n"
                f"--- {node.server_log} (tail) ---\n{_tail(node.server_log)}"
            )
        time.sleep(0.25)


def redis_pid(config: StackConfig) -> int | None:
    """Pid of the stack's own redis-server if it is running."""
    return None if config.external_redis_url else _live_pid(config.redis_pid_file, _REDIS_MARKER)


def kill_redis(config: StackConfig, *, sig: int = signal.SIGKILL) -> int | None:
    """Send ``sig`` to the stack's own Redis and wait until it is gone (never an external one).

    SIGKILL loses what the append-only file had not yet fsynced (up to about a second).
    """
    if config.external_redis_url:
        raise StackError("refusing to kill an external Redis (RUNLOG_REDIS_URL)")
    return _signal_and_wait(config.redis_pid_file, _REDIS_MARKER, sig, stop_timeout=30)


def start_redis(config: StackConfig, *, empty: bool = False, timeout: float = 30.0) -> int:
    """(Re)start the stack's own Redis; ``empty=True`` first deletes its data (a lost disk)."""
    if config.external_redis_url:
        raise StackError("refusing to start an external Redis (RUNLOG_REDIS_URL)")
    with _locked(config.state_dir / "stack.lock"):
        pid = _live_pid(config.redis_pid_file, _REDIS_MARKER)
        if pid is None:
            if empty:
                shutil.rmtree(config.redis_dir / "data", ignore_errors=True)
            pid = _start_redis(config, _redis_server(config, None))
    deadline = time.monotonic() + timeout
    while not _redis_ping(config.redis_url, **config.redis_client_kwargs()):
        if _live_pid(config.redis_pid_file, _REDIS_MARKER) is None:
            raise StackError(f"redis-server exited during startup.\n{_tail(config.redis_log)}")
        if time.monotonic() > deadline:
            raise StackError(f"Redis not ready after {timeout:.0f}s.\n{_tail(config.redis_log)}")
        time.sleep(0.05)
    return pid
