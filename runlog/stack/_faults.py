"""Faults for the fault tests: kill, stop and start one Kafka node or the Redis of a
running stack (``tests/faults``, the explorer, the soak).
"""

from __future__ import annotations

import shutil
import signal
import time

from runlog.errors import StackError
from runlog.stack._config import HOST, StackConfig
from runlog.stack._jars import java_binary, resolve_jars
from runlog.stack._kafka import kafka_marker, kafka_ready, start_kafka_node
from runlog.stack._processes import live_pid, locked, port_answers, signal_and_wait, tail_of
from runlog.stack._redis_server import REDIS_MARKER, redis_ping, redis_server, spawn_redis


def node_pid(config: StackConfig, node_id: int) -> int | None:
    """Pid of Kafka node ``node_id`` if it is running (a stopped, SIGSTOPped one counts)."""
    node = config.node(node_id)
    return live_pid(node.pid_file, kafka_marker(node))


def kill_node(config: StackConfig, node_id: int, *, sig: int = signal.SIGKILL) -> int | None:
    """Send ``sig`` (default ``kill -9``) to node ``node_id``; wait until it is gone.

    Returns the pid signalled, or None if the node was not running. With SIGTERM the
    broker shuts down cleanly (leadership moves first); with SIGKILL it just vanishes.
    """
    node = config.node(node_id)
    return signal_and_wait(node.pid_file, kafka_marker(node), sig, stop_timeout=60)


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
        with locked(config.state_dir / "stack.lock"):
            pid_or_none = live_pid(node.pid_file, kafka_marker(node))
            if pid_or_none is None:
                # A node that died at once (e.g. its previous process was still letting
                # go of the data dir) gets two more tries before this is an error.
                if spawns == 3:
                    raise StackError(
                        f"Kafka node {node_id} exited during startup (3 tries).\n"
                        f"--- {node.server_log} (tail) ---\n{tail_of(node.server_log)}\n"
                        f"--- {node.stdout_log} (tail) ---\n{tail_of(node.stdout_log, 20)}"
                    )
                if spawns:
                    time.sleep(2)
                spawns += 1
                pid_or_none = start_kafka_node(config, java_binary(), resolve_jars(config), node)
        pid = pid_or_none
        if port_answers(node.kafka_port) and kafka_ready(
            f"{HOST}:{node.kafka_port}", conf=config.kafka_client_conf()
        ):
            return pid
        if time.monotonic() > deadline:
            raise StackError(
                f"Kafka node {node_id} not ready after {timeout:.0f}s.\n"
                f"--- {node.server_log} (tail) ---\n{tail_of(node.server_log)}"
            )
        time.sleep(0.25)


def redis_pid(config: StackConfig) -> int | None:
    """Pid of the stack's own redis-server if it is running."""
    return None if config.external_redis_url else live_pid(config.redis_pid_file, REDIS_MARKER)


def kill_redis(config: StackConfig, *, sig: int = signal.SIGKILL) -> int | None:
    """Send ``sig`` to the stack's own Redis and wait until it is gone (never an external one).

    SIGKILL loses what the append-only file had not yet fsynced (up to about a second).
    """
    if config.external_redis_url:
        raise StackError("refusing to kill an external Redis (RUNLOG_REDIS_URL)")
    return signal_and_wait(config.redis_pid_file, REDIS_MARKER, sig, stop_timeout=30)


def start_redis(config: StackConfig, *, empty: bool = False, timeout: float = 30.0) -> int:
    """(Re)start the stack's own Redis; ``empty=True`` first deletes its data (a lost disk)."""
    if config.external_redis_url:
        raise StackError("refusing to start an external Redis (RUNLOG_REDIS_URL)")
    with locked(config.state_dir / "stack.lock"):
        pid = live_pid(config.redis_pid_file, REDIS_MARKER)
        if pid is None:
            if empty:
                shutil.rmtree(config.redis_dir / "data", ignore_errors=True)
            pid = spawn_redis(config, redis_server(config, None))
    deadline = time.monotonic() + timeout
    while not redis_ping(config.redis_url, **config.redis_client_kwargs()):
        if live_pid(config.redis_pid_file, REDIS_MARKER) is None:
            raise StackError(f"redis-server exited during startup.\n{tail_of(config.redis_log)}")
        if time.monotonic() > deadline:
            raise StackError(f"Redis not ready after {timeout:.0f}s.\n{tail_of(config.redis_log)}")
        time.sleep(0.05)
    return pid
