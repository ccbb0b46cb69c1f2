"""A fork is its parent's data subject's, and its first record holds no plaintext.

RUN_FORKED carries the parent's state at the fork point (its messages, tool results) so the
fork replays without its parent: with encryption on, that state is sealed like any content
field, under the parent's subject, and so is every later event of the fork. The byte scan
of the events topic's segment files also inflates every base64 run it finds (the packed
state is zlib-compressed base64: a plain scan would not see a marker inside it). After a
shred of the parent's subject, the parent and its fork replay, verify and show on their
structure with their content erased, while another subject's run is unchanged.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import subprocess
import sys
import uuid
import zlib
from pathlib import Path

import redis
from scan_support import kafka_dirs
from test_encryption import _contents, _env, _write, sealed  # noqa: F401

import runlog
from runlog._settings import Settings
from runlog.consumers._queries import get_state, quarantined
from runlog.consumers._verify import verify_run
from runlog.consumers.runner import rebuild
from runlog.log import _keys as keys_mod
from runlog.log._keys import keys_for
from runlog.log._reader import LogReader
from runlog.log._replay import replay
from runlog.projections._lineage import pack_state
from runlog.schemas._sealing import ERASED, erased_fields

B64 = re.compile(rb"[A-Za-z0-9+/]{24,}={0,2}")


def _readable(data: bytes) -> bytes:
    """``data`` and the inflation of every zlib-compressed base64 run inside it: what a
    reader of the segment files recovers without any key."""
    out = [data]
    for match in B64.finditer(data):
        run = match.group()
        for cut in range(4):  # the run may begin mid-value: try its 4 alignments
            chunk = run[cut:]
            chunk = chunk[: len(chunk) - len(chunk) % 4]
            try:
                out.append(zlib.decompress(base64.b64decode(chunk, validate=True)))
                break
            except (binascii.Error, zlib.error, ValueError):
                continue
    return b"\n".join(out)


def _readable_on_disk(topic: str, needle: bytes) -> bool:
    found_dir = False
    for root in kafka_dirs():
        # os.walk, not Path.rglob: a test beside this one deletes its topics meanwhile, and
        # a directory vanishing under rglob raises; os.walk skips it.
        dirs = [Path(top) / name for top, names, _ in os.walk(root) for name in names]
        for d in dirs:
            if not d.name.startswith(f"{topic}-") or not d.name[len(topic) + 1 :].isdigit():
                continue
            found_dir = True
            for f in d.iterdir():
                if f.is_file() and f.suffix == ".log" and needle in _readable(f.read_bytes()):
                    return True
    assert found_dir, f"no partition directory of {topic} on disk"
    return False


def test_the_scan_reads_a_packed_state() -> None:
    """The control: a marker inside a packed state (what RUN_FORKED carried in clear before
    v3) is invisible to a plain byte scan and readable to this one."""
    marker = f"MARK-{uuid.uuid4().hex}"
    packed = b"\x00\x02" + pack_state({"messages": [{"content": marker}]}).encode() + b"\x00"
    assert marker.encode() not in packed
    assert marker.encode() in _readable(packed)


def test_a_fork_is_sealed_under_its_parents_subject(
    sealed: Settings,  # noqa: F811
    redis_client: redis.Redis,
) -> None:
    s = sealed
    marker, other = f"MARK-{uuid.uuid4().hex}", f"KEEP-{uuid.uuid4().hex}"
    rid = _write(s, marker, "user-42")
    rid2 = _write(s, other, None)
    fork = runlog.fork(rid, at_seq=4, tenant="acme", settings=s, reason=f"what if {marker}")
    with runlog.open_run(fork.run_id, tenant="acme", settings=s) as run:
        run.append("user_message", content=f"fork says {marker}")
        run.finish("done", summary=f"fork summary {marker}")

    # A fork of the fork is the same person's data too.
    grandchild = runlog.fork(fork.run_id, at_seq=2, tenant="acme", settings=s)

    # No plaintext of the parent's content anywhere in the events topic, packed state included.
    assert not _readable_on_disk(s.events_topic, marker.encode()), "marker readable on disk"
    st = replay(s, redis_client, fork.run_id, tenant="acme").state
    assert st.subject == "user-42" and marker in _contents(st)
    assert st.lineage is not None and st.lineage.parent_run_id == rid
    fork_seq = st.seq
    assert verify_run(s, redis_client, fork.run_id, tenant="acme").ok
    before_other = replay(s, redis_client, rid2, tenant="acme").state.to_dict()

    store = keys_for(s)
    assert store is not None
    # One subject, one key: the fork's events made no key of their own.
    assert len(store.shred("acme", "user-42")) == 1
    keys_mod.close_shared()

    assert replay(s, redis_client, grandchild.run_id, tenant="acme").state.subject == "user-42"
    for run_id in (rid, fork.run_id, grandchild.run_id):
        got = replay(s, redis_client, run_id, tenant="acme")
        text = _contents(got.state)
        assert marker not in text, run_id
        if run_id == rid:
            assert ERASED in text
        else:  # the carried state itself is erased: the fork's prefix folds empty
            with LogReader(s) as reader:
                first = next(iter(reader.read(run_id))).event
            assert "state" in erased_fields(first), run_id
        if run_id != grandchild.run_id:  # forked before its parent finished: still open
            assert got.state.status == "finished" and got.state.outcome == "done"
        report = verify_run(s, redis_client, run_id, tenant="acme")
        assert report.ok, report.to_dict()
    st = replay(s, redis_client, fork.run_id, tenant="acme").state
    # Structure kept: the lineage, the fork's own events after the (erased) prefix.
    assert st.lineage is not None and st.lineage.parent_run_id == rid
    assert st.lineage.at_seq == 4 and st.seq == fork_seq and st.subject == "user-42"
    assert replay(s, redis_client, rid2, tenant="acme").state.to_dict() == before_other
    # The state projection, rebuilt after the shred, folds the erased fork without
    # quarantining it, and still says whose data it is (what a subject's lookup reads).
    rebuild(redis_client, s, ["state"])
    view = get_state(redis_client, s, fork.run_id)
    assert view is not None and view["state"]["subject"] == "user-42"
    assert marker not in json.dumps(view, default=str, ensure_ascii=False)
    assert quarantined(redis_client, s, ("state",)) == []

    done = subprocess.run(
        [sys.executable, "-m", "runlog.cli", "show", fork.run_id, "--tenant", "acme"],
        env=_env(s),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert marker not in done.stdout
