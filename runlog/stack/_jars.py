"""Kafka's jars: a Java runtime, and the broker resolved from Maven Central with ``mvn``
(``pom.xml`` beside this file) into a cache outside the source tree.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

from runlog.errors import StackError
from runlog.stack._config import KAFKA_VERSION, POM_PATH, Echo, StackConfig
from runlog.stack._processes import locked


def java_binary() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin/java").is_file():
        return str(Path(java_home) / "bin/java")
    java = shutil.which("java")
    if java is None:
        raise StackError(
            "no `java` on PATH (the Kafka broker needs Java 17+): "
            "install it, e.g. `apt-get install -y openjdk-17-jre-headless`, or set JAVA_HOME"
        )
    return java


def check_java_version(java: str) -> None:
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as exc:
        raise StackError(f"cannot run {java}: {exc}") from exc
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if match is None:
        return
    major = int(match.group(1))
    if major == 1 and match.group(2):
        major = int(match.group(2))
    if major < 17:
        raise StackError(
            f"{java} is Java {major}; Kafka {KAFKA_VERSION} needs Java 17+ "
            "(e.g. `apt-get install -y openjdk-17-jre-headless`, or set JAVA_HOME)"
        )


def _pom_hash() -> str:
    return hashlib.sha256(POM_PATH.read_bytes()).hexdigest()


def resolve_jars(config: StackConfig, echo: Echo | None = None) -> Path:
    """The broker's jars, resolved with Maven once per pom content and reused afterwards."""
    target = config.jars_dir
    stamp = target / ".pom-sha256"
    want = _pom_hash()
    if stamp.is_file() and stamp.read_text().strip() == want:
        return target
    with locked(config.cache_dir / ".lock"):
        if stamp.is_file() and stamp.read_text().strip() == want:
            return target
        mvn = shutil.which("mvn")
        if mvn is None:
            raise StackError(
                "no `mvn` on PATH: Maven resolves the Kafka broker's jars from Maven Central "
                f"once (into {target}); install it, e.g. `apt-get install -y maven`"
            )
        if echo:
            echo(f"resolving Kafka {KAFKA_VERSION} jars with Maven into {target} (once) ...")
        work = config.cache_dir / f".resolve-{os.getpid()}"
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        try:
            shutil.copyfile(POM_PATH, work / "pom.xml")
            cmd = [
                mvn,
                "-B",
                "-q",
                "-Dstyle.color=never",
                "-f",
                str(work / "pom.xml"),
                "dependency:copy-dependencies",
                "-DincludeScope=runtime",
                f"-DoutputDirectory={work / 'jars'}",
            ]
            try:
                proc = subprocess.run(
                    cmd, cwd=work, capture_output=True, text=True, timeout=900, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise StackError(
                    f"Maven resolution of Kafka {KAFKA_VERSION} failed: {exc}"
                ) from exc
            jars = sorted((work / "jars").glob("*.jar")) if (work / "jars").is_dir() else []
            if proc.returncode != 0 or not jars:
                output = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-30:])
                raise StackError(
                    f"Maven could not resolve Kafka {KAFKA_VERSION} (exit {proc.returncode}); "
                    f"is Maven Central reachable (proxy in ~/.m2/settings.xml)?\n"
                    f"command: {' '.join(cmd)}\n{output}"
                )
            if not any(j.name.startswith(f"kafka_2.13-{KAFKA_VERSION}") for j in jars):
                raise StackError(f"Maven resolved no kafka_2.13-{KAFKA_VERSION} jar")
            (work / "jars" / ".pom-sha256").write_text(want + "\n")
            shutil.rmtree(target, ignore_errors=True)
            os.replace(work / "jars", target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return target
