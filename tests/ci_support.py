"""Whether this is a CI run: there a missing Kafka, Redis or redis-server fails a test,
never skips it."""

from __future__ import annotations

import os

IN_CI = os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}
