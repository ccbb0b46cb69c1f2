"""The soak's network episodes (tests/explorer/soak_network.py), one fixed seed of each
family, so the checks ``make soak`` relies on run in ``make faults`` too.

Each seed was picked because its fault reaches the worker's traffic mid-run (packets
dropped or bytes delayed); the test asserts that, then that the episode is clean: every
acknowledged append in the log, no event twice, each effect once and recorded, the run
finished. Reproduce: ``python tests/explorer/soak_network.py --family F --seed N``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from netns import Nemesis

from runlog import stack
from runlog._settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "explorer"))

import soak_network


@pytest.mark.parametrize(
    ("family", "seed"),
    [("partition", 3), ("lossy", 1), ("lossy", 2), ("skew", 1)],
    ids=["partition-kafka", "delay", "loss", "skew"],
)
def test_soak_network_episode_is_clean(
    healthy: Settings,
    cluster: stack.StackConfig,
    nemesis: Nemesis,
    tmp_path: Path,
    family: str,
    seed: int,
) -> None:
    net = soak_network.Network(cluster, nemesis)
    try:
        verdict = soak_network.episode(net, healthy, family, seed, tmp_path)
    finally:
        net.close()
    assert verdict.hit, f"{verdict.fault}: the fault reached no traffic"
    assert verdict.clean, (verdict.lost, verdict.doubled, verdict.other, verdict.stuck)
