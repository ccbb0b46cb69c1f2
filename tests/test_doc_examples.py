"""Every shell example of README.md and docs/ runs against the real stack, or says why not.

The rule, visible in the pages themselves:

- every fenced block whose language is ``sh``, ``bash``, ``shell`` or ``console`` is an
  example, and this test runs it with ``bash -e -o pipefail`` from the repository's root,
  with ``.venv/bin`` first on ``PATH`` and the test's own topics and Redis keys
  (``RUNLOG_*``), so an example that fails fails CI;
- the line right above the fence may say otherwise, in an HTML comment the rendered page
  hides: ``<!-- doc-test: skip: REASON -->`` (not run: it installs packages, starts or stops
  a whole stack, runs for minutes, or needs a person at a keyboard; REASON is required), or
  ``<!-- doc-test: given FIXTURE -->`` (run after ``FIXTURE`` below made what the example
  speaks of; the example's placeholder run ids are replaced by that run's id);
- a command that serves until stopped (``runlog ui``, ``runlog project``, ``runlog worker``)
  is started in the background and must still be running once the block is done (it
  started, and did not exit on an error); then it is stopped. ``runlog ui`` is given a free
  port, so tests running at once do not share 8642.

The fixtures: ``a-run``, a finished run of tenant ``acme`` with 14 valid events.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from workers.common import worker_env

import runlog
from runlog._settings import Settings
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SHELLS = frozenset({"sh", "bash", "shell", "console"})
FENCE = re.compile(r"^([ \t]*)```(\w*)[^\n]*\n(.*?)^\1```", re.M | re.S)
MARK = re.compile(r"<!--\s*doc-test:\s*(skip|given)\b\s*:?\s*(.*?)\s*-->\s*$")
SERVES = re.compile(r"\brunlog (ui|project|worker)\b")
PLACEHOLDERS = ("r01a22de5c06f...", "r01a23...", "r01a...", "r01...")
BLOCK_TIMEOUT_S = 120


@dataclass(frozen=True)
class Example:
    page: str
    line: int
    body: str
    mark: str | None
    """None, "skip" or "given"."""
    arg: str

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def examples() -> list[Example]:
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in FENCE.finditer(text):
            if m.group(2) not in SHELLS:
                continue
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            found.append(
                Example(
                    str(page.relative_to(ROOT)),
                    line,
                    m.group(3),
                    None if mark is None else mark.group(1),
                    "" if mark is None else mark.group(2),
                )
            )
    return found


EXAMPLES = examples()


def test_every_skipped_example_says_why() -> None:
    unexplained = [e.id for e in EXAMPLES if e.mark == "skip" and len(e.arg) < 10]
    assert not unexplained, f"a skipped example must say why: {unexplained}"
    unknown = [e.id for e in EXAMPLES if e.mark == "given" and e.arg not in FIXTURES]
    assert not unknown, f"unknown fixtures: {unknown}"


def _a_run(settings: Settings) -> str:
    with runlog.open_run(tenant="acme", settings=settings) as run:
        for i in range(12):
            run.append(EventType.USER_MESSAGE, content=f"step {i}")
        run.finish("succeeded", "a run for the docs' examples")
        return run.run_id


FIXTURES: dict[str, Callable[[Settings], str]] = {"a-run": _a_run}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _script(example: Example, run_id: str | None) -> str:
    """The block as this test runs it: placeholders replaced, services in the background,
    then the check that each service still runs, then their stop."""
    lines = []
    for raw in example.body.replace("\\\n", " ").splitlines():
        line = raw
        if run_id is not None:
            for placeholder in PLACEHOLDERS:
                line = line.replace(placeholder, run_id)
        command = line.split(" #", 1)[0].rstrip()
        if SERVES.search(command):
            if "runlog ui" in command and "--port" not in command:
                command += f" --port {_free_port()}"
            if not command.endswith("&"):
                command += " &"
            line = command
        lines.append(line)
    return "\n".join(
        [
            *lines,
            "sleep 3",
            'for p in $(jobs -p); do kill -0 "$p" || { echo "$p exited" >&2; exit 97; }; done',
            "kill $(jobs -p) 2>/dev/null || true",
            "wait 2>/dev/null || true",
            "exit 0",
        ]
    )


RUNNABLE = [e for e in EXAMPLES if e.mark != "skip"]


@pytest.mark.parametrize("example", RUNNABLE, ids=[e.id for e in RUNNABLE])
def test_the_shell_example_runs(
    example: Example, test_settings: Settings, redis_client: redis.Redis, tmp_path: Path
) -> None:
    run_id = FIXTURES[example.arg](test_settings) if example.mark == "given" else None
    env = worker_env(test_settings)
    env["PATH"] = os.pathsep.join([str(ROOT / ".venv" / "bin"), env.get("PATH", "")])
    out_path, err_path = tmp_path / "out", tmp_path / "err"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(
            ["bash", "-e", "-o", "pipefail", "-c", _script(example, run_id)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        try:
            proc.wait(timeout=BLOCK_TIMEOUT_S)
        finally:
            # The block's services (and anything they started) go with its process group,
            # also when the block failed before it stopped them.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    said = out_path.read_text()[-3000:] + "\n" + err_path.read_text()[-3000:]
    assert proc.returncode == 0, f"{example.id} failed ({proc.returncode}):\n{said}"
