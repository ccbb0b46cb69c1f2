"""Kafka's jars and the Java that runs them, without the network or a process.

``runlog.stack._jars`` (docs/howto/local-stack.md): the jars are resolved with Maven once per
``pom.xml`` content into ``<cache>/kafka-<version>/`` and reused as long as the pom is
unchanged; ``up`` fails with a clear message when Java or Maven is missing or Java is older
than 17. ``PATH`` points at an empty folder, so neither ``mvn`` nor ``java`` is found, and
``java -version`` is answered by a stand-in for ``subprocess.run``.
"""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path
from typing import Any

import pytest

from runlog.errors import StackError
from runlog.stack import _jars
from runlog.stack._config import KAFKA_VERSION, POM_PATH, StackConfig


@pytest.fixture
def no_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing on PATH, no JAVA_HOME."""
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv("JAVA_HOME", raising=False)


def _config(tmp_path: Path) -> StackConfig:
    return StackConfig.from_env({"HOME": str(tmp_path), "RUNLOG_CACHE_DIR": str(tmp_path / "c")})


def _stamp(cfg: StackConfig, text: str) -> Path:
    cfg.jars_dir.mkdir(parents=True, exist_ok=True)
    (cfg.jars_dir / f"kafka_2.13-{KAFKA_VERSION}.jar").write_bytes(b"jar")
    (cfg.jars_dir / ".pom-sha256").write_text(text)
    return cfg.jars_dir


def test_jars_resolved_for_this_pom_are_reused_without_maven(
    tmp_path: Path, no_tools: None
) -> None:
    cfg = _config(tmp_path)
    assert cfg.jars_dir == tmp_path / "c" / f"kafka-{KAFKA_VERSION}"
    jars = _stamp(cfg, hashlib.sha256(POM_PATH.read_bytes()).hexdigest() + "\n")
    echoed: list[str] = []
    assert _jars.resolve_jars(cfg, echoed.append) == jars
    assert echoed == []  # nothing to resolve, nothing said
    assert (jars / f"kafka_2.13-{KAFKA_VERSION}.jar").read_bytes() == b"jar"


@pytest.mark.parametrize("stamp", [None, "0" * 64, "not a digest"])
def test_jars_of_another_pom_are_resolved_again_and_a_missing_maven_is_named(
    tmp_path: Path, no_tools: None, stamp: str | None
) -> None:
    cfg = _config(tmp_path)
    if stamp is not None:
        _stamp(cfg, stamp)
    with pytest.raises(StackError) as err:
        _jars.resolve_jars(cfg)
    assert "mvn" in str(err.value) and str(cfg.jars_dir) in str(err.value)


def test_java_is_taken_from_java_home_first_and_its_absence_is_named(
    tmp_path: Path, no_tools: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(StackError) as err:
        _jars.java_binary()
    assert "java" in str(err.value) and "JAVA_HOME" in str(err.value)

    home = tmp_path / "jdk-21"
    (home / "bin").mkdir(parents=True)
    (home / "bin/java").write_text("")
    monkeypatch.setenv("JAVA_HOME", str(home))
    assert _jars.java_binary() == str(home / "bin/java")

    monkeypatch.setenv("JAVA_HOME", str(tmp_path / "no-such-jdk"))  # set, but no bin/java
    with pytest.raises(StackError):
        _jars.java_binary()


def _java_says(monkeypatch: pytest.MonkeyPatch, stderr: str) -> list[list[str]]:
    ran: list[list[str]] = []

    def run(cmd: list[str], **kw: Any) -> subprocess.CompletedProcess[str]:
        ran.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr=stderr)

    monkeypatch.setattr(_jars.subprocess, "run", run)
    return ran


@pytest.mark.parametrize(
    ("says", "major"),
    [
        ('openjdk version "1.8.0_392"', 8),
        ('openjdk version "11.0.21" 2023-10-17', 11),
        ('java version "16"', 16),
    ],
)
def test_a_java_older_than_17_is_refused_naming_its_version(
    monkeypatch: pytest.MonkeyPatch, says: str, major: int
) -> None:
    ran = _java_says(monkeypatch, says)
    with pytest.raises(StackError) as err:
        _jars.check_java_version("/opt/java/bin/java")
    assert ran == [["/opt/java/bin/java", "-version"]]
    message = str(err.value)
    assert f"Java {major}" in message and "17" in message and "/opt/java/bin/java" in message


@pytest.mark.parametrize(
    "says", ['openjdk version "17.0.9" 2023-10-17', 'openjdk version "21" 2023-09-19']
)
def test_java_17_or_newer_is_accepted(monkeypatch: pytest.MonkeyPatch, says: str) -> None:
    _java_says(monkeypatch, says)
    _jars.check_java_version("java")


def test_a_java_that_cannot_run_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def run(cmd: list[str], **kw: Any) -> Any:
        raise PermissionError(13, "Permission denied", cmd[0])

    monkeypatch.setattr(_jars.subprocess, "run", run)
    with pytest.raises(StackError) as err:
        _jars.check_java_version("/opt/java/bin/java")
    assert "/opt/java/bin/java" in str(err.value)
