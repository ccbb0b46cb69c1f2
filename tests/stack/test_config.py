"""Where the local stacks live and listen: ``StackConfig.from_env`` over an ``environ`` dict.

``runlog.stack._config`` (the ``runlog.stack`` docstring, docs/howto/local-stack.md,
docs/reference/settings.md): each kind of stack (plain, ``nodes=3`` cluster, secure) reads its
own ``RUNLOG_<KIND>_*`` variables and has its own default ports and state dir; a bad port is
refused naming its variable; ``RUNLOG_REDIS_URL`` applies to the plain stack only, and not
when it names the stack's own Redis. Never the real environment: every test passes HOME.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from runlog.errors import StackError
from runlog.stack._config import (
    KAFKA_VERSION,
    POM_PATH,
    ServiceStatus,
    StackConfig,
    StackStatus,
)

KINDS: dict[str, dict[str, Any]] = {
    "STACK": {"nodes": 1, "secure": False},
    "CLUSTER": {"nodes": 3, "secure": False},
    "SECURE": {"nodes": 1, "secure": True},
}
PORT_VARS = [
    f"RUNLOG_{kind}_{service}_PORT"
    for kind in KINDS
    for service in ("KAFKA", "CONTROLLER", "REDIS", *(("INTERNAL",) if kind == "SECURE" else ()))
]


def _cfg(home: Path, kind: str = "STACK", **env: str) -> StackConfig:
    return StackConfig.from_env({"HOME": str(home), **env}, **KINDS[kind])


def test_each_kind_has_its_documented_defaults(tmp_path: Path) -> None:
    home = tmp_path
    plain = _cfg(home)
    assert plain.state_dir == home / ".local/state/runlog/stack"
    assert plain.cache_dir == home / ".cache/runlog"
    assert plain.jars_dir == home / f".cache/runlog/kafka-{KAFKA_VERSION}"
    assert f"<kafka.version>{KAFKA_VERSION}</kafka.version>" in POM_PATH.read_text()
    assert (plain.kafka_port, plain.controller_port, plain.redis_port) == (19092, 19093, 16379)
    assert (plain.kafka_heap, plain.allow_install, plain.external_redis_url) == ("512m", True, None)
    assert plain.bootstrap_servers == "127.0.0.1:19092"
    assert plain.redis_url == "redis://127.0.0.1:16379/0"

    cluster = _cfg(home, "CLUSTER")
    assert cluster.state_dir == home / ".local/state/runlog/cluster-3"
    assert cluster.cache_dir == plain.cache_dir  # the jars are shared
    assert [(n.node_id, n.kafka_port, n.controller_port) for n in cluster.nodes()] == [
        (1, 29092, 29093),
        (2, 29094, 29095),
        (3, 29096, 29097),
    ]
    assert cluster.bootstrap_servers == "127.0.0.1:29092,127.0.0.1:29094,127.0.0.1:29096"
    assert (cluster.redis_port, cluster.kafka_heap) == (26379, "384m")

    secure = _cfg(home, "SECURE")
    assert secure.state_dir == home / ".local/state/runlog/stack-secure"
    ports = (secure.kafka_port, secure.controller_port, secure.redis_port, secure.internal_port)
    assert ports == (19192, 19193, 16479, 19194)
    assert secure.secure and secure.kafka_heap == "384m"
    assert secure.redis_url == "rediss://127.0.0.1:16479/0"  # TLS only


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_reads_only_its_own_variables(tmp_path: Path, kind: str) -> None:
    default = _cfg(tmp_path, kind)
    assert default.port_vars == tuple(
        f"RUNLOG_{kind}_{s}_PORT" for s in ("KAFKA", "CONTROLLER", "REDIS")
    )
    # Blanks allowed; apart, as a cluster's nodes take base + 2i.
    mine = {var: f" {40000 + 1000 * i} " for i, var in enumerate(default.port_vars)}
    mine[f"RUNLOG_{kind}_KAFKA_HEAP"] = "1g"
    others = {
        f"RUNLOG_{k}_{s}_PORT": "50000"
        for k in KINDS
        if k != kind
        for s in ("KAFKA", "CONTROLLER", "REDIS", "INTERNAL")
    } | {f"RUNLOG_{k}_KAFKA_HEAP": "9g" for k in KINDS if k != kind}

    moved = _cfg(tmp_path, kind, **mine, **others)
    assert (moved.kafka_port, moved.controller_port, moved.redis_port) == (40000, 41000, 42000)
    assert moved.kafka_heap == "1g"
    untouched = _cfg(tmp_path, kind, **others)
    assert untouched == default


@given(var=st.sampled_from(PORT_VARS), port=st.integers(-(2**20), 2**20))
def test_a_port_out_of_range_is_refused_naming_its_variable(var: str, port: int) -> None:
    kind = var.split("_")[1]
    env = {"HOME": "/nonexistent-home", var: str(port)}
    if 0 < port < 65536:
        try:
            cfg = StackConfig.from_env(env, **KINDS[kind])
        except StackError as exc:  # a port that meets another, or a node's past 65535
            assert var in str(exc) and ("both" in str(exc) or "65535" in str(exc)), exc
            return
        service = var.split("_")[2].lower()
        assert getattr(cfg, f"{service}_port") == port
    else:
        with pytest.raises(StackError) as err:
            StackConfig.from_env(env, **KINDS[kind])
        assert var in str(err.value) and str(port) in str(err.value)


@pytest.mark.parametrize("value", ["abc", "19092x", "1.5", "0x10", "port 80"])
def test_a_port_that_is_no_number_is_refused_naming_its_variable(
    tmp_path: Path, value: str
) -> None:
    for var in PORT_VARS:
        kind = var.split("_")[1]
        with pytest.raises(StackError) as err:
            _cfg(tmp_path, kind, **{var: value})
        assert var in str(err.value) and value in str(err.value)
    blank = _cfg(tmp_path, RUNLOG_STACK_KAFKA_PORT="  ")  # unset in all but name: the default
    assert blank.kafka_port == 19092


def test_dirs_are_overridden_made_absolute_and_laid_out_as_documented(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = _cfg(tmp_path / "home", RUNLOG_STACK_DIR="rel/state", RUNLOG_CACHE_DIR="/opt/cache")
    state = tmp_path / "rel/state"
    assert cfg.state_dir == state and cfg.state_dir.is_absolute()
    assert cfg.jars_dir == Path(f"/opt/cache/kafka-{KAFKA_VERSION}")
    (node,) = cfg.nodes()
    assert node.dir == state / "kafka/node-1"
    assert node.server_properties == state / "kafka/node-1/server.properties"
    assert (node.data_dir, node.server_log, node.stdout_log) == (
        state / "kafka/node-1/data",
        state / "kafka/node-1/logs/server.log",
        state / "kafka/node-1/logs/stdout.log",
    )
    assert (cfg.redis_log, cfg.redis_conf) == (
        state / "redis/redis.log",
        state / "redis/redis.conf",
    )

    # The secure stack sits beside the plain one unless told where; the cluster has its own.
    assert _cfg(tmp_path, "SECURE", RUNLOG_STACK_DIR="/s/stack/").state_dir == Path(
        "/s/stack-secure"
    )
    assert _cfg(tmp_path, "SECURE", RUNLOG_SECURE_DIR="/sec").state_dir == Path("/sec")
    assert _cfg(tmp_path, "CLUSTER", RUNLOG_STACK_DIR="/s").state_dir == (
        tmp_path / ".local/state/runlog/cluster-3"
    )
    assert _cfg(tmp_path, "CLUSTER", RUNLOG_CLUSTER_DIR="/c").state_dir == Path("/c")
    assert not _cfg(tmp_path, RUNLOG_STACK_NO_INSTALL="1").allow_install


def test_redis_url_names_an_external_redis_for_the_plain_stack_only(tmp_path: Path) -> None:
    other = "redis://cache.internal:6379/2"
    plain = _cfg(tmp_path, RUNLOG_REDIS_URL=other)
    assert plain.external_redis_url == other and plain.redis_url == other
    # After `eval "$(runlog stack env)"` the variable names the stack's own Redis.
    for own in ("redis://127.0.0.1:16379/0", "redis://localhost:16379"):
        assert _cfg(tmp_path, RUNLOG_REDIS_URL=own).external_redis_url is None
    moved = _cfg(
        tmp_path, RUNLOG_REDIS_URL="redis://127.0.0.1:16379/0", RUNLOG_STACK_REDIS_PORT="16400"
    )
    assert moved.external_redis_url == "redis://127.0.0.1:16379/0"  # not its own port any more
    for kind in ("CLUSTER", "SECURE"):
        cfg = _cfg(tmp_path, kind, RUNLOG_REDIS_URL=other)
        assert cfg.external_redis_url is None and other not in cfg.redis_url


def test_a_stack_shape_that_cannot_be_is_refused(tmp_path: Path) -> None:
    with pytest.raises(StackError, match="0"):
        StackConfig.from_env({"HOME": str(tmp_path)}, nodes=0)
    with pytest.raises(StackError, match="secure"):
        StackConfig.from_env({"HOME": str(tmp_path)}, nodes=3, secure=True)
    cluster = _cfg(tmp_path, "CLUSTER")
    assert cluster.node(2).kafka_port == 29094
    with pytest.raises(StackError) as err:
        cluster.node(4)
    assert re.search(r"\b4\b", str(err.value))


def test_the_status_is_running_only_when_every_service_is(tmp_path: Path) -> None:
    def status(*running: bool, managed: bool = True) -> StackStatus:
        services = tuple(
            ServiceStatus(f"s{i}", r, managed, f"127.0.0.1:{1000 + i}")
            for i, r in enumerate(running)
        )
        return StackStatus(services, "127.0.0.1:19092", "redis://r:1/0", tmp_path, tmp_path)

    assert status(True, True).running and not status(True, False).running
    assert status(True).env() == {
        "RUNLOG_BOOTSTRAP_SERVERS": "127.0.0.1:19092",
        "RUNLOG_REDIS_URL": "redis://r:1/0",
    }
    assert "not running" in status(False).describe()
    assert "not managed by runlog" in status(True, managed=False).describe()


@pytest.mark.parametrize(
    ("kind", "env", "named"),
    [
        ("CLUSTER", {"RUNLOG_CLUSTER_KAFKA_PORT": "65533"}, ["RUNLOG_CLUSTER_KAFKA_PORT"]),
        (
            "CLUSTER",
            {"RUNLOG_CLUSTER_KAFKA_PORT": "26375"},
            ["RUNLOG_CLUSTER_KAFKA_PORT", "RUNLOG_CLUSTER_REDIS_PORT"],
        ),
        (
            "STACK",
            {"RUNLOG_STACK_KAFKA_PORT": "19093"},
            ["RUNLOG_STACK_KAFKA_PORT", "RUNLOG_STACK_CONTROLLER_PORT"],
        ),
        (
            "SECURE",
            {"RUNLOG_SECURE_INTERNAL_PORT": "16479"},
            ["RUNLOG_SECURE_INTERNAL_PORT", "RUNLOG_SECURE_REDIS_PORT"],
        ),
    ],
)
def test_ports_that_meet_or_pass_the_last_are_refused_naming_their_variables(
    tmp_path: Path, kind: str, env: dict[str, str], named: list[str]
) -> None:
    """A cluster's node i takes its kind's base ports + 2i: a base near 65535 runs past it,
    and one near another service's port lands on it. Refused before anything starts."""
    with pytest.raises(StackError) as err:
        _cfg(tmp_path, kind, **env)
    assert all(var in str(err.value) for var in named), err.value


def test_tilde_is_the_environments_home_and_no_install_takes_a_false_value(tmp_path: Path) -> None:
    cfg = StackConfig.from_env({"HOME": str(tmp_path), "RUNLOG_STACK_DIR": "~/state"})
    assert cfg.state_dir == tmp_path / "state"
    for off in ("", "0", "false", "no"):
        assert _cfg(tmp_path, "STACK", RUNLOG_STACK_NO_INSTALL=off).allow_install, off
    assert not _cfg(tmp_path, "STACK", RUNLOG_STACK_NO_INSTALL="1").allow_install
