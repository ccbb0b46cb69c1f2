"""A local Redis Cluster of three masters from Debian's ``redis-server`` (no replicas).

``runlog stack up --redis-cluster`` starts it beside the stack's single Redis; clients use
it with ``RUNLOG_REDIS_CLUSTER=1`` and ``RUNLOG_REDIS_URL`` naming any of its nodes
(``runlog stack env --redis-cluster`` prints both). Ports: ``RUNLOG_STACK_REDIS_CLUSTER_PORT``
and the two after it (default 17000-17002); state under ``<stack dir>/redis-cluster``.
It is for development and tests: no replicas, no persistence beyond the stack's life.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

from runlog.errors import RunlogError

HOST = "127.0.0.1"
MASTERS = 3
DEFAULT_PORT = 17000


class ClusterError(RunlogError):
    """The local Redis Cluster could not be started or is not healthy."""


def first_port() -> int:
    return int(os.environ.get("RUNLOG_STACK_REDIS_CLUSTER_PORT", DEFAULT_PORT))


def ports() -> list[int]:
    return [first_port() + i for i in range(MASTERS)]


def url() -> str:
    """A startup node: the client discovers the others from it."""
    return f"redis://{HOST}:{ports()[0]}/0"


def _dir(state_dir: Path, port: int | None = None) -> Path:
    root = state_dir / "redis-cluster"
    return root if port is None else root / str(port)


def _cli(*args: str, timeout: float = 30) -> str:
    out = subprocess.run(
        ["redis-cli", *args], capture_output=True, text=True, timeout=timeout, check=False
    )
    if out.returncode != 0:
        raise ClusterError(f"redis-cli {' '.join(args)}: {out.stderr or out.stdout}")
    return out.stdout


def _info(port: int) -> str | None:
    try:
        return _cli("-h", HOST, "-p", str(port), "cluster", "info", timeout=5)
    except (ClusterError, subprocess.TimeoutExpired, OSError):
        return None


def healthy() -> bool:
    return all("cluster_state:ok" in (_info(p) or "") for p in ports())


def up(state_dir: Path, *, timeout: float = 60.0) -> str:
    """Start the three masters (idempotent), assign the slots once, wait until ``ok``."""
    if healthy():
        return url()
    server = shutil.which("redis-server")
    if server is None:
        raise ClusterError("redis-server not found (apt-get install redis-server)")
    for port in ports():
        if _info(port) is not None:
            continue
        folder = _dir(state_dir, port)
        folder.mkdir(parents=True, exist_ok=True)
        conf = folder / "redis.conf"
        conf.write_text(
            "\n".join(
                [
                    f"port {port}",
                    f"bind {HOST}",
                    "cluster-enabled yes",
                    f"cluster-config-file {folder / 'nodes.conf'}",
                    "cluster-node-timeout 5000",
                    f"dir {folder}",
                    "appendonly yes",
                    "appendfsync everysec",
                    'save ""',
                    "maxmemory-policy noeviction",
                    "daemonize yes",
                    f"pidfile {folder / 'redis.pid'}",
                    f"logfile {folder / 'redis.log'}",
                    "",
                ]
            )
        )
        subprocess.run([server, str(conf)], check=True, timeout=30)
    deadline = time.monotonic() + timeout
    while any(_info(p) is None for p in ports()):
        if time.monotonic() > deadline:
            raise ClusterError("redis-server nodes did not answer")
        time.sleep(0.05)
    if "cluster_slots_assigned:0" in (_info(ports()[0]) or ""):
        _cli(
            "--cluster",
            "create",
            *[f"{HOST}:{p}" for p in ports()],
            "--cluster-replicas",
            "0",
            "--cluster-yes",
            timeout=timeout,
        )
    while not healthy():
        if time.monotonic() > deadline:
            raise ClusterError(f"cluster not ok after {timeout:.0f}s: {_info(ports()[0])}")
        time.sleep(0.1)
    return url()


def down(state_dir: Path, *, timeout: float = 30.0) -> None:
    """Stop the masters (SIGTERM, then SIGKILL); their data stays in the state dir."""
    for port in ports():
        pid_file = _dir(state_dir, port) / "redis.pid"
        try:
            pid = int(pid_file.read_text().strip())
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError):
            continue
        if b"redis-server" not in cmdline or str(port).encode() not in cmdline:
            continue  # the pid file is stale and the pid is someone else's now
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
