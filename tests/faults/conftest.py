"""Fault tests: a three-node KRaft cluster and a private Redis, brought up for the session.

Run with ``make faults`` (``.venv/bin/python -m pytest -q tests/faults``); the main suite
never collects this directory (``--ignore=tests/faults`` in pyproject's addopts).

The cluster is ``runlog stack up --nodes 3``: its own ports (29092-29097, Redis 26379)
and state dir, so it runs beside the single-node stack, whose Redis is never touched.
It is stopped at the end of the session unless ``RUNLOG_FAULTS_KEEP=1`` (then the next
session reuses it). A summary of every fault injected and everything lost is printed at
the end and written to ``<cluster state dir>/faults-summary.json``
(or ``RUNLOG_FAULTS_SUMMARY``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from ci_support import IN_CI
from faultkit import FaultReport, wait_full_isr
from netns import Nemesis, nemesis_or_fail

from runlog import stack
from runlog._settings import Settings
from runlog.errors import RunlogError

FAULT_TEST_TIMEOUT = 240
LEASE_TTL_MS = 3000
"""Short leases so takeovers after a pause or a Redis outage take seconds, not 15 s."""

_REPORT = FaultReport()
_SUMMARY_PATH: list[Path] = []


@pytest.fixture(scope="session")
def cluster() -> Iterator[stack.StackConfig]:
    cfg = stack.StackConfig.from_env(nodes=3)
    t0 = time.monotonic()
    try:
        stack.up(cfg, timeout=180)
    except RunlogError as exc:
        pytest.fail(f"could not bring up the 3-node cluster: {exc}", pytrace=False)
    _REPORT.durations["cluster_up"] = time.monotonic() - t0
    _SUMMARY_PATH.append(
        Path(os.environ.get("RUNLOG_FAULTS_SUMMARY") or cfg.state_dir / "faults-summary.json")
    )
    yield cfg
    if not os.environ.get("RUNLOG_FAULTS_KEEP"):
        t1 = time.monotonic()
        stack.down(cfg)
        _REPORT.durations["cluster_down"] = time.monotonic() - t1


@pytest.fixture(scope="session")
def settings(cluster: stack.StackConfig) -> Settings:
    """Overrides the main suite's fixture: the cluster, RF 3, short leases."""
    return Settings(
        bootstrap_servers=cluster.bootstrap_servers,
        redis_url=cluster.redis_url,
        replication_factor=3,
        lease_ttl_ms=LEASE_TTL_MS,
    )


@pytest.fixture
def healthy(cluster: stack.StackConfig, test_settings: Settings) -> Iterator[Settings]:
    """Test settings on a cluster with every node and Redis up and every ISR full, after too."""
    _heal(cluster, test_settings)
    yield test_settings
    _heal(cluster, test_settings)


def _heal(cfg: stack.StackConfig, s: Settings) -> None:
    for node in cfg.nodes():
        if stack.node_pid(cfg, node.node_id) is None:
            stack.start_node(cfg, node.node_id)
    if stack.redis_pid(cfg) is None:
        stack.start_redis(cfg)
    wait_full_isr(s)


@pytest.fixture
def nemesis(cluster: stack.StackConfig) -> Iterator[Nemesis]:
    """The network nemesis (tests/faults/netns.py) on a fresh bridge, torn down after.

    Its services are the cluster's brokers and Redis. A machine that cannot make network
    namespaces fails the test under CI (never skips there), and skips it elsewhere.
    """
    services = {"kafka": [n.kafka_port for n in cluster.nodes()], "redis": [cluster.redis_port]}
    with nemesis_or_fail(services, ci=IN_CI) as nem:
        yield nem


@pytest.fixture(scope="session")
def report() -> FaultReport:
    return _REPORT


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(FAULT_TEST_TIMEOUT))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not _REPORT.faults and not _REPORT.durations:
        return
    text = _REPORT.to_json()
    terminalreporter.section("fault summary")
    terminalreporter.write_line(text)
    for path in _SUMMARY_PATH:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
        terminalreporter.write_line(f"written to {path}")
