"""The fault explorer, bounded: fixed seeds and every seed it ever failed on.

Each seed is a history of operations and faults executed on this session's 3-node
cluster (tests/explorer/explorer.py); a failure prints the history and the command that
replays it. Seeds the explorer found failing are kept in tests/explorer/seeds.json with
what they found, forever. ``make explore`` runs it unbounded.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "explorer"))

from explorer import LedgerServer, explore, load_seeds, report, stop_registry

from runlog import stack

FIXED = [(11, 30), (12, 30)]
"""Seeds that found nothing, run every time: new code meets new combinations of faults."""


@pytest.fixture(scope="module")
def ledger(cluster: stack.StackConfig) -> Iterator[LedgerServer]:
    server = LedgerServer(cluster)
    server.up()
    try:
        yield server
    finally:
        server.down()
        stop_registry()  # the schema registry a registry history started, if one did


def _run(
    cluster: stack.StackConfig, ledger: LedgerServer, seed: int, steps: int, keep: list[int] | None
) -> None:
    out = explore(cluster, ledger, seed, steps, keep, quiet=True)
    print(report(out))
    assert not out.failed, report(out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("seed", "steps", "keep"),
    [(s["seed"], s["steps"], s["keep"]) for s in load_seeds()],
    ids=[f"found-seed-{s['seed']}" for s in load_seeds()],
)
def test_seeds_the_explorer_found(
    cluster: stack.StackConfig, ledger: LedgerServer, seed: int, steps: int, keep: list[int] | None
) -> None:
    _run(cluster, ledger, seed, steps, keep)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("seed", "steps"), FIXED, ids=[f"seed-{s}" for s, _ in FIXED])
def test_fixed_seeds(
    cluster: stack.StackConfig, ledger: LedgerServer, seed: int, steps: int
) -> None:
    _run(cluster, ledger, seed, steps, None)
