"""``runlog bench`` and ``runlog demo``: clone-only commands, loading the tooling beside runlog.

In a clone (this tree) they find ``tools/`` next to ``runlog/`` and run; from a copy of the
installed package alone (what a wheel installs: no ``tools/``, no pyproject.toml) they stop
with exit 1, saying they are clone-only, and import no tooling. Neither case needs the stack
(``bench integrity`` measures CPU only; the refusal comes before any connection).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Runs the CLI and reports whether any tooling module was imported, on its last line.
PROBE = (
    "import sys\n"
    "from runlog.cli import main\n"
    "rc = main(sys.argv[1:])\n"
    "print('tooling loaded:', sorted(m for m in sys.modules if m.split('.')[0] == 'tools'))\n"
    "sys.exit(rc)\n"
)


def _cli(args: list[str], *, cwd: Path, pythonpath: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run(
        [sys.executable, "-c", PROBE, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The package as a wheel installs it: ``runlog/`` with the owner's folders as real
    files, in a site folder of its own, with nothing of the clone beside it."""
    site = tmp_path_factory.mktemp("site")
    shutil.copytree(ROOT / "runlog", site / "runlog", ignore=shutil.ignore_patterns("__pycache__"))
    return site


def test_in_a_clone_bench_finds_the_tooling_beside_runlog(tmp_path: Path) -> None:
    # From another directory: the clone is found from runlog's own files, not from cwd.
    done = _cli(["bench", "integrity", "--quick"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'tools.benchmarks.integrity'" in done.stdout.splitlines()[-1]


@pytest.mark.parametrize("command", [["bench", "integrity", "--quick"], ["demo", "--runs", "1"]])
def test_without_a_clone_the_command_says_it_is_clone_only(
    installed: Path, tmp_path: Path, command: list[str]
) -> None:
    done = _cli(command, cwd=tmp_path, pythonpath=str(installed))
    assert done.returncode == 1, (done.stdout[-2000:], done.stderr[-2000:])
    assert "clone-only" in done.stderr and f"runlog {command[0]}" in done.stderr
    assert done.stdout.splitlines()[-1] == "tooling loaded: []"
    # The package that ran is the copy, not this clone's.
    check = subprocess.run(
        [sys.executable, "-c", "import runlog; print(runlog.__file__)"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(installed)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(check.stdout.strip()).is_relative_to(installed)
