"""Who may use the console, for which tenants, and how a browser proves it.

``runlog.ui._auth`` (docs/howto/console.md, "Tokens and tenants" and "Safe by default"):
``RUNLOG_UI_TOKENS`` maps tokens to tenants (``["*"]``: all) and optionally a name decisions
are recorded under (else ``console:<first 8 hex of the token's SHA-256>``); a wrong value is
refused naming the variable and never the token; the gate knows exactly the configured
tokens; a CSRF value is an HMAC of the token under a key this process drew. The missing
variable, the short token, the wildcard beside names and bad tenant names are refused in
tests/ui/test_app.py and tests/schemas/test_keys_tenant_names.py.
"""

from __future__ import annotations

import hashlib
import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import SecretStr

from runlog.errors import ConfigError
from runlog.ui._auth import Gate, Grant, UiSettings, parse_grants

TOKEN_A = "token-for-acme-0001"
TOKEN_ALL = "token-for-all-00002"


def _grants(raw: object) -> dict[str, Grant]:
    return parse_grants(SecretStr(json.dumps(raw)))


def test_a_grant_sees_its_tenants_or_every_tenant() -> None:
    grants = parse_grants(SecretStr(json.dumps({TOKEN_A: ["acme", "initech"], TOKEN_ALL: ["*"]})))
    acme, everyone = grants[TOKEN_A], grants[TOKEN_ALL]
    assert acme.allows("acme") and acme.allows("initech") and not acme.allows("globex")
    known = ["globex", "initech", "acme", "umbrella"]
    assert acme.visible(known) == ["initech", "acme"]  # in the order given
    assert everyone.visible(known) == known
    assert not acme.allows("*")  # the wildcard is a grant's, never a tenant's


def test_decisions_are_recorded_under_the_name_or_the_tokens_fingerprint() -> None:
    grants = parse_grants(
        SecretStr(
            json.dumps(
                {
                    TOKEN_A: ["acme"],
                    TOKEN_ALL: {"tenants": ["*"], "name": "oncall"},
                    "token-unnamed-0003": {"tenants": ["acme"], "name": ""},
                }
            )
        )
    )
    fingerprint = hashlib.sha256(TOKEN_A.encode()).hexdigest()[:8]
    assert grants[TOKEN_A].fingerprint == fingerprint
    assert grants[TOKEN_A].name == f"console:{fingerprint}"
    assert grants[TOKEN_ALL].name == "oncall" and grants[TOKEN_ALL].allows("anyone")
    unnamed = hashlib.sha256(b"token-unnamed-0003").hexdigest()[:8]
    assert grants["token-unnamed-0003"].name == f"console:{unnamed}"


@pytest.mark.parametrize(
    "raw",
    [
        "{" + json.dumps(TOKEN_A) + ": ",  # not JSON
        json.dumps([TOKEN_A]),  # not an object
        "{}",  # nobody could log in
        "   ",  # blank: as if unset
    ],
)
def test_a_tokens_value_that_is_no_token_map_is_refused_naming_the_variable(raw: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_grants(SecretStr(raw))
    assert "RUNLOG_UI_TOKENS" in str(err.value)
    assert TOKEN_A not in str(err.value)


@pytest.mark.parametrize(
    "spec",
    [
        "acme",  # a string, not a list
        ["acme", 7],
        {"name": "ann"},  # no tenants
        {"tenants": "acme", "name": "ann"},
        None,
    ],
)
def test_a_token_without_a_list_of_tenants_is_refused_by_its_fingerprint(spec: object) -> None:
    with pytest.raises(ConfigError) as err:
        _grants({TOKEN_ALL: ["*"], TOKEN_A: spec})
    message = str(err.value)
    assert "RUNLOG_UI_TOKENS" in message
    assert hashlib.sha256(TOKEN_A.encode()).hexdigest()[:8] in message  # which one
    assert TOKEN_A not in message and TOKEN_ALL not in message  # the secret never prints


_tokens = st.text(min_size=8, max_size=40)


@given(known=st.lists(_tokens, min_size=1, max_size=4, unique=True), guess=st.text(max_size=44))
def test_the_gate_knows_exactly_the_configured_tokens(known: list[str], guess: str) -> None:
    grants = _grants({t: ["acme"] for t in known})
    gate = Gate(grants)
    for token in known:
        assert gate.grant(token) is grants[token]
        assert gate.grant(token[:-1]) is grants.get(token[:-1])  # no prefix matches
        assert gate.grant(token + "x") is grants.get(token + "x")
    assert gate.grant(guess) is grants.get(guess)
    assert gate.grant(None) is None and gate.grant("") is None


def test_a_csrf_value_belongs_to_one_token_and_one_console_process() -> None:
    grants = _grants({TOKEN_A: ["acme"], TOKEN_ALL: ["*"]})
    gate, restarted = Gate(grants), Gate(grants)
    value = gate.csrf(TOKEN_A)
    assert gate.csrf(TOKEN_A) == value  # stable for the session
    assert gate.csrf_ok(TOKEN_A, value)
    assert TOKEN_A not in value
    assert not gate.csrf_ok(TOKEN_ALL, value)  # another session's value
    assert not gate.csrf_ok(TOKEN_A, None) and not gate.csrf_ok(TOKEN_A, "")
    assert not restarted.csrf_ok(TOKEN_A, value)  # another process drew another key


def test_the_settings_read_runlog_ui_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RUNLOG_UI_REFRESH_S", raising=False)
    monkeypatch.delenv("RUNLOG_UI_TOKENS", raising=False)
    assert UiSettings().refresh_s == 3.0 and UiSettings().tokens is None
    monkeypatch.setenv("RUNLOG_UI_REFRESH_S", "0.5")
    monkeypatch.setenv("RUNLOG_UI_TOKENS", json.dumps({TOKEN_A: ["acme"]}))
    ui = UiSettings()
    assert ui.refresh_s == 0.5
    assert set(parse_grants(ui.tokens)) == {TOKEN_A}
