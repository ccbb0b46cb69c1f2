"""The slim run state the uncertain, audit and notify projections keep to ask the writers'
verdict: without the conversation and the stored results, and judging exactly as the full
state does.

Pure: synthetic logs (``replay_support.synthetic_log``) folded in memory.
"""

from __future__ import annotations

import json
from typing import Any

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from replay_support import OPS, synthetic_log

from runlog.projections._run_state import RunState, accept, fold, is_valid
from runlog.projections._verdict import slim_dict
from runlog.schemas._signing import DecisionAuthority

CONVERSATION = ("messages", "completed_calls")


def _without_conversation(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if k not in CONVERSATION}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(st.sampled_from(OPS), max_size=50),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_a_slim_state_judges_and_folds_on_like_the_full_one(
    ops: list[str], seed: int, data: st.DataObject
) -> None:
    """Stored slim at any record and read back, the state accepts and refuses the same
    records as the full one, and keeps the same open calls, approvals and counters."""
    events = synthetic_log(ops, seed)
    cut = data.draw(st.integers(0, len(events)))
    full = fold(events[:cut])
    slim = RunState.from_dict(json.loads(json.dumps(slim_dict(full))))
    for ev in events[cut:]:
        assert is_valid(slim, ev) == is_valid(full, ev), ev
        assert accept(slim, ev) == accept(full, ev)
    assert _without_conversation(slim.to_dict()) == _without_conversation(full.to_dict())
    assert slim.open_calls == full.open_calls and slim.approvals == full.approvals


def test_slim_leaves_out_the_conversation_and_the_stored_results_and_keeps_the_rest() -> None:
    full = fold(synthetic_log(["user", "turn", "call", "complete", "call", "approval"], 4))
    assert full.messages and full.completed_calls and full.open_calls and full.approvals
    slim = slim_dict(full)
    assert slim["messages"] == [] and slim["completed_calls"] == {}
    whole = full.to_dict()
    assert {k: slim[k] for k in whole if k not in CONVERSATION} == _without_conversation(whole)
    # The state itself is untouched: slimming is a view of it.
    assert full.messages and full.completed_calls


def test_slim_is_to_dict_without_the_conversation_even_for_a_reader_that_trusts_keys() -> None:
    """The docstring's promise: ``state.to_dict()`` without the conversation and stored
    results; a reader's trusted decider keys are not state (``TRANSIENT``)."""
    key = Ed25519PrivateKey.generate().public_key().public_bytes_raw()
    full = fold(
        synthetic_log(["user", "call", "turn"], 1),
        RunState(authority=DecisionAuthority({"ops": key})),
    )
    slim = slim_dict(full)
    json.dumps(slim)  # JSON-ready, as every projection state's to_dict is stored
    assert slim == {**full.to_dict(), "messages": [], "completed_calls": {}}
