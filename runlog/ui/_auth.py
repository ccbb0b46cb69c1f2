"""Who may use the console, for which tenants, and how a browser proves it.

Tokens come from the environment only (``RUNLOG_UI_TOKENS``, a JSON object), held as a
secret that never prints: ``{"tok-a": ["tenant-a"], "tok-admin": ["*"]}``, or with a name
that decisions are recorded under: ``{"tok-a": {"tenants": ["tenant-a"], "name": "ann"}}``.
A request carries its token as ``Authorization: Bearer ...`` or in the HttpOnly,
SameSite=Strict cookie the login form sets. A form POST made with the cookie must also
carry the CSRF value of that session (an HMAC of the token under a key this process drew
at start), which a page of another site can neither read nor compute.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Any

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from runlog.errors import ConfigError
from runlog.schemas._keys import tenant_problem

COOKIE = "runlog_console"
ALL_TENANTS = "*"


class UiSettings(BaseSettings):
    """The console's settings (``RUNLOG_UI_*``)."""

    model_config = SettingsConfigDict(env_prefix="RUNLOG_UI_", frozen=True, extra="ignore")

    tokens: SecretStr | None = None
    """JSON object: token -> tenants (``["*"]`` for every tenant), or token ->
    ``{"tenants": [...], "name": "who decisions are recorded as"}``. Secret: never shown."""

    refresh_s: float = 3.0
    """How often an open page refreshes its content (``RUNLOG_UI_REFRESH_S``)."""


@dataclass(frozen=True)
class Grant:
    """What one token may do: see and act for ``tenants`` (``*``: all)."""

    tenants: frozenset[str]
    name: str
    fingerprint: str
    """A short, non-secret id of the token (its hash), for logs and decided_by."""

    def allows(self, tenant: str) -> bool:
        return ALL_TENANTS in self.tenants or tenant in self.tenants

    def visible(self, known: list[str]) -> list[str]:
        """The tenants of ``known`` this grant may see."""
        return [t for t in known if self.allows(t)]


def _fingerprint(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()[:8]


def parse_grants(tokens: SecretStr | None) -> dict[str, Grant]:
    """Token -> grant; ``ConfigError`` (without the tokens in it) if the JSON is wrong."""
    if tokens is None or not tokens.get_secret_value().strip():
        raise ConfigError(
            "the console needs RUNLOG_UI_TOKENS, e.g. "
            '\'{"<a long random token>": ["tenant-a"], "<another>": ["*"]}\''
        )
    try:
        raw: Any = json.loads(tokens.get_secret_value())
    except ValueError:
        raise ConfigError("RUNLOG_UI_TOKENS is not valid JSON") from None
    if not isinstance(raw, dict) or not raw:
        raise ConfigError("RUNLOG_UI_TOKENS must be a non-empty JSON object: token -> tenants")
    out: dict[str, Grant] = {}
    for token, spec in raw.items():
        fp = _fingerprint(token)
        if len(token) < 8:
            raise ConfigError(f"RUNLOG_UI_TOKENS: token {fp} is shorter than 8 characters")
        name = ""
        tenants = spec
        if isinstance(spec, dict):
            tenants, name = spec.get("tenants"), str(spec.get("name") or "")
        if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
            raise ConfigError(f"RUNLOG_UI_TOKENS: token {fp} must name a list of tenants")
        _check_tenants(fp, tenants)
        out[token] = Grant(frozenset(tenants), name or f"console:{fp}", fp)
    return out


def _check_tenants(fp: str, tenants: list[str]) -> None:
    """``["*"]`` alone, or tenant names that ``check_tenant`` accepts (``*`` never is one)."""
    if ALL_TENANTS in tenants and len(tenants) > 1:
        raise ConfigError(
            f"RUNLOG_UI_TOKENS: token {fp} names {ALL_TENANTS!r} (every tenant) beside "
            'other tenants; give either ["*"] or the tenants it may see'
        )
    for tenant in tenants:
        problem = None if tenant == ALL_TENANTS else tenant_problem(tenant)
        if problem is not None:
            raise ConfigError(
                f"RUNLOG_UI_TOKENS: token {fp} names tenant {tenant!a}, which cannot "
                f"be a tenant: {problem}"
            )


class Gate:
    """Checks tokens and CSRF values against the configured grants."""

    def __init__(self, grants: dict[str, Grant]) -> None:
        self._grants = grants
        self._key = secrets.token_bytes(32)

    def grant(self, token: str | None) -> Grant | None:
        if not token:
            return None
        found = None
        # Compare against every token, so timing does not tell how close a guess was.
        for known, grant in self._grants.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                found = grant
        return found

    def csrf(self, token: str) -> str:
        return hmac.new(self._key, token.encode(), hashlib.sha256).hexdigest()

    def csrf_ok(self, token: str, value: str | None) -> bool:
        return value is not None and hmac.compare_digest(self.csrf(token), value)
