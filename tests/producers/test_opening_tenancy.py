"""``TenantMismatch`` says that a run belongs to another tenant, never which one: on an
open of another tenant's run, and on a claim another tenant's start beat."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator
from typing import Any

import pytest

from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog.errors import TenantMismatch
from runlog.log._reader import LogReader
from runlog.producers._engine import RunDeps
from runlog.producers._opening import open_run_with
from runlog.schemas._keys import new_run_id
from runlog.schemas._vocabulary import EventType

OWNER = "owner-acme-7f3"
"""The owning tenant's name: no message shown to another tenant may contain it."""


@pytest.fixture
def services(test_settings: Settings) -> Iterator[Services]:
    svc = Services(test_settings, writer_id="tenancy-cmds")
    try:
        yield svc
    finally:
        svc.close()


def test_tenant_mismatch_never_names_the_owner(services: Services) -> None:
    deps = services.run_deps()
    rid = new_run_id()
    with open_run_with(deps, rid, tenant=OWNER) as run:
        run.append(EventType.USER_MESSAGE, content="private")
    with pytest.raises(TenantMismatch) as err:
        open_run_with(deps, rid, tenant="intruder")
    assert "another tenant" in str(err.value) and OWNER not in str(err.value)


class _HookedReader:
    """A LogReader that runs ``hook`` once, right after the first read it serves."""

    def __init__(self, inner: LogReader, hook: Callable[[], None]) -> None:
        self._inner, self._hook = inner, hook

    def read(self, *args: Any, **kwargs: Any) -> Generator[Any, None, None]:
        yield from self._inner.read(*args, **kwargs)
        hook, self._hook = self._hook, lambda: None
        hook()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def test_a_claim_lost_to_another_tenant_never_names_it(
    services: Services, test_settings: Settings
) -> None:
    """Tenant B replays a new run id, then tenant A starts it before B's claim lands."""
    deps = services.run_deps()
    rid = f"race-{new_run_id()}"

    def owner_starts_it() -> None:
        with open_run_with(deps, rid, tenant=OWNER) as run:
            run.append(EventType.USER_MESSAGE, content="first")

    hooked: RunDeps = dataclasses.replace(
        deps,
        reader_factory=lambda: _HookedReader(LogReader(test_settings), owner_starts_it),  # type: ignore[arg-type,return-value]
    )
    with pytest.raises(TenantMismatch) as err:
        open_run_with(hooked, rid, tenant="intruder")
    assert "meanwhile" in str(err.value), err.value
    assert "another tenant" in str(err.value) and OWNER not in str(err.value)
