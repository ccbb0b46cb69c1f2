"""The decider keys a reader trusts and the key a decider signs with, from its settings.

``authority_for(settings)`` is what every reader hands the fold (``RunState.authority``):
the public keys of ``RUNLOG_DECIDER_PUBLIC_KEYS``, read once per file version. A file
that is set but cannot be read or parsed raises ``ConfigError``: a reader never falls
back to trusting every decision because its key file went missing.
"""

from __future__ import annotations

import os
import threading

from runlog._settings import Settings
from runlog.errors import ConfigError
from runlog.schemas._signing import (
    NO_AUTHORITY,
    DecisionAuthority,
    DecisionSigner,
    load_authority,
    load_signer,
)
from runlog.schemas._tenant_mac import NO_TENANT_KEYS, TenantKeys, parse_tenant_keys

__all__ = ["authority_for", "signer_for", "tenant_keys_for"]

_lock = threading.Lock()
_cache: dict[tuple[str, int, int], DecisionAuthority] = {}
_tenant_cache: dict[tuple[str, int, int], TenantKeys] = {}


def tenant_keys_for(settings: Settings) -> TenantKeys:
    """The per-tenant MAC keys of ``settings`` (``RUNLOG_TENANT_KEYS``; unset: none)."""
    path = settings.tenant_keys
    if not path:
        return NO_TENANT_KEYS
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        with _lock:
            found = _tenant_cache.get(key)
        if found is None:
            with open(path) as fh:
                found = parse_tenant_keys(fh.read(), where=path)
            if not found.enforcing:
                raise ValueError("names no tenant: unset RUNLOG_TENANT_KEYS instead")
            with _lock:
                _tenant_cache[key] = found
        return found
    except (OSError, ValueError) as exc:
        raise ConfigError(f"RUNLOG_TENANT_KEYS={path}: {exc}") from exc


def authority_for(settings: Settings) -> DecisionAuthority:
    """The trusted deciders of ``settings`` (none configured: ``NO_AUTHORITY``)."""
    path = settings.decider_public_keys
    if not path:
        return NO_AUTHORITY
    try:
        st = os.stat(path)
        key = (path, st.st_mtime_ns, st.st_size)
        with _lock:
            found = _cache.get(key)
        if found is None:
            found = load_authority(path)
            with _lock:
                _cache[key] = found
        return found
    except (OSError, ValueError) as exc:
        raise ConfigError(f"RUNLOG_DECIDER_PUBLIC_KEYS={path}: {exc}") from exc


def signer_for(settings: Settings) -> DecisionSigner | None:
    """The decider key of ``settings`` (``RUNLOG_DECIDER_KEY_FILE``), or None when unset."""
    path = settings.decider_key_file
    if not path:
        return None
    try:
        return load_signer(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"RUNLOG_DECIDER_KEY_FILE={path}: {exc}") from exc
