"""How a record written with an older version of a type becomes the current version.

Each step ``vN -> vN+1`` of a type is exactly one of:

* **compatible**: the meaning did not change (e.g. a new optional field with a default);
  Avro schema resolution does the work;
* **upcast**: the meaning changed; a named function rewrites the payload dict;

A step that is neither raises ``MissingUpcaster``: the reader never guesses.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from schemas.vocabulary import EventType

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

# (type, from_version): the step from_version -> from_version + 1 is plain Avro resolution.
COMPATIBLE_STEPS: frozenset[tuple[EventType, int]] = frozenset()

# (type, from_version): the payload upcaster for the step from_version -> from_version + 1.
UPCASTERS: dict[tuple[EventType, int], Upcaster] = {}
