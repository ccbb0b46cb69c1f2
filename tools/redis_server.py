"""A ``redis-server`` of one's own (no persistence, a free port), for a benchmark that counts
its commands or a test that changes the server's configuration (``maxmemory``,
``REPLICAOF``, a long script) where nobody else's client is hurt by it."""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrivateRedis:
    """A ``redis-server`` of the caller's own (no persistence), stopped by ``stop``."""

    def __init__(self) -> None:
        server = shutil.which("redis-server")
        if server is None:
            raise RuntimeError("redis-server is not on PATH (runlog stack up installs it)")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="runlog-redis-")
        self.proc = subprocess.Popen(
            [server, "--port", str(self.port), "--save", "", "--appendonly", "no"],
            cwd=self.dir,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.url = f"redis://127.0.0.1:{self.port}/0"
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url).ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)
