"""``up``, ``down``, ``status`` and ``env`` of the whole stack: every service started
in order and waited for, idempotently.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

from runlog.errors import StackError
from runlog.stack import _secure as _secure
from runlog.stack._config import HOST, Echo, NodeSpec, ServiceStatus, StackConfig, StackStatus
from runlog.stack._jars import check_java_version, java_binary, resolve_jars
from runlog.stack._kafka import kafka_marker, kafka_ready, server_properties, start_kafka_node
from runlog.stack._processes import (
    live_pid,
    locked,
    port_answers,
    port_taken_error,
    stop_pid,
    tail_of,
)
from runlog.stack._redis_server import (
    REDIS_MARKER,
    redis_conf,
    redis_ping,
    redis_server,
    spawn_redis,
)


def status(config: StackConfig | None = None, *, role: str = "admin") -> StackStatus:
    """What is running, where. Never starts or stops anything.

    On a secure stack, ``env()`` of the result is what a client of ``role`` needs.
    """
    cfg = config or StackConfig.from_env()
    services: list[ServiceStatus] = []
    for node in cfg.nodes():
        pid = live_pid(node.pid_file, kafka_marker(node))
        services.append(
            ServiceStatus(
                name=f"kafka-{node.node_id}" if cfg.node_count > 1 else "kafka",
                running=pid is not None and port_answers(node.kafka_port),
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
                running=redis_ping(cfg.external_redis_url),
                managed=False,
                address=cfg.external_redis_url,
            )
        )
    else:
        pid = live_pid(cfg.redis_pid_file, REDIS_MARKER)
        services.append(
            ServiceStatus(
                name="redis",
                running=pid is not None and port_answers(cfg.redis_port),
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
    with locked(cfg.state_dir / "stack.lock"):
        started: list[str] = []
        # Find (or install) everything before starting anything, so a missing tool
        # does not leave half a stack running.
        redis_bin: str | None = None
        if cfg.secure:
            _secure.ensure_material(cfg)
        if not cfg.external_redis_url and live_pid(cfg.redis_pid_file, REDIS_MARKER) is None:
            redis_bin = redis_server(cfg, say)
        # Kafka ---------------------------------------------------------------------
        kafka_pids: dict[int, int] = {}
        to_start: list[NodeSpec] = []
        for node in cfg.nodes():
            pid = live_pid(node.pid_file, kafka_marker(node))
            if pid is not None:
                if node.server_properties.read_text() != server_properties(cfg, node):
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
                if port_answers(port):
                    raise port_taken_error(port, what, var)
            to_start.append(node)
        if to_start:
            java = java_binary()
            check_java_version(java)
            jars = resolve_jars(cfg, echo=say)
            for node in to_start:
                kafka_pids[node.node_id] = start_kafka_node(cfg, java, jars, node)
                started.append(f"kafka node {node.node_id}")
        # Redis ---------------------------------------------------------------------
        if cfg.external_redis_url:
            if not redis_ping(cfg.external_redis_url):
                raise StackError(
                    f"RUNLOG_REDIS_URL={cfg.external_redis_url} does not answer PING; "
                    "start that Redis or unset RUNLOG_REDIS_URL to let runlog start one"
                )
        elif (redis_pid := live_pid(cfg.redis_pid_file, REDIS_MARKER)) is not None:
            if cfg.redis_conf.read_text() != redis_conf(cfg):
                raise StackError(
                    f"redis-server (pid {redis_pid}) is running with other settings than "
                    f"requested (see {cfg.redis_conf}); run `runlog stack down` first"
                )
        else:
            if port_answers(cfg.redis_port):
                raise port_taken_error(cfg.redis_port, "Redis", cfg.port_vars[2])
            spawn_redis(cfg, redis_bin or redis_server(cfg, say))
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
            if live_pid(node.pid_file, kafka_marker(node)) is None:
                raise StackError(
                    f"Kafka node {node.node_id} exited during startup.\n"
                    f"--- {node.server_log} (tail) ---\n{tail_of(node.server_log)}\n"
                    f"--- {node.stdout_log} (tail) ---\n{tail_of(node.stdout_log, 20)}"
                )
            if port_answers(node.kafka_port) and kafka_ready(
                f"{HOST}:{node.kafka_port}", cfg.node_count, cfg.kafka_client_conf()
            ):
                pending_kafka.remove(node)
        if not redis_ok:
            if not cfg.external_redis_url and live_pid(cfg.redis_pid_file, REDIS_MARKER) is None:
                raise StackError(
                    f"redis-server exited during startup.\n--- {cfg.redis_log} (tail) ---\n"
                    f"{tail_of(cfg.redis_log)}\n{tail_of(cfg.redis_dir / 'stdout.log', 10)}"
                )
            redis_ok = redis_ping(cfg.redis_url, **cfg.redis_client_kwargs())
        if not pending_kafka and redis_ok:
            return
        if time.monotonic() > deadline:
            parts = [f"stack not ready after {timeout:.0f}s"]
            for node in pending_kafka:
                parts.append(
                    f"Kafka {HOST}:{node.kafka_port} does not answer a metadata request "
                    f"listing {cfg.node_count} broker(s).\n"
                    f"--- {node.server_log} (tail) ---\n{tail_of(node.server_log)}\n"
                    f"--- {node.stdout_log} (tail) ---\n{tail_of(node.stdout_log, 20)}"
                )
            if not redis_ok:
                parts.append(
                    f"Redis {cfg.redis_url} does not answer PING.\n"
                    f"--- {cfg.redis_log} (tail) ---\n{tail_of(cfg.redis_log)}"
                )
            raise StackError("\n".join(parts))
        time.sleep(0.25)


def down(config: StackConfig | None = None, *, timeout: float = 60.0) -> StackStatus:
    """Stop Kafka and (runlog's own) Redis: SIGTERM, wait, then SIGKILL. Data is kept."""
    cfg = config or StackConfig.from_env()
    with locked(cfg.state_dir / "stack.lock"):
        # SIGTERM every node at once: stopped one by one, the last nodes of a cluster lose
        # their controller quorum and wait out the timeout in a controlled shutdown.
        running = [
            (node, pid)
            for node in reversed(cfg.nodes())
            if (pid := live_pid(node.pid_file, kafka_marker(node))) is not None
        ]
        for _node, pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for node, pid in running:
            stop_pid(pid, kafka_marker(node), timeout)
        for node in cfg.nodes():
            node.pid_file.unlink(missing_ok=True)
        if not cfg.external_redis_url:
            pid = live_pid(cfg.redis_pid_file, REDIS_MARKER)
            if pid is not None:
                stop_pid(pid, REDIS_MARKER, timeout)
            cfg.redis_pid_file.unlink(missing_ok=True)
    return status(cfg)


def init_secure(config: StackConfig) -> Path:
    """Make the secure stack's certificates, passwords and Redis ACL file; start nothing.

    For running the same stack from ``docker-compose.yml`` (profile ``secure``), which
    mounts them. Idempotent; returns the state dir that holds them.
    """
    if not config.secure:
        raise StackError("init is for the secure stack (--secure)")
    with locked(config.state_dir / "stack.lock"):
        _secure.ensure_material(config)
        _secure.write_redis_acl(config)
    return config.state_dir


def env(config: StackConfig | None = None, *, role: str = "admin") -> dict[str, str]:
    """``RUNLOG_*`` variables that point clients at this stack (a secure one: as ``role``).

    Never a password: those stay in the secure stack's ``secrets/<role>.env``.
    """
    return status(config, role=role).env()
