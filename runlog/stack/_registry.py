"""A Confluent-compatible schema registry beside the stack: Apicurio Registry, from Maven.

Apicurio publishes a ready-to-run archive on Maven Central
(``io.apicurio:apicurio-registry-app:<version>:tar.gz:all``); it runs on the system Java 17
with in-memory storage and serves Confluent's API under ``/apis/ccompat/v7``, which is what
runlog's writers and confluent-kafka's ``AvroSerializer``/``AvroDeserializer`` speak.
In-memory storage is a local convenience: a restart forgets every id (run
``runlog schemas register`` again). Production uses a registry with durable storage.

The archive is cached like the Kafka jars; the process's state (pid, log) lives in the
stack's state dir. Both ports are bound to 127.0.0.1 (Quarkus' management port otherwise
listens on every interface).

``runlog stack env`` exports the registry's URL only when it was started for the user
(``runlog stack up --registry`` leaves a marker beside its pid file): a registry that a test
session or a tool started for itself never switches the user's writers to Confluent's format.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from runlog.errors import StackError
from runlog.stack._config import HOST, StackConfig
from runlog.stack._jars import java_binary
from runlog.stack._processes import live_pid, locked, port_answers, spawn, stop_pid, tail_of

APICURIO_VERSION = "3.0.9"
ARTIFACT = f"io.apicurio:apicurio-registry-app:{APICURIO_VERSION}:tar.gz:all"
DEFAULT_REGISTRY_PORT = 18081
_MARKER = f"apicurio-registry-app-{APICURIO_VERSION}-runner.jar"

Echo = Callable[[str], None]


@dataclass(frozen=True)
class RegistryPaths:
    cache: Path
    state: Path
    port: int

    @classmethod
    def of(cls, cfg: StackConfig, environ: Mapping[str, str] | None = None) -> RegistryPaths:
        e = os.environ if environ is None else environ
        raw = e.get("RUNLOG_STACK_REGISTRY_PORT")
        port = int(raw) if raw else DEFAULT_REGISTRY_PORT
        return cls(cfg.cache_dir / f"apicurio-{APICURIO_VERSION}", cfg.state_dir / "registry", port)

    @property
    def jar(self) -> Path:
        return self.cache / _MARKER

    @property
    def pid_file(self) -> Path:
        return self.state / "registry.pid"

    @property
    def advertised(self) -> Path:
        """Present while ``runlog stack env`` is to export the registry (``up --registry``)."""
        return self.state / "advertised"

    @property
    def log(self) -> Path:
        return self.state / "registry.log"

    @property
    def url(self) -> str:
        """What clients use: ``RUNLOG_SCHEMA_REGISTRY_URL``."""
        return f"http://{HOST}:{self.port}/apis/ccompat/v7"


def _extract(tar: tarfile.TarFile, out: Path) -> None:
    """Unpack the registry's archive into ``out``: regular files and folders below ``out``
    only (the archive holds nothing else), anything else refused with its name.

    The standard library's ``filter="data"`` says as much, but exists from Python 3.11.4
    on (Debian 12's python3 is 3.11.2, where ``extractall`` refuses the argument), so the
    members are checked here, and the filter is used where there is one."""
    root = out.resolve()
    members = []
    for m in tar.getmembers():
        dest = (root / m.name).resolve()
        if not (m.isfile() or m.isdir()) or not dest.is_relative_to(root):
            raise StackError(
                f"{ARTIFACT}: refusing archive member {m.name!r} (only files and folders "
                f"below the archive's root are unpacked)"
            )
        members.append(m)
    if hasattr(tarfile, "data_filter"):  # where it exists, its checks too
        tar.extractall(root, members=members, filter="data")
    else:
        tar.extractall(root, members=members)


def fetch(paths: RegistryPaths, echo: Echo | None = None) -> Path:
    """The registry's runner jar, fetched with Maven once and kept in the cache."""
    if paths.jar.is_file():
        return paths.jar
    with locked(paths.cache.parent / ".lock"):
        if paths.jar.is_file():
            return paths.jar
        mvn = shutil.which("mvn")
        if mvn is None:
            raise StackError("no `mvn` on PATH: Maven fetches the schema registry's archive")
        if echo:
            echo(f"fetching Apicurio Registry {APICURIO_VERSION} with Maven (once) ...")
        work = paths.cache.parent / f".registry-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            cmd = [
                mvn,
                "-B",
                "-q",
                "dependency:copy",
                f"-Dartifact={ARTIFACT}",
                f"-DoutputDirectory={work}",
            ]
            proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=900)
            archives = list(work.glob("*.tar.gz"))
            if proc.returncode != 0 or not archives:
                tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
                raise StackError(f"Maven could not fetch {ARTIFACT}:\n{tail}")
            out = work / "app"
            with tarfile.open(archives[0]) as tar:
                _extract(tar, out)
            jars = list(out.rglob(_MARKER))
            if not jars:
                raise StackError(f"{ARTIFACT} holds no {_MARKER}")
            shutil.rmtree(paths.cache, ignore_errors=True)
            os.replace(jars[0].parent, paths.cache)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return paths.jar


def answers(url: str, timeout: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/subjects", timeout=timeout) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def running(paths: RegistryPaths) -> int | None:
    return live_pid(paths.pid_file, _MARKER)


def up(
    cfg: StackConfig, *, timeout: float = 60.0, echo: Echo | None = None, advertise: bool = False
) -> str:
    """Start the registry if it is not running; its URL once it answers Confluent's API.

    ``advertise``: the user asked for it (``runlog stack up --registry``), so ``runlog stack
    env`` exports it from now on, until ``down``."""
    paths = RegistryPaths.of(cfg)
    pid = running(paths)
    if pid is None:
        for port in (paths.port, paths.port + 1):
            if port_answers(port):
                raise StackError(
                    f"port {port} is taken (schema registry); set RUNLOG_STACK_REGISTRY_PORT "
                    "to move the registry and its management port (the next one)"
                )
        jar = fetch(paths, echo)
        argv = [
            java_binary(),
            "-Xmx256m",
            f"-Dquarkus.http.host={HOST}",
            f"-Dquarkus.http.port={paths.port}",
            f"-Dquarkus.management.host={HOST}",
            f"-Dquarkus.management.port={paths.port + 1}",
            "-jar",
            str(jar),
        ]
        paths.state.mkdir(parents=True, exist_ok=True)
        pid = spawn(argv, cwd=paths.state, stdout=paths.log, env=os.environ)
        paths.pid_file.write_text(f"{pid}\n")
        if echo:
            echo(f"starting schema registry on {paths.url} ...")
    deadline = time.monotonic() + timeout
    while not answers(paths.url):
        if running(paths) is None:
            raise StackError(f"the schema registry exited.\n{tail_of(paths.log)}")
        if time.monotonic() > deadline:
            raise StackError(
                f"schema registry not ready after {timeout:.0f}s.\n{tail_of(paths.log)}"
            )
        time.sleep(0.25)
    if advertise:
        paths.advertised.write_text(f"{paths.url}\n")
    return paths.url


def down(cfg: StackConfig, *, timeout: float = 30.0) -> None:
    paths = RegistryPaths.of(cfg)
    pid = running(paths)
    if pid is not None:
        stop_pid(pid, _MARKER, timeout)
    paths.pid_file.unlink(missing_ok=True)
    paths.advertised.unlink(missing_ok=True)


def advertised_url(cfg: StackConfig) -> str | None:
    """The URL ``runlog stack env`` exports: running, and started with ``--registry``."""
    paths = RegistryPaths.of(cfg)
    if running(paths) is None or not paths.advertised.exists():
        return None
    return paths.url


def url_if_running(cfg: StackConfig) -> str | None:
    paths = RegistryPaths.of(cfg)
    return paths.url if running(paths) is not None else None
