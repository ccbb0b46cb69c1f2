"""The list of copies outside the log (``runlog.log._copies``) is the one the code uses: a
projection registered without its line there, or a run key spelled elsewhere, fails here,
so ``forget`` (which purges what the list names) cannot miss it."""

from __future__ import annotations

from runlog.consumers.stores import REGISTRY
from runlog.log import _copies as copies
from runlog.schemas._keys import run_tag


def test_every_projection_is_listed_as_a_copy_its_runner_purges() -> None:
    listed = {c.projection for c in copies.COPIES if c.how == copies.FOLD}
    assert set(REGISTRY) <= listed
    assert "" in listed  # the quarantine, which every projection keeps


def test_the_run_keys_forget_deletes_are_every_delete_copy_under_the_runs_tag() -> None:
    tag = run_tag("p", "acme", "r1")
    deleted = copies.run_keys("p", "acme", "r1") + copies.run_key_patterns("p", "acme", "r1")
    assert all(k.startswith(tag + ":") for k in deleted)
    assert len(deleted) == sum(1 for c in copies.COPIES if c.how == copies.DELETE)
    assert {
        copies.inbox_key("p", "acme", "r1"),
        copies.malformed_key("p", "acme", "r1"),
        copies.cancel_flag_key("p", "acme", "r1"),
        copies.snapshot_key("p", "acme", "r1"),
    } <= set(deleted)
