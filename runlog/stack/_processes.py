"""The stack's processes: pid files checked against their command line, spawning,
stopping, waiting, and one lock per state dir so two ``up`` never race.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

from runlog.errors import StackError
from runlog.stack._config import HOST

_log = logging.getLogger("runlog.stack")


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock, so two concurrent ``up`` calls start one stack."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def port_answers(port: int, host: str = HOST, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def _reap(pid: int) -> None:
    """Collect a dead child of this process so it stops looking alive (zombie)."""
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def _pid_alive(pid: int, marker: str) -> bool:
    """True if ``pid`` is a live (non-zombie) process whose command line contains ``marker``."""
    _reap(pid)
    proc = Path(f"/proc/{pid}")
    if proc.is_dir():
        try:
            stat = (proc / "stat").read_text()
            state = stat.rsplit(")", 1)[1].split()[0]
            cmdline = (proc / "cmdline").read_bytes()
            # redis-server rewrites its process title at startup; for a few microseconds
            # the command line reads empty, and a freshly started Redis looked dead.
            for _ in range(5):
                if cmdline.strip(b"\0"):
                    break
                time.sleep(0.01)
                cmdline = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            return False
        text = cmdline.replace(b"\0", b" ").decode(errors="replace")
        return state not in ("Z", "X") and marker in text
    try:  # no /proc (not Linux): trust the pid file
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def live_pid(pid_file: Path, marker: str) -> int | None:
    pid = _read_pid(pid_file)
    if pid is not None and _pid_alive(pid, marker):
        return pid
    return None


def tail_of(path: Path, lines: int = 40) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return f"(no {path})"
    return "\n".join(text.splitlines()[-lines:]) or f"({path} is empty)"


def spawn(argv: list[str], *, cwd: Path, stdout: Path, env: Mapping[str, str]) -> int:
    """Start ``argv`` detached from this process (own session), stdout/stderr to a file."""
    stdout.parent.mkdir(parents=True, exist_ok=True)
    with stdout.open("ab") as out, open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            stdin=devnull,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            start_new_session=True,
            close_fds=True,
        )
    return proc.pid


def stop_pid(pid: int, marker: str, timeout: float) -> None:
    if not _pid_alive(pid, marker):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _pid_alive(pid, marker):
            return
        time.sleep(0.1)
    _log.warning("pid %s did not stop after SIGTERM within %.0fs; sending SIGKILL", pid, timeout)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and _pid_alive(pid, marker):
        time.sleep(0.1)


def port_taken_error(port: int, what: str, env_var: str) -> StackError:
    return StackError(
        f"port {HOST}:{port} ({what}) is in use by a process that is not runlog's stack "
        f"in this state dir; stop it or choose another port with {env_var}=..."
    )


def _wait_gone(pid: int, timeout: float = 30.0) -> None:
    """Wait until ``pid`` has really exited (reaped or a zombie), whatever its command line.

    A JVM tearing down can already show an empty command line while it still holds its
    data dir lock and ports; a restart in that window fails.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _reap(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return
        if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
            return
        time.sleep(0.05)


def signal_and_wait(pid_file: Path, marker: str, sig: int, *, stop_timeout: float) -> int | None:
    """Signal the live process of ``pid_file`` and wait until it has exited: SIGKILL at
    once, any other signal as a clean stop (SIGKILL after ``stop_timeout``). Returns the
    pid signalled, or None if it was not running."""
    pid = live_pid(pid_file, marker)
    if pid is None:
        return None
    if sig == signal.SIGKILL:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    else:
        stop_pid(pid, marker, timeout=stop_timeout)
    _wait_gone(pid)
    return pid
