"""``runlog keys new-kek`` needs no argument: it names the next KEK after those in
``RUNLOG_KEK``, and a line it prints is a KEK ``RUNLOG_KEK`` accepts."""

from __future__ import annotations

import subprocess
import sys

import pytest
from workers.common import worker_env

from runlog._settings import Settings
from runlog.log._keys import Keks, new_kek

pytestmark = pytest.mark.timeout(120)


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_keys_new_kek_needs_no_argument_and_names_the_next_kek(settings: Settings) -> None:
    env = worker_env(settings)
    env.pop("RUNLOG_KEK", None)
    env.pop("RUNLOG_KEK_FILE", None)
    first = _cli(env, "keys", "new-kek")
    assert first.returncode == 0, first.stderr
    line = first.stdout.strip()
    assert Keks.parse(line, where="new-kek").current == "k1"
    # After k1 and k7 (an id of another form too), the next one is k8, and it is usable:
    # appended to RUNLOG_KEK it becomes the current KEK.
    env["RUNLOG_KEK"] = f"k1:{new_kek()},old:{new_kek()},k7:{new_kek()}"
    nxt = _cli(env, "keys", "new-kek")
    assert nxt.returncode == 0, nxt.stderr
    assert Keks.parse(env["RUNLOG_KEK"] + "," + nxt.stdout.strip(), where="t").current == "k8"
    named = _cli(env, "keys", "new-kek", "k2")
    assert named.stdout.startswith("k2:")
    bad = _cli(env, "keys", "new-kek", "a:b")
    assert bad.returncode == 2 and not bad.stdout
