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
:mod:`runlog.stack._secure`. Its own ports and state dir, beside the plain stack:
``RUNLOG_SECURE_DIR`` (default: the plain stack's dir + ``-secure``),
``RUNLOG_SECURE_KAFKA_PORT`` (19192), ``RUNLOG_SECURE_CONTROLLER_PORT`` (19193),
``RUNLOG_SECURE_INTERNAL_PORT`` (19194), ``RUNLOG_SECURE_REDIS_PORT`` (16479),
``RUNLOG_SECURE_KAFKA_HEAP`` (384m); ``RUNLOG_REDIS_KEY_PREFIX`` at start sets the key
patterns of its Redis users. ``RUNLOG_REDIS_URL`` never applies to it.

The package, by reason to change: ``config`` (ports, dirs, nodes, status), ``processes``
(pid files, spawn, stop, lock), ``jars`` (Java and Kafka's jars), ``kafka`` (its nodes),
``redis_server``, ``lifecycle`` (``up``/``down``/``status``/``env``) and ``faults``.
"""

from __future__ import annotations

from runlog.stack._config import KAFKA_VERSION, NodeSpec, ServiceStatus, StackConfig, StackStatus
from runlog.stack._faults import (
    kill_node,
    kill_redis,
    node_pid,
    redis_pid,
    start_node,
    start_redis,
    stop_node,
)
from runlog.stack._jars import resolve_jars
from runlog.stack._lifecycle import down, env, init_secure, status, up

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
