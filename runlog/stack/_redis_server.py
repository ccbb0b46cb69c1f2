"""The stack's Redis: Debian's ``redis-server`` with an append-only file (installed if
missing, unless ``RUNLOG_STACK_NO_INSTALL``).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from runlog.errors import StackError
from runlog.stack import _secure as _secure
from runlog.stack._config import HOST, Echo, StackConfig
from runlog.stack._processes import spawn


def redis_ping(url: str, **kw: Any) -> bool:
    import redis

    try:
        client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, **kw)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except (redis.RedisError, OSError, ValueError):
        return False


def redis_server(config: StackConfig, echo: Echo | None) -> str:
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
REDIS_MARKER = "redis-server"


def redis_conf(config: StackConfig) -> str:
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


def spawn_redis(config: StackConfig, server: str) -> int:
    (config.redis_dir / "data").mkdir(parents=True, exist_ok=True)
    if config.secure:
        _secure.write_redis_acl(config)
    config.redis_conf.write_text(redis_conf(config))
    pid = spawn(
        [server, str(config.redis_conf)],
        cwd=config.redis_dir,
        stdout=config.redis_dir / "stdout.log",
        env=os.environ,
    )
    config.redis_pid_file.write_text(f"{pid}\n")
    return pid
