"""The fault explorer, bounded: fixed seeds and every seed it ever failed on.

Each seed is a history of operations and faults executed on this session's 3-node
cluster (tests/explorer/explorer.py); a failure prints the history and the command that
replays it. Seeds the explorer found failing are kept in tests/explorer/seeds.json with
what they found, forever. ``make explore`` runs it unbounded.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "explorer"))

import explorer
from explorer import (
    AFTER_A_STEP,
    CUT_DIRECTIONS,
    CUT_SERVICES,
    LINK_FAULTS,
    PAUSE_TOOLS,
    SKEWS_S,
    LedgerServer,
    clock_skews,
    explore,
    generate,
    in_order,
    load_seeds,
    network_faults,
    report,
    stop_registry,
    worker_cuts,
    worker_links,
)

from runlog import stack

FIXED = [(11, 30), (12, 30)]
"""Seeds that found nothing, run every time: new code meets new combinations of faults."""
FIXED_NETWORK = [(22, 30), (28, 30)]
"""Seeds run with ``EXPLORER_NETWORK=1``: 22 starts workers 30 s ahead after its step 6 and
30 s behind after step 8 (seven runs started), cuts two partition leaders from the
controller quorum and a worker's requests to Redis; 28 cuts a worker's requests to the
brokers, then the same worker from Redis both ways (it is SIGKILLed while cut), among
skewed clocks, Redis restarts and quorum cuts."""

HISTORIES = {
    (2, 30): "94dd5043dda520be",
    (4, 40): "abcafdbb10defbc2",
    (11, 30): "79fb71a2d638def3",
    (12, 30): "775320cabb284bb1",
    (320, 20): "0efc931411f05a60",
}
"""What the first ``steps`` steps of these seeds were before ``pause_call`` was drawn (a
digest of their text): a kind added later comes from a stream of its own and is appended."""


def test_pause_calls_leave_every_older_step_where_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(explorer, "NETWORK", False)
    for (seed, steps), digest in HISTORIES.items():
        full = generate(seed, steps)
        older = json.dumps([s.text() for s in full[:steps]]).encode()
        assert hashlib.sha256(older).hexdigest()[:16] == digest, seed
        pauses = full[steps:]
        assert pauses and all(s.kind == "pause_call" for s in pauses)
        order = in_order(full, list(range(len(full))))
        for i, s in enumerate(pauses, start=steps):
            # Executed right after the step it names, not at the end.
            assert order.index(i) == order.index(s.a) + 1
    # Over many seeds, every tool kind and both takeovers are drawn.
    drawn = {tuple(s.arg.split()) for seed in range(200) for s in generate(seed, 40)[40:]}
    assert {t for t, _ in drawn} == set(PAUSE_TOOLS)
    assert {h for _, h in drawn} == {"break", "expire"}


def test_network_steps_leave_every_other_step_where_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``EXPLORER_NETWORK=1`` appends ``quorum_cut``, ``clock_skew`` and ``worker_cut``
    steps, each from a stream of its own, and changes no other step."""
    for (seed, steps), digest in HISTORIES.items():
        monkeypatch.setattr(explorer, "NETWORK", False)
        plain = generate(seed, steps)
        monkeypatch.setattr(explorer, "NETWORK", True)
        full = generate(seed, steps)
        assert full[: len(plain)] == plain, seed
        older = json.dumps([s.text() for s in full[:steps]]).encode()
        assert hashlib.sha256(older).hexdigest()[:16] == digest, seed
        added = full[len(plain) :]
        n = len(generate(seed, steps)) - len(added)
        assert added == (
            network_faults(seed, n) + clock_skews(seed, n) + worker_cuts(seed, n)
        ) + worker_links(seed, n)
        kinds = {"quorum_cut", "clock_skew", "worker_cut", "worker_link"}
        assert {s.kind for s in added} == kinds, seed
        assert generate(seed, steps) == full  # a seed still names one history
        order = in_order(full, list(range(len(full))))
        for i, s in enumerate(added, start=len(plain)):
            # Right after the step it names, or after another appended step naming it.
            before = order[order.index(i) - 1]
            appended = full[before].kind in AFTER_A_STEP and full[before].a == s.a
            assert before == s.a or appended, seed
    # Over many seeds, every clock is drawn: ahead, behind and the real one again.
    monkeypatch.setattr(explorer, "NETWORK", True)
    drawn = {SKEWS_S[s.b % 3] for seed in range(100) for s in generate(seed, 30)[30:]}
    assert drawn >= set(SKEWS_S)
    # And every link of a worker cut: to Redis and to the brokers, each way and both.
    links = {
        (CUT_SERVICES[s.b % 2], CUT_DIRECTIONS[(s.b // 2) % 3])
        for seed in range(100)
        for s in generate(seed, 30)[30:]
        if s.kind == "worker_cut"
    }
    assert links == {(svc, d) for svc in CUT_SERVICES for d in CUT_DIRECTIONS}
    # And every degraded link: lossy, flapping and delayed, to Redis and to the brokers.
    degraded = {
        (CUT_SERVICES[s.b % 2], LINK_FAULTS[(s.b // 2) % 3])
        for seed in range(100)
        for s in generate(seed, 30)[30:]
        if s.kind == "worker_link"
    }
    assert degraded == {(svc, f) for svc in CUT_SERVICES for f in LINK_FAULTS}


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
    [(s["seed"], s["steps"], s["keep"]) for s in load_seeds() if not s.get("network")],
    ids=[f"found-seed-{s['seed']}" for s in load_seeds() if not s.get("network")],
)
def test_seeds_the_explorer_found(
    cluster: stack.StackConfig, ledger: LedgerServer, seed: int, steps: int, keep: list[int] | None
) -> None:
    # The history that found it, without the kinds appended since (``pause_call``): the
    # fixed seeds below meet those.
    _run(cluster, ledger, seed, steps, keep if keep is not None else list(range(steps)))


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("seed", "steps", "keep"),
    [(s["seed"], s["steps"], s["keep"]) for s in load_seeds() if s.get("network")],
    ids=[f"found-network-seed-{s['seed']}" for s in load_seeds() if s.get("network")],
)
def test_network_seeds_the_explorer_found(
    cluster: stack.StackConfig,
    ledger: LedgerServer,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    steps: int,
    keep: list[int] | None,
) -> None:
    """Seeds found with ``EXPLORER_NETWORK=1``, replayed with it: the whole history, every
    appended kind included (its network steps are what found them)."""
    monkeypatch.setattr(explorer, "NETWORK", True)
    _run(cluster, ledger, seed, steps, keep)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("seed", "steps"), FIXED, ids=[f"seed-{s}" for s, _ in FIXED])
def test_fixed_seeds(
    cluster: stack.StackConfig, ledger: LedgerServer, seed: int, steps: int
) -> None:
    _run(cluster, ledger, seed, steps, None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("seed", "steps"), FIXED_NETWORK, ids=[f"network-seed-{s}" for s, _ in FIXED_NETWORK]
)
def test_fixed_network_seeds(
    cluster: stack.StackConfig,
    ledger: LedgerServer,
    monkeypatch: pytest.MonkeyPatch,
    seed: int,
    steps: int,
) -> None:
    """Skewed workers' clocks, brokers cut from the quorum and workers cut from Redis or the
    brokers among the other faults: the checker's every property holds (no acknowledged
    event lost, one owner per epoch, each effect at most once, every timer once, every
    decision final, every run ended or visibly waiting)."""
    monkeypatch.setattr(explorer, "NETWORK", True)
    full = generate(seed, steps)
    assert {SKEWS_S[s.b % 3] for s in full if s.kind == "clock_skew"} >= {30.0, -30.0}
    out = explore(cluster, ledger, seed, steps, None, quiet=True)
    print(report(out))
    assert not out.failed, report(out)
    assert out.faults["workers' clock +30 s"] and out.faults["workers' clock -30 s"]
    assert out.faults["worker started on a skewed clock"]
    assert any(k.startswith("worker cut from") for k in out.faults), out.faults
    assert any(k.startswith("worker link to") for k in out.faults), out.faults
