"""Tenant names that cannot be mistaken for another tenant, a wildcard, or nothing.

``check_tenant`` is the one rule, asked by every Redis key of a run and so by every
writer and decision before anything is appended:

* ``*`` means "every tenant" to the console's tokens, so it is never a tenant name (nor
  is any name holding ``*``): a token for a tenant is never a token for all of them;
* invisible and bidirectional characters (Unicode categories Cc, Cf, Cs, Zl, Zp, spaces
  other than U+0020, the bidi controls U+202A-U+202E and U+2066-U+2069) are refused: the
  console shows a tenant's name to people who decide on its runs, and ``acme`` followed
  by U+202E must not pass for another tenant there;
* the refusal is ``InvalidTenant``: a runlog error and a ``ValueError``, naming the tenant
  (escaped) and why.
"""

from __future__ import annotations

import pytest
import redis
from pydantic import SecretStr

import runlog
from runlog._settings import Settings
from runlog.errors import ConfigError, InvalidTenant, RunlogError
from runlog.log._reader import LogReader
from runlog.schemas._keys import check_tenant
from runlog.ui._auth import ALL_TENANTS, parse_grants

INVISIBLE = [
    "acme\u202e",  # RIGHT-TO-LEFT OVERRIDE
    "\u202aacme",  # LEFT-TO-RIGHT EMBEDDING
    "ac\u2066me",  # LEFT-TO-RIGHT ISOLATE
    "acme\u2069",  # POP DIRECTIONAL ISOLATE
    "ac\u200bme",  # ZERO WIDTH SPACE (Cf)
    "acme\u200d",  # ZERO WIDTH JOINER (Cf)
    "\ufeffacme",  # BYTE ORDER MARK (Cf)
    "acme\u00ad",  # SOFT HYPHEN (Cf)
    "ac\u2028me",  # LINE SEPARATOR (Zl)
    "ac\u2029me",  # PARAGRAPH SEPARATOR (Zp)
    "ac\u0085me",  # NEXT LINE (Cc)
    "ac\x7fme",  # DELETE (Cc)
    "ac\u00a0me",  # NO-BREAK SPACE: looks like "ac me"
    "ac\ud800me",  # a lone surrogate (Cs): not even encodable
]


def test_the_wildcard_is_not_a_tenant_name() -> None:
    assert ALL_TENANTS == "*"
    for bad in ("*", "acme*", "*acme"):
        with pytest.raises(InvalidTenant) as err:
            check_tenant(bad)
        assert repr(bad) in str(err.value) and "*" in str(err.value)


def test_invisible_and_bidi_characters_are_refused() -> None:
    for bad in INVISIBLE:
        with pytest.raises(InvalidTenant) as err:
            check_tenant(bad)
        assert isinstance(err.value, ValueError) and isinstance(err.value, RunlogError)
        assert ascii(bad) in str(err.value), str(err.value)
    for good in ("acme", "Acme Corp", "acmé", "東京", "a-b_c.d@e"):
        assert check_tenant(good) == good


@pytest.mark.parametrize("tenant", ["*", "acme\u202e", "ac\u200bme"])
def test_open_run_refuses_such_a_tenant_before_writing(
    tenant: str, test_settings: Settings, redis_client: redis.Redis
) -> None:
    with pytest.raises(InvalidTenant):
        runlog.open_run("order-7", tenant=tenant, settings=test_settings)
    assert list(redis_client.scan_iter(match=f"{test_settings.redis_key_prefix}*")) == []
    with LogReader(test_settings) as reader:
        assert list(reader.read("order-7")) == []


def test_a_console_token_names_only_valid_tenants_or_the_wildcard() -> None:
    grants = parse_grants(SecretStr('{"token-for-all": ["*"], "token-for-acme": ["acme"]}'))
    assert grants["token-for-all"].allows("globex")
    assert not grants["token-for-acme"].allows("globex")
    # The wildcard with names beside it is a mistake to be told, not a silent "all".
    for tenants in ('["acme", "*"]', '["acme\\u202e"]', '["acme*"]', '[""]'):
        with pytest.raises(ConfigError) as err:
            parse_grants(SecretStr('{"token-for-acme": ' + tenants + "}"))
        assert "token-for-acme" not in str(err.value)  # the secret never prints
