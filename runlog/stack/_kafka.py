"""Kafka's nodes: their properties, KRaft storage formatting and start, and when a
cluster of them is ready.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runlog.errors import StackError
from runlog.stack import _secure as _secure
from runlog.stack._config import HOST, LOG4J2_PATH, NodeSpec, StackConfig
from runlog.stack._processes import spawn


def server_properties(config: StackConfig, node: NodeSpec) -> str:
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


def kafka_marker(node: NodeSpec) -> str:
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


def start_kafka_node(config: StackConfig, java: str, jars: Path, node: NodeSpec) -> int:
    node.dir.mkdir(parents=True, exist_ok=True)
    node.log_dir.mkdir(parents=True, exist_ok=True)
    node.server_properties.write_text(server_properties(config, node))
    cluster_id = _ensure_cluster_id(config, java, jars, node)
    _format_storage(config, java, jars, node, cluster_id)
    argv = [*_java_argv(config, java, jars, node), "kafka.Kafka", str(node.server_properties)]
    pid = spawn(argv, cwd=node.dir, stdout=node.stdout_log, env=os.environ)
    node.pid_file.write_text(f"{pid}\n")
    return pid


def kafka_ready(bootstrap: str, brokers: int = 1, conf: Mapping[str, Any] | None = None) -> bool:
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
