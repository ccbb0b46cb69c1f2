"""Snapshots: snapshot + tail == full replay, and every doubtful snapshot is a cache miss."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay_support import OPS, synthetic_log

import runlog.log._snapshots as snapshots_mod
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.consumers._verify import verify_run
from runlog.log import _metrics as metrics
from runlog.log._replay import replay
from runlog.log._snapshots import (
    Snapshot,
    SnapshotInvalid,
    SnapshotStore,
    decode_body,
    encode_body,
)
from runlog.producers._handle import engine_of
from runlog.producers._opening import open_run_with
from runlog.projections._run_state import RunState, fold
from runlog.schemas._vocabulary import EventType

# ----------------------------------------------------------------------------- pure


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.sampled_from(OPS), min_size=0, max_size=60),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_snapshot_plus_tail_equals_full_replay_at_any_cut(
    ops: list[str], seed: int, data: st.DataObject
) -> None:
    events = synthetic_log(ops, seed)
    full = fold(events)
    cuts = data.draw(st.lists(st.integers(0, len(events)), min_size=1, max_size=6))
    for cut in cuts:
        prefix = fold(events[:cut])
        # Through the real body encoding: digest, versions, JSON round trip.
        body = encode_body(prefix, tenant="t", run_id="r-synthetic", partition=0, offset=cut)
        if prefix.seq == 0:
            continue  # nothing valid yet: no snapshot would be written
        snap = decode_body(body, key="k", tenant="t", run_id="r-synthetic", partition=0)
        resumed = fold(events[cut:], snap.state)
        assert resumed.to_dict() == full.to_dict(), f"cut {cut} of {len(events)}"
        assert resumed.digest() == full.digest()


def test_the_property_can_fail() -> None:
    """A snapshot that drops a field must be caught by the same comparison."""
    events = synthetic_log(["call", "complete", "turn", "compact", "turn"], 3)
    state = fold(events[:3])
    d = state.to_dict()
    d["completed_calls"] = {}
    broken = RunState.from_dict(d)
    assert fold(events[3:], broken).digest() != fold(events).digest()


def _body(state: RunState) -> bytes:
    return encode_body(state, tenant="t", run_id="r-synthetic", partition=0, offset=9)


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda b: b[:-20], "unparsable"),
        (lambda b: b.replace(b'"turns":', b'"turns":1'), "digest"),
        (lambda b: _rewrite(b, seq=99, keep_digest=True), "digest"),
        (lambda b: _rewrite(b, fold_version=1), "fold_version"),
        (lambda b: _rewrite(b, format=99), "format"),
        (lambda b: _rewrite(b, run_id="r-other"), "identity"),
        (lambda b: _rewrite(b, partition=5), "partition"),
    ],
)
def test_bad_bodies_are_rejected_with_a_reason(mutate: object, reason: str) -> None:
    state = fold(synthetic_log(["turn", "call", "complete"], 1))
    bad = mutate(_body(state))  # type: ignore[operator]
    with pytest.raises(SnapshotInvalid) as err:
        decode_body(bad, key="k", tenant="t", run_id="r-synthetic", partition=0)
    assert err.value.reason == reason


def test_a_canonical_body_is_checked_without_serialising_it_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The digest of a body ``encode_body`` wrote is checked on its bytes; a body spelled
    otherwise (spaces, key order) is checked the long way and is as valid; a changed byte
    fails either way."""
    state = fold(synthetic_log(["turn", "call", "complete"] * 5, 1))
    raw = _body(state)
    # What encode_body writes is the canonical JSON of the body, digest included.
    assert raw == json.dumps(json.loads(raw), sort_keys=True, separators=(",", ":")).encode()
    respelled = json.dumps(json.loads(raw), indent=1).encode()
    tampered = raw.replace(b'"turns":', b'"turns":1', 1)
    slow: list[int] = []
    real = snapshots_mod._digest
    monkeypatch.setattr(snapshots_mod, "_digest", lambda b: slow.append(1) or real(b))

    def check(body: bytes) -> Snapshot | SnapshotInvalid:
        try:
            return decode_body(body, key="k", tenant="t", run_id="r-synthetic", partition=0)
        except SnapshotInvalid as exc:
            return exc

    fast = check(raw)
    assert isinstance(fast, Snapshot) and not slow
    assert fast.state.digest() == state.digest()
    long_way = check(respelled)
    assert isinstance(long_way, Snapshot) and slow
    assert long_way.state.digest() == state.digest()
    bad = check(tampered)
    assert isinstance(bad, SnapshotInvalid) and bad.reason == "digest"


def _rewrite(raw: bytes, keep_digest: bool = False, **changes: object) -> bytes:
    body = json.loads(raw)
    body.update(changes)
    if not keep_digest:
        body["digest"] = snapshots_mod._digest(body)
    return json.dumps(body).encode()


# ------------------------------------------------------------------------ real stack


def _snap_settings(test_settings: Settings, interval: int) -> Settings:
    return test_settings.model_copy(update={"snapshot_interval": interval})


def _work(run: object, n: int) -> None:
    from runlog.producers._engine import Engine

    assert isinstance(run, Engine)
    for i in range(n):
        run.append(EventType.USER_MESSAGE, content=f"hello {i}")
        run.append(EventType.MODEL_TURN, text=f"turn {i}", usage={"input_tokens": i})
        if i % 4 == 3:
            run.append(EventType.CONTEXT_COMPACTED, summary=f"s{i}", kept_turns=1)


def _full_replay(s: Settings, client: redis.Redis, run_id: str, tenant: str) -> RunState:
    return replay(s, client, run_id, tenant=tenant).state


def test_open_run_resumes_from_a_snapshot_and_equals_full_replay(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    s = _snap_settings(test_settings, 5)
    services = Services(s)
    try:
        deps = services.run_deps()
        assert isinstance(deps.snapshots, SnapshotStore)
        with open_run_with(deps, tenant="acme") as run:
            _work(run, 8)
            run_id = run.run_id
            live = run.state.to_dict()
        store = deps.snapshots
        cands = store.candidates("acme", run_id)
        assert len(cands) == 2, cands  # current and the previous one as fallback
        assert all(not isinstance(c, SnapshotInvalid) for c in cands)

        before = metrics.snapshot()["snapshot_loads"]
        with open_run_with(deps, run_id, tenant="acme") as again:
            assert metrics.snapshot()["snapshot_loads"] == before + 1
            resumed = again.state
            assert resumed.seq == live["seq"] + 1  # + RUN_RESUMED
        full = _full_replay(s, redis_client, run_id, "acme")
        assert resumed.digest() == full.digest()

        report = verify_run(s, redis_client, run_id, tenant="acme", snapshots=store)
        assert report.ok, report.text()
        by_name = {c.name: c for c in report.checks}
        assert by_name["stored_snapshots"].counts.get("equal") == 2
        print(
            f"\nsnapshot_write_ms last={metrics.snapshot()['snapshot_write_ms']:.2f} "
            f"load_ms last={metrics.snapshot()['snapshot_load_ms']:.2f}"
        )
    finally:
        services.close()


@pytest.mark.parametrize("damage", ["corrupt", "old_fold", "discontinuous", "deleted"])
def test_a_bad_snapshot_falls_back_to_full_replay(
    test_settings: Settings,
    redis_client: redis.Redis,
    damage: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    s = _snap_settings(test_settings, 1000)  # only the snapshots this test writes
    services = Services(s)
    try:
        deps = services.run_deps()
        store: SnapshotStore = deps.snapshots
        with open_run_with(deps, tenant="acme") as run:
            _work(run, 3)
            mid = store.write(engine_of(run))
            _work(run, 3)
            run_id = run.run_id

        ptr = store.pointer_key("acme", run_id)
        if damage == "corrupt":
            key = redis_client.hget(ptr, "current")
            assert key is not None
            raw = redis_client.get(key)
            assert isinstance(raw, bytes)
            redis_client.set(key, raw.replace(b'"hello 0"', b'"HELLO 0"'))
        elif damage == "old_fold":
            redis_client.delete(ptr)
            monkeypatch.setattr(snapshots_mod, "FOLD_VERSION", 1)
            with open_run_with(deps, run_id, tenant="acme", recover=False) as r2:
                store.write(r2)
            monkeypatch.undo()
        elif damage == "discontinuous":
            # A snapshot whose position skips records: it claims seq 7 but its tail starts
            # after later events, so the first tail record is not seq 8.
            state = RunState.from_dict(mid.state.to_dict())
            store.put("acme", run_id, state, partition=mid.partition, offset=mid.offset + 3)
        elif damage == "deleted":
            store.delete("acme", run_id)

        truth = _full_replay(s, redis_client, run_id, "acme")
        misses = metrics.snapshot()
        with open_run_with(deps, run_id, tenant="acme", recover=False) as again:
            resumed = dataclasses.replace(again.state)
        assert resumed.seq == truth.seq + 1  # nothing lost: the log's state + RUN_RESUMED
        full_now = _full_replay(s, redis_client, run_id, "acme")
        assert resumed.digest() == full_now.digest()
        now = metrics.snapshot()
        if damage == "discontinuous":
            assert now["snapshot_discontinuities"] == misses["snapshot_discontinuities"] + 1
            q = redis_client.hget(ptr, "quarantined")
            assert q is not None
        if damage in ("corrupt", "old_fold"):
            assert now["snapshot_misses"] >= misses["snapshot_misses"] + 1 or (
                store.last_miss is not None
            )
    finally:
        services.close()


def test_a_resume_reads_only_the_snapshot_it_uses(
    test_settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body holds the whole state: a load whose current snapshot is usable must not read
    and validate the previous one too (that once made the snapshot path slower than the
    full replay it replaces). The previous one is still the fallback."""
    s = _snap_settings(test_settings, 5)
    services = Services(s)
    try:
        deps = services.run_deps()
        store: SnapshotStore = deps.snapshots
        with open_run_with(deps, tenant="acme") as run:
            _work(run, 8)
            run_id, partition = run.run_id, run.partition
        assert len(store.candidates("acme", run_id)) == 2
        decoded: list[str] = []
        real = snapshots_mod.decode_body

        def counting(raw: bytes | None, **kw: object) -> Snapshot:
            decoded.append(str(kw["key"]))
            return real(raw, **kw)  # type: ignore[arg-type]

        monkeypatch.setattr(snapshots_mod, "decode_body", counting)
        got = store.load("acme", run_id, partition=partition, count=False)
        assert got is not None and len(decoded) == 1
        # The current body gone: the previous one is read, and used.
        current = deps.redis.hget(store.pointer_key("acme", run_id), "current")
        deps.redis.delete(current)
        decoded.clear()
        fallback = store.load("acme", run_id, partition=partition, count=False)
        assert fallback is not None and fallback[0].seq < got[0].seq and len(decoded) == 2
    finally:
        services.close()


def test_interval_is_per_run(test_settings: Settings) -> None:
    s = _snap_settings(test_settings, 3)
    services = Services(s)
    try:
        deps = services.run_deps()
        store: SnapshotStore = deps.snapshots
        with open_run_with(deps, tenant="acme") as quiet:
            store.set_interval("acme", quiet.run_id, 0)
            _work(quiet, 3)
            assert store.candidates("acme", quiet.run_id) == []
        with open_run_with(deps, tenant="acme") as busy:
            _work(busy, 3)
            assert store.candidates("acme", busy.run_id)
    finally:
        services.close()


def test_snapshot_plan_leaves_no_scratch_topic_or_key(
    test_settings: Settings, redis_client: redis.Redis
) -> None:
    """`runlog snapshot plan` measures on scratch topics of its own and deletes them (and
    their keys) before it answers: nothing `plan-*` is left on the broker or in Redis."""
    from confluent_kafka.admin import AdminClient

    def scratch_topics() -> set[str]:
        md = AdminClient(test_settings.kafka_common()).list_topics(timeout=30)
        return {t for t in md.topics if t.startswith("plan-")}

    before = scratch_topics()
    done = subprocess.run(
        [sys.executable, "-m", "runlog.cli", "snapshot", "plan", "--sample-events=200", "--json"],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verdict"]
    assert scratch_topics() <= before, "scratch topics left behind"
    assert not list(redis_client.scan_iter(match="plan-*", count=1000))


class _Counting:
    """A reader's consumer that counts the records the broker hands it."""

    def __init__(self, inner: object, seen: list[int]) -> None:
        self._inner, self._seen = inner, seen

    def consume(self, *args: object, **kwargs: object) -> list[object]:
        batch = self._inner.consume(*args, **kwargs)  # type: ignore[attr-defined]
        self._seen.extend(m.offset() for m in batch if m.error() is None)
        return batch  # type: ignore[no-any-return]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def test_a_resume_from_a_snapshot_reads_only_the_tail(test_settings: Settings) -> None:
    """The records a resume takes from the broker are the snapshot's tail and the claim's
    read-back, not the run: what grows with a long run's length must not be its reads."""
    s = _snap_settings(test_settings, 40)
    services = Services(s)
    try:
        seen: list[int] = []
        base = services.run_deps()

        def counting() -> object:
            reader = base.reader_factory()
            if not isinstance(reader._consumer, _Counting):
                reader._made = _Counting(reader._consumer, seen)  # type: ignore[assignment]
            return reader

        deps = dataclasses.replace(base, reader_factory=counting)
        store = deps.snapshots
        assert isinstance(store, SnapshotStore)
        with open_run_with(deps, tenant="acme", recover=False) as run:
            for i in range(300):
                run.emit(EventType.USER_MESSAGE, {"content": f"m{i}"})
                if i % 20 == 19:
                    run.barrier()
                    store.maybe_write(engine_of(run))
            run.barrier()
            run_id, length = run.run_id, run.state.seq
        snap = store.candidates("acme", run_id)[0]
        assert isinstance(snap, Snapshot) and snap.seq > length - 60
        tail = length - snap.seq

        seen.clear()
        with open_run_with(deps, run_id, tenant="acme", recover=False) as again:
            assert again.state.seq == length + 1
        assert 0 < len(seen) <= tail + 3, (len(seen), tail)  # + the claim's read-back
        assert min(seen) >= snap.offset

        # The same count without the snapshot is the whole run: the measure can fail.
        store.delete("acme", run_id)
        seen.clear()
        with open_run_with(deps, run_id, tenant="acme", recover=False):
            pass
        assert len(seen) > length
    finally:
        services.close()


def test_a_resume_on_a_busy_partition_stops_at_the_runs_last_record(
    test_settings: Settings,
) -> None:
    """Other runs' records after a snapshot are not fetched when the process's log tail,
    following the partition, says where the run's own records end; without the tail they
    all are (the measure can fail)."""
    s = _snap_settings(test_settings, 40)
    services = Services(s)
    try:
        seen: list[int] = []
        base = services.run_deps()

        def counting() -> object:
            reader = base.reader_factory()
            if not isinstance(reader._consumer, _Counting):
                reader._made = _Counting(reader._consumer, seen)  # type: ignore[assignment]
            return reader

        deps = dataclasses.replace(base, reader_factory=counting)
        store = deps.snapshots
        assert isinstance(store, SnapshotStore)
        with open_run_with(deps, tenant="acme", recover=False) as run:
            for i in range(100):
                run.emit(EventType.USER_MESSAGE, {"content": f"m{i}"})
                if i % 20 == 19:
                    run.barrier()
                    store.maybe_write(engine_of(run))
            run.barrier()
            run_id, part, length = run.run_id, run.partition, run.state.seq
        while True:  # another run on the same partition, busy after the snapshots
            other = open_run_with(deps, tenant="acme", recover=False)
            if other.partition == part:
                break
            other.close()

        def busy() -> None:
            for i in range(300):
                other.emit(EventType.USER_MESSAGE, {"content": f"o{i}"})
            other.barrier()

        def resume(snapshot: bool = False) -> int:
            seen.clear()
            with open_run_with(deps, run_id, tenant="acme", recover=False) as again:
                assert again.state.seq >= length + 1
                read = len(seen)
                if snapshot:
                    store.write(again)  # at the head: only the other run's records follow
            return read

        with other:
            busy()
            assert resume(snapshot=True) > 300  # no tail: the partition up to its head
            busy()
            assert deps.tail is not None
            deps.tail.follow_whole(part)
            reader = base.reader_factory()
            head = reader.high_watermark(part)
            reader.close()
            # A worker's tail is live: let this one read the partition to its head first.
            assert deps.tail.offsets_of(part, b"", head - 1, head - 1, wait_s=10) is not None
            read = resume()
        assert read <= 3, read  # the claim's read-back, not the other run's 300
    finally:
        services.close()
