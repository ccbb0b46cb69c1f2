"""The permanent fixture of a sealed run (tests/fixtures/sealed-v1) decodes under today's
code: with its key, to exactly the writer's state; without a key, ``NoKeys``; after its
subject's key is shredded, to the same structure with every content field ``ERASED``."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from runlog.errors import NoKeys
from runlog.log._keys import FileKeyStore, Keks
from runlog.projections._run_state import RunState, apply
from runlog.schemas import _codec as codec
from runlog.schemas._models import Event
from runlog.schemas._sealing import ERASED, SEALED_FIELDS, erased_fields

FIXTURE = Path(__file__).parents[1] / "fixtures" / "sealed-v1"


def _values() -> list[bytes]:
    lines = (FIXTURE / "records.jsonl").read_text().splitlines()
    return [base64.b64decode(json.loads(line)["value_b64"]) for line in lines]


def _store(tmp: Path) -> FileKeyStore:
    shutil.copytree(FIXTURE / "keys", tmp / "keys")
    keks = Keks.parse((FIXTURE / "kek").read_text(), where="fixture")
    return FileKeyStore(tmp / "keys", keks, refresh_s=0)


def _fold(events: list[Event]) -> dict[str, Any]:
    state = RunState()
    for ev in events:
        apply(state, ev)
    return state.to_dict()


def test_the_sealed_fixture_folds_to_its_writers_state(tmp_path: Path) -> None:
    values = _values()
    assert all(b"Ada" not in v for v in values), "the fixture holds plaintext content"
    store = _store(tmp_path)
    events = [codec.decode(v, None, store) for v in values]
    expected = json.loads((FIXTURE / "state.json").read_text())
    assert json.loads(json.dumps(_fold(events), default=str)) == json.loads(
        json.dumps(expected, default=str)
    )
    with pytest.raises(NoKeys):
        codec.decode(values[1])


def test_the_sealed_fixture_after_a_shred_keeps_its_structure(tmp_path: Path) -> None:
    meta = json.loads((FIXTURE / "meta.json").read_text())
    store = _store(tmp_path)
    opened = [codec.decode(v, None, store) for v in _values()]
    assert store.shred(meta["tenant"], meta["subject"])
    erased = [codec.decode(v, None, store) for v in _values()]
    for before, after in zip(opened, erased, strict=True):
        assert (after.event_id, after.type, after.seq, after.epoch, after.occurred_at) == (
            before.event_id,
            before.type,
            before.seq,
            before.epoch,
            before.occurred_at,
        )
        sealed = [p for p in SEALED_FIELDS.get(after.type, ()) if "[]" not in p]
        for name in sealed:
            if getattr(before.payload, name):
                assert getattr(after.payload, name) == ERASED
    assert any(erased_fields(ev) for ev in erased)
    state = _fold(erased)
    assert state["status"] == "finished" and state["seq"] == len(erased)
    assert "Ada" not in json.dumps(state, default=str)
