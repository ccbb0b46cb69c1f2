"""Per-tenant record MACs (``runlog.schemas._tenant_mac``), the module on its own.

* The MAC covers the record's key and value exactly: the MAC of one record is not valid for
  any other pair, not even one that moves bytes from the key into the value.
* It travels in the ``runlog.mac`` header as ``KEY_ID:HEX`` (HMAC-SHA256); Kafka hands
  header values over as bytes, some clients as text: both are read.
* Rotation: a writer signs with the tenant's first key, a reader accepts any key it holds
  for the tenant.
* A tenant without a key is not checked, and its writers add no header.
* The key file: ``TENANT KEY_ID BASE64-SECRET`` lines, comments and blank lines skipped,
  secrets of at least 16 bytes; a bad line is refused naming the file and line.
* A tenant's fingerprint names its keys: it changes when they change, not when another
  tenant's do.

Forged records in the fold and the settings' key file: tests/security/test_integrity.py.
"""

from __future__ import annotations

import base64
import re

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from runlog.schemas._tenant_mac import HEADER, TenantKeys, parse_tenant_keys

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

SECRET_1 = b"s" * 32
SECRET_2 = b"t" * 32
KEYS = TenantKeys({"acme": (("k1", SECRET_1),)})


def _line(tenant: str, key_id: str, secret: bytes) -> str:
    return f"{tenant} {key_id} {base64.b64encode(secret).decode()}\n"


@FAST
@given(st.binary(max_size=24), st.binary(max_size=48), st.binary(max_size=24), st.data())
def test_the_mac_holds_for_its_own_key_and_value_only(
    key: bytes, value: bytes, other_key: bytes, data: st.DataObject
) -> None:
    header = KEYS.header("acme", key, value)
    assert header is not None
    assert KEYS.check("acme", key, value, [header]) is None
    # Bytes moved across the key/value boundary, either way: another record.
    if key:
        assert KEYS.check("acme", key[:-1], key[-1:] + value, [header]) is not None
    if value:
        assert KEYS.check("acme", key + value[:1], value[1:], [header]) is not None
    other_value = data.draw(st.binary(max_size=48))
    assume((other_key, other_value) != (key, value))
    why = KEYS.check("acme", other_key, other_value, [header])
    assert why is not None and "bad MAC" in why and "'acme'" in why


def test_the_header_is_runlog_mac_with_key_id_and_hex_and_reads_as_bytes_or_text() -> None:
    header = KEYS.header("acme", b"run-1", b"value")
    assert header is not None
    name, raw = header
    assert name == HEADER == "runlog.mac"
    assert isinstance(raw, bytes) and re.fullmatch(rb"k1:[0-9a-f]{64}", raw)
    assert KEYS.check("acme", b"run-1", b"value", [("other", b"x"), (name, raw)]) is None
    assert KEYS.check("acme", b"run-1", b"value", [(name, raw.decode())]) is None
    for headers in (None, [], [("other", raw)], [(name, None)]):
        why = KEYS.check("acme", b"run-1", b"value", headers)
        assert why is not None and "no MAC" in why and "'acme'" in why


def test_a_writer_signs_with_the_first_key_and_a_reader_accepts_any_it_holds() -> None:
    rotated = TenantKeys({"acme": (("k2", SECRET_2), ("k1", SECRET_1))})
    old = KEYS.header("acme", b"run-1", b"value")  # a writer not yet rotated
    new = rotated.header("acme", b"run-1", b"value")
    assert old is not None and new is not None and new[1].startswith(b"k2:")
    assert rotated.check("acme", b"run-1", b"value", [old]) is None
    assert rotated.check("acme", b"run-1", b"value", [new]) is None
    # A reader that never heard of k2 refuses it, naming the key.
    why = KEYS.check("acme", b"run-1", b"value", [new])
    assert why is not None and "'k2'" in why


def test_a_tenant_without_a_key_is_neither_signed_nor_checked() -> None:
    assert KEYS.header("globex", b"run-1", b"value") is None
    assert KEYS.check("globex", b"run-1", b"value", None) is None
    assert KEYS.check("globex", b"run-1", b"value", [(HEADER, b"k1:00")]) is None
    assert not TenantKeys().enforcing and KEYS.enforcing


def test_the_key_file_format() -> None:
    text = (
        "# tenant keys\n\n"
        + _line("acme", "k2", SECRET_2)
        + "   "
        + _line("acme", "k1", SECRET_1)
        + _line("globex", "g1", b"g" * 16)  # 16 bytes: the least allowed
    )
    keys = parse_tenant_keys(text)
    assert keys.keys == {
        "acme": (("k2", SECRET_2), ("k1", SECRET_1)),
        "globex": (("g1", b"g" * 16),),
    }
    header = keys.header("acme", b"run-1", b"value")
    assert header is not None and header[1].startswith(b"k2:")


@pytest.mark.parametrize(
    ("line", "named"),
    [
        pytest.param("acme k1\n", "TENANT KEY_ID BASE64-SECRET", id="two-fields"),
        pytest.param("acme k1 c2VjcmV0 extra\n", "TENANT KEY_ID BASE64-SECRET", id="four"),
        pytest.param("acme k1 not*base64\n", "base64", id="not-base64"),
        pytest.param(_line("acme", "k1", b"x" * 15), "15 bytes", id="short-secret"),
    ],
)
def test_a_bad_key_line_is_refused_naming_the_file_and_line(line: str, named: str) -> None:
    text = "# keys\n" + _line("globex", "g1", SECRET_1) + line
    with pytest.raises(ValueError) as err:
        parse_tenant_keys(text, where="/etc/runlog/tenants")
    assert "/etc/runlog/tenants:3" in str(err.value) and named in str(err.value)


def test_the_fingerprint_names_a_tenants_keys() -> None:
    assert KEYS.fingerprint("globex") == "none"
    fp = KEYS.fingerprint("acme")
    assert fp != "none"
    # Another tenant's keys do not change it.
    both = TenantKeys({"acme": (("k1", SECRET_1),), "globex": (("g", SECRET_2),)})
    assert both.fingerprint("acme") == fp
    assert TenantKeys({"acme": (("k1", SECRET_2),)}).fingerprint("acme") != fp
    assert TenantKeys({"acme": (("k2", SECRET_1),)}).fingerprint("acme") != fp
    assert TenantKeys({"acme": (("k2", SECRET_2), ("k1", SECRET_1))}).fingerprint("acme") != fp
