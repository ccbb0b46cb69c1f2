"""One owner per run: a barrier race between processes, and Redis forgetting everything."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import redis
from workers import race
from workers.common import (
    EXIT_FENCED,
    EXIT_OK,
    assert_log_sound,
    delete_prefix,
    fold_log,
    read_log,
    start_worker,
    verdicts,
)

import runlog
from runlog._settings import Settings
from runlog.schemas import _models as m
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

pytestmark = pytest.mark.timeout(120)

FREE_TRIALS = 12
EXPIRED_TRIALS = 6


def _events(settings: Settings, run_id: str) -> list[m.Event]:
    return [r.event for r in read_log(settings, run_id)]


def test_two_workers_released_by_a_barrier_one_owner_per_epoch(
    fast: Settings, redis_client: redis.Redis
) -> None:
    trials = [(new_run_id(), "free") for _ in range(FREE_TRIALS)]
    trials += [(new_run_id(), "expired") for _ in range(EXPIRED_TRIALS)]
    prefix_seq = {}
    for rid, _ in trials:  # the same log prefix for both contenders
        with runlog.open_run(rid, settings=fast) as run:
            run.append(EventType.USER_MESSAGE, content="race me")
            prefix_seq[rid] = run.state.seq

    outcomes: dict[str, dict[int, tuple[str, int | None]]] = {}
    with race.contenders(fast, trials) as contest:
        for _rid, kind in trials:
            if kind == "expired":
                holder_epoch = contest.ready.get(timeout=race.RESULT_TIMEOUT_S)
                assert holder_epoch == 2
                lease_keys = list(redis_client.scan_iter(match=f"{fast.redis_key_prefix}:*:lease"))
                assert len(lease_keys) == 1
                redis_client.delete(*lease_keys)  # the holder's lease expires "during a pause"
                contest.go.put(True)
            for _ in range(2):
                # Two processes' puts reach the queue in either order (each queue has its own
                # feeder thread): a contender's result of the trial before may come after the
                # other's of this one. Keyed by run id, each trial must get both.
                got_rid, index, outcome, epoch = contest.results.get(timeout=race.RESULT_TIMEOUT_S)
                assert index not in outcomes.get(got_rid, {}), (got_rid, index)
                outcomes.setdefault(got_rid, {})[index] = (outcome, epoch)
    assert all(p.exitcode == 0 for p in contest.procs)
    assert {rid: sorted(got) for rid, got in outcomes.items()} == {rid: [0, 1] for rid, _ in trials}

    tally: Counter[str] = Counter()
    for rid, kind in trials:
        got = outcomes[rid]
        winners = [i for i, (o, _) in got.items() if o == "won"]
        assert len(winners) == 1, f"{kind} trial {rid}: {got}"
        (winner,) = winners
        loser_outcome = got[1 - winner][0]
        assert loser_outcome in ("RunLocked", "Fenced"), f"{kind} trial {rid}: {got}"
        tally[f"{kind}:{loser_outcome}"] += 1
        if kind == "expired":
            assert winner == 1 and loser_outcome == "Fenced"

        events = _events(fast, rid)
        state = assert_log_sound(events)
        pairs = verdicts(events)
        valid = [ev for ev, ok in pairs if ok]
        winner_epoch = got[winner][1]
        assert state.status == "finished" and state.summary == f"contender-{winner}"
        assert state.epoch == winner_epoch == state.max_epoch_seen
        # The winner's epoch is owned by the winner alone, and is the only epoch after the
        # shared prefix apart from what an expired owner landed before the takeover.
        assert {ev.writer_id for ev in valid if ev.epoch == winner_epoch} == {valid[-1].writer_id}
        raw_finished = [ev for ev in events if ev.type is EventType.RUN_FINISHED]
        assert len(raw_finished) == 1
        memory = [ev.payload for ev in valid if ev.type is EventType.MEMORY_WRITTEN]
        assert [p.value for p in memory] == [f"contender-{winner}"]
        assert state.fenced_writes == sum(1 for _, ok in pairs if not ok)
        tally[f"{kind}:fenced_writes_in_log"] += state.fenced_writes
        tally[f"{kind}:loser_events_valid"] += sum(
            1 for ev in valid[prefix_seq[rid] :] if ev.writer_id != valid[-1].writer_id
        )
        if kind == "free":
            assert state.fenced_writes == 0 and winner_epoch == 2
            assert valid[prefix_seq[rid]].type is EventType.RUN_RESUMED
        else:
            assert winner_epoch == 3
            resumed = [ev for ev in valid if ev.type is EventType.RUN_RESUMED]
            assert resumed[-1].epoch == 3
    print(f"\nbarrier race outcomes for the loser: {dict(tally)}")


def test_redis_flushed_mid_run_fences_the_owner_and_epochs_never_regress(
    fast: Settings, tmp_path: Path, redis_client: redis.Redis
) -> None:
    rid = new_run_id()
    old = start_worker(fast, tmp_path, "old", "--run-id", rid, "--scenario", "hold")
    assert old.wait_flag("holding") == "1"

    # Redis restarts empty: every key of this test goes (other tests' keys stay).
    assert delete_prefix(redis_client, fast.redis_key_prefix) >= 2  # lease + epoch counter
    before = _events(fast, rid)
    floor = max(ev.epoch for ev in before)

    new = start_worker(fast, tmp_path, "new", "--run-id", rid, "--scenario", "hold")
    new_epoch = int(new.wait_flag("holding"))
    assert new_epoch > floor, "the new owner's epoch went backwards after the flush"

    old.go()
    code, old_result = old.finish()
    assert code == EXIT_FENCED, old_result
    new.go()
    code, new_result = new.finish()
    assert code == EXIT_OK, new_result
    assert new_result["epoch"] == new_epoch

    events = _events(fast, rid)
    state = assert_log_sound(events)
    pairs = verdicts(events)
    stale = [ev for ev, ok in pairs if not ok]
    assert all(ev.epoch <= floor for ev in stale)
    assert state.fenced_writes == len(stale)
    assert fold_log([ev for ev, ok in pairs if ok]).digest() == new_result["digest"]
    print(f"\nflush: old owner fenced ({old_result['error']}); stale writes landed: {len(stale)}")
    valid = [ev for ev, ok in pairs if ok]
    epochs_by_writer: dict[int, set[str]] = {}
    for ev in valid:
        epochs_by_writer.setdefault(ev.epoch, set()).add(ev.writer_id)
    assert sorted(epochs_by_writer) == [1, new_epoch]
    memory = [ev.payload.value for ev in valid if ev.type is EventType.MEMORY_WRITTEN]
    assert memory == ["new"]
    assert state.status == "finished" and state.summary == "finished by new"
