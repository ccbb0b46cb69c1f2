"""The registry of projections: the store iterates it, one line registers a projection.

A projection is one module here: its name, its pure fold (``projections/``) and its store
half (a ``store.Handler``), declared together as ``PROJECTION``. Adding one is that module
plus its line below.
"""

from __future__ import annotations

from typing import Any

from runlog.consumers.store import Handler, Projection, ProjectionKeys
from runlog.consumers.stores import audit, notify, state, uncertain
from runlog.schemas.signing import NO_AUTHORITY, DecisionAuthority

REGISTRY: dict[str, Projection] = {
    p.name: p
    for p in (
        state.PROJECTION,
        uncertain.PROJECTION,
        audit.PROJECTION,
        notify.PROJECTION,
    )
}
"""Every projection by name, in the order ``runlog project all`` runs them."""

PROJECTIONS = tuple(name for name, p in REGISTRY.items() if p.in_all)
"""The projections ``runlog project all`` runs."""
NOTIFY = notify.NAME
"""The notification projection: runs on its own (``runlog project notify``), with a hook."""
KNOWN = tuple(REGISTRY)


def make_handler(
    name: str, prefix: str, topic: str, authority: DecisionAuthority = NO_AUTHORITY
) -> Handler[Any]:
    projection = REGISTRY.get(name)
    if projection is None:
        raise ValueError(f"unknown projection {name!r}; expected one of {', '.join(KNOWN)}")
    return projection.handler(ProjectionKeys(prefix, name, topic), authority)
