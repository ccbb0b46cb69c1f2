"""Restate beside runlog in section 8: the same durable step, each a ``ctx.run``.

Restate's engine is a Rust server (``restate-server``, from the npm registry's
``@restatedev/restate-server`` platform package, fetched once into the cache beside
Kafka's jars, ``~/.cache/runlog``); its Python handlers run in a process of their own,
served over HTTP/2 (``restate_handler``: ``restate-sdk`` and Hypercorn, the ``peers``
extra). The bench starts the server on loopback with its default configuration (its
default durability: the log and the partition store on local RocksDB, fsync per write
batch; only its usage telemetry turned off) in a state directory of its own beside the
stack's, starts the handler process, registers it with the server's admin API and times
invocations through the ingress:

* ``one_run``: one invocation of ``n`` steps (after one of 20 to warm up): wall time per
  step, as ``runlog_safe`` is timed;
* ``fanout``: ``runs`` invocations of ``steps_per_run`` steps at once (one client thread
  and connection each, released together): steps per second from the release to the last
  reply.

CPU per step of each: the SDK process and the server, each read from ``/proc/<pid>/stat``
(the bench process, which only sends the requests, is given apart as ``client``).

Where the server or the SDK cannot be had, :func:`measure` returns ``{"status": "not
measured: why"}`` and the rest of the bench runs.
"""

from __future__ import annotations

import contextlib
import http.client
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runlog.stack._config import StackConfig
from runlog.stack._processes import locked
from tools import child_env
from tools.benchmarks.common import summary

RESTATE_VERSION = "1.7.12"
NPM_PACKAGE = "@restatedev/restate-server"
SERVER_ENV = "RUNLOG_BENCH_RESTATE_SERVER"
"""A ``restate-server`` binary to use instead of the one fetched from the npm registry."""

SERVICE = "runlog_bench"
HANDLER = "steps"
"""The service and handler ``restate_handler`` serves: ``steps(n)`` makes ``n`` steps."""

HOST = "127.0.0.1"
START_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 600.0
WARM_UP_STEPS = 20


class Unavailable(Exception):
    """The server or the SDK cannot be had here; the message says why."""


def _npm_platform() -> str:
    """The suffix of the npm package that ships the server for this machine."""
    arch = {"x86_64": "x64", "amd64": "x64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower()
    )
    system = {"linux": "linux", "darwin": "darwin"}.get(sys.platform)
    if arch is None or system is None:
        raise Unavailable(
            f"no {NPM_PACKAGE} build for {sys.platform}/{platform.machine()} "
            f"(set {SERVER_ENV} to a restate-server binary)"
        )
    return f"{system}-{arch}"


def server_binary(cache_dir: Path | None = None) -> Path:
    """``restate-server`` {RESTATE_VERSION}: ``$RUNLOG_BENCH_RESTATE_SERVER``, else the copy
    in the cache, fetched there once with ``npm pack`` of the platform package (the one
    ``@restatedev/restate-server`` depends on for this machine; its install script, a
    telemetry beacon, never runs)."""
    given = os.environ.get(SERVER_ENV)
    if given:
        path = Path(given).expanduser()
        if not os.access(path, os.X_OK):
            raise Unavailable(f"{SERVER_ENV}={given} is not an executable file")
        return path
    cache = cache_dir or StackConfig.from_env().cache_dir
    target = cache / f"restate-server-{RESTATE_VERSION}" / "restate-server"
    if target.is_file():
        return target
    package = f"{NPM_PACKAGE}-{_npm_platform()}@{RESTATE_VERSION}"
    npm = shutil.which("npm")
    if npm is None:
        raise Unavailable(f"no `npm` on PATH to fetch {package} (or set {SERVER_ENV})")
    with locked(cache / ".lock"):
        if target.is_file():
            return target
        work = cache / f".restate-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            try:
                proc = subprocess.run(
                    [npm, "pack", "--silent", "--pack-destination", str(work), package],
                    cwd=work,
                    capture_output=True,
                    text=True,
                    timeout=900,
                    check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise Unavailable(f"`npm pack {package}` failed: {exc}") from exc
            tarballs = list(work.glob("*.tgz"))
            if proc.returncode != 0 or len(tarballs) != 1:
                tail = " ".join((proc.stdout + proc.stderr).split()[-40:])
                raise Unavailable(f"`npm pack {package}` exit {proc.returncode}: {tail}")
            with tarfile.open(tarballs[0]) as tar:
                member = tar.getmember("package/bin/restate-server")
                src = tar.extractfile(member)
                if src is None:
                    raise Unavailable(f"{package} holds no bin/restate-server")
                staged = work / "restate-server"
                with src, staged.open("wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
            staged.chmod(0o755)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(staged, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target


def sdk_version() -> str:
    """The installed ``restate-sdk`` (and Hypercorn), or :class:`Unavailable`."""
    for module, dist in (("restate", "restate-sdk"), ("hypercorn", "hypercorn")):
        if importlib.util.find_spec(module) is None:
            raise Unavailable(f"{dist} not installed (pip install -e '.[peers]')")
    return importlib.metadata.version("restate-sdk")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _port_answers(port: int) -> bool:
    with socket.create_connection((HOST, port), 1):
        return True


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/<pid>/stat``)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    # After the command's closing parenthesis: state is field 3, utime 14, stime 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _http(
    port: int, method: str, path: str, body: Any = None, timeout: float = 10.0
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {} if data is None else {"content-type": "application/json"}
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


@dataclass
class Restate:
    """A running server and handler process, the handler registered."""

    server: subprocess.Popen[bytes]
    handler: subprocess.Popen[bytes]
    ingress_port: int
    admin_port: int

    def invoke(self, n: int) -> None:
        """One invocation of the handler: ``n`` durable steps, returned when all are done."""
        status, body = _http(
            self.ingress_port, "POST", f"/{SERVICE}/{HANDLER}", n, timeout=CALL_TIMEOUT_S
        )
        if status != 200 or json.loads(body) != n:
            raise RuntimeError(f"Restate invocation answered {status}: {body[:200]!r}")

    def cpu(self) -> tuple[float, float]:
        """CPU seconds so far of (the handler process, the server)."""
        return cpu_s(self.handler.pid), cpu_s(self.server.pid)


def _stop(proc: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _log_tail(path: Path) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-8:])
    except OSError:
        return ""


def _wait_for(
    what: str, ready: Any, procs: dict[str, tuple[subprocess.Popen[bytes], Path]]
) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        for name, (proc, log) in procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}: {_log_tail(log)}")
        with contextlib.suppress(OSError, http.client.HTTPException):
            if ready():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready in {START_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def running(binary: Path) -> Iterator[Restate]:
    """The server on loopback ports of its own, state in a fresh directory beside the
    stack's (the same disk as Kafka's), and the handler process registered with it."""
    state_parent = StackConfig.from_env().state_dir.parent
    state_parent.mkdir(parents=True, exist_ok=True)
    ingress, admin, node, sdk = (_free_port() for _ in range(4))
    with tempfile.TemporaryDirectory(prefix="restate-bench-", dir=state_parent) as tmp:
        base = Path(tmp)
        env = {
            **os.environ,
            "RESTATE_INGRESS__BIND_ADDRESS": f"{HOST}:{ingress}",
            "RESTATE_ADMIN__BIND_ADDRESS": f"{HOST}:{admin}",
            "RESTATE_DISABLE_TELEMETRY": "true",
        }
        server_log, handler_log = base / "server.log", base / "handler.log"
        with contextlib.ExitStack() as stack:
            with server_log.open("wb") as out:
                server = subprocess.Popen(
                    [
                        str(binary),
                        "--no-logo",
                        "--listen-mode",
                        "tcp",
                        "--bind-address",
                        f"{HOST}:{node}",
                        "--advertised-address",
                        f"http://{HOST}:{node}/",
                        "--base-dir",
                        str(base / "data"),
                    ],
                    cwd=base,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            stack.callback(_stop, server)  # (a second stop of a stopped process does nothing)
            with handler_log.open("wb") as out:
                handler = subprocess.Popen(
                    [sys.executable, "-m", "tools.benchmarks.restate_handler", str(sdk)],
                    env=child_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
            # The SDK answers SIGTERM by draining its invocations (up to minutes); it keeps
            # nothing, and the server has stopped (closing its streams) when it is told.
            stack.callback(_stop, handler, 0.5)
            stack.callback(_stop, server)  # first
            procs = {"restate-server": (server, server_log), "handler": (handler, handler_log)}
            _wait_for(
                "the Restate admin API", lambda: _http(admin, "GET", "/health")[0] == 200, procs
            )
            _wait_for("the handler process", lambda: _port_answers(sdk), procs)
            status, body = _http(
                admin, "POST", "/deployments", {"uri": f"http://{HOST}:{sdk}"}, timeout=60
            )
            if status not in (200, 201):
                raise RuntimeError(f"registering the handler: {status} {body[:300]!r}")
            _wait_for(
                "the Restate ingress",
                lambda: _http(ingress, "GET", "/restate/health")[0] == 200,
                procs,
            )
            yield Restate(server, handler, ingress, admin)


def _fanout(restate: Restate, runs: int, steps: int) -> dict[str, float]:
    gate = threading.Barrier(runs + 1)
    errors: list[Exception] = []

    def work() -> None:
        gate.wait()
        try:
            restate.invoke(steps)
        except (OSError, RuntimeError, ValueError, http.client.HTTPException) as exc:
            # Raised below, after every thread is joined.
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(runs)]
    for t in threads:
        t.start()
    sdk0, server0 = restate.cpu()
    c0, w0 = time.process_time(), time.perf_counter()
    gate.wait()
    for t in threads:
        t.join()
    wall, client = time.perf_counter() - w0, time.process_time() - c0
    sdk1, server1 = restate.cpu()
    if errors:
        raise errors[0]
    total = runs * steps
    return {
        "steps_per_s": total / wall,
        "sdk_cpu_ms_per_step": (sdk1 - sdk0) / total * 1000,
        "server_cpu_ms_per_step": (server1 - server0) / total * 1000,
        "client_cpu_ms_per_step": client / total * 1000,
    }


def measure(*, n: int, repeats: int, runs: int, steps_per_run: int) -> dict[str, Any]:
    """Both shapes, ``repeats`` times each, on one server and handler process; or why not."""
    try:
        sdk = sdk_version()
        binary = server_binary()
    except Unavailable as why:
        return {"status": f"not measured: {why}"}
    one: dict[str, list[float]] = {"ms_per_step": [], "sdk_cpu": [], "server_cpu": []}
    fan: dict[str, list[float]] = {}
    try:
        with running(binary) as restate:
            restate.invoke(WARM_UP_STEPS)
            _fanout(restate, runs, 1)  # warm up: the server's connections to the handler
            for _ in range(repeats):
                restate.invoke(WARM_UP_STEPS)
                sdk0, server0 = restate.cpu()
                w0 = time.perf_counter()
                restate.invoke(n)
                wall = time.perf_counter() - w0
                sdk1, server1 = restate.cpu()
                one["ms_per_step"].append(wall / n * 1000)
                one["sdk_cpu"].append((sdk1 - sdk0) / n * 1000)
                one["server_cpu"].append((server1 - server0) / n * 1000)
                for key, value in _fanout(restate, runs, steps_per_run).items():
                    fan.setdefault(key, []).append(value)
    except (OSError, RuntimeError, ValueError, http.client.HTTPException) as exc:
        return {"status": f"failed: {type(exc).__name__}: {exc}"}
    return {
        "server": f"restate-server {RESTATE_VERSION}",
        "sdk": f"restate-sdk {sdk}",
        "steps_per_run": n,
        "one_run": {
            "ms_per_step": summary(one["ms_per_step"]),
            "sdk_cpu_ms_per_step": summary(one["sdk_cpu"]),
            "server_cpu_ms_per_step": summary(one["server_cpu"]),
        },
        "fanout": {
            "runs": runs,
            "steps_per_run": steps_per_run,
            **{key: summary(values) for key, values in fan.items()},
        },
    }
