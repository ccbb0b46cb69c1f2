"""The local stack itself (``runlog.stack``): ``up`` twice is one stack, ``status`` and
``env`` say where it listens, a port another stack holds is named. The topic declarations
it creates are tests/test_topics.py's."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from ci_support import IN_CI

from runlog import stack
from runlog._settings import Settings
from runlog.cli import main
from runlog.errors import StackError
from runlog.stack import _registry as stack_registry


@pytest.fixture
def embedded(stack_source: str, settings: Settings) -> stack.StackConfig:
    """The embedded stack's config; these tests are about runlog.stack itself."""
    if stack_source != "embedded":
        if IN_CI:
            pytest.fail(f"CI must run the embedded stack, got {stack_source!r}")
        pytest.skip(f"tests of runlog.stack need the embedded stack (using {stack_source!r})")
    return stack.StackConfig.from_env()


def _our_kafka_processes(cfg: stack.StackConfig) -> list[int]:
    marker = str(cfg.nodes()[0].server_properties).encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes()
        except OSError:
            continue
        if b"kafka.Kafka" in cmdline and marker in cmdline:
            pids.append(int(proc.name))
    return pids


@pytest.mark.stack
def test_up_twice_is_still_one_stack(embedded: stack.StackConfig) -> None:
    first = stack.up(embedded)
    second = stack.up(embedded)
    assert first.running and second.running
    assert [s.pid for s in first.services] == [s.pid for s in second.services]
    assert all(s.pid for s in second.services if s.managed)
    assert _our_kafka_processes(embedded) == [second.services[0].pid]

    st = stack.status(embedded)
    assert st.running
    assert st.bootstrap_servers == f"127.0.0.1:{embedded.kafka_port}"
    kafka = st.services[0]
    assert kafka.log_file is not None and kafka.log_file.is_file()
    assert kafka.data_dir is not None and (kafka.data_dir / "meta.properties").is_file()
    described = st.describe()
    assert "running" in described and str(embedded.state_dir) in described


@pytest.mark.stack
def test_status_and_env_commands(
    embedded: stack.StackConfig, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stack", "status"]) == 0
    assert f"127.0.0.1:{embedded.kafka_port}" in capsys.readouterr().out

    assert main(["stack", "env"]) == 0
    exported = {}
    for line in capsys.readouterr().out.splitlines():
        word, assignment = line.split(" ", 1)
        assert word == "export"
        key, value = assignment.split("=", 1)
        exported[key] = shlex.split(value)[0]
    expected = stack.env(embedded)
    # Printed only for a registry the user started (stack up --registry), never for one
    # that something else, e.g. this test session, started.
    url = stack_registry.advertised_url(embedded)
    if url is not None:
        expected["RUNLOG_SCHEMA_REGISTRY_URL"] = url
    assert exported == expected
    assert exported["RUNLOG_BOOTSTRAP_SERVERS"] == embedded.bootstrap_servers


@pytest.mark.stack
def test_port_taken_by_another_stack_is_named(embedded: stack.StackConfig, tmp_path: Path) -> None:
    other = stack.StackConfig(
        state_dir=tmp_path / "state",
        cache_dir=embedded.cache_dir,
        kafka_port=embedded.kafka_port,
        controller_port=embedded.controller_port,
        redis_port=embedded.redis_port,
    )
    with pytest.raises(StackError, match=str(embedded.kafka_port)):
        stack.up(other, timeout=5)
