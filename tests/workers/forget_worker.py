"""``runlog.forget`` in a process of its own, with a key shredder that stops after it
destroyed the keys, so a test can SIGKILL the process between the shred and the purge.

    python tests/workers/forget_worker.py --dir D --name N --tenant T --run R [--halt]

The shredder records each subject it destroyed in Redis (``<prefix>:test-shredded``: the
stand-in key store, outside this process) and, with ``--halt``, writes the ``shredded``
flag and waits for a ``go`` that never comes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent.parent), str(HERE.parent)]

import runlog._api  # noqa: E402
from runlog._settings import Settings  # noqa: E402
from runlog.log._clients import redis_client  # noqa: E402
from workers.common import Flags  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--name", required=True)
    ap.add_argument("--tenant", default="acme")
    ap.add_argument("--run", required=True)
    ap.add_argument("--halt", action="store_true")
    opts = ap.parse_args()
    settings = Settings()
    flags = Flags(opts.dir, opts.name)
    client = redis_client(settings)
    store = f"{settings.redis_key_prefix}:test-shredded"

    class Shredder:
        def key_ids(self, tenant: str, subject: str) -> list[str]:
            return [f"key-{subject}"]

        def shred(self, tenant: str, subject: str) -> list[str]:
            destroyed = bool(client.sadd(store, f"{tenant}/{subject}"))
            if opts.halt:
                flags.set("shredded", subject)
                flags.hold()
            return [f"key-{subject}"] if destroyed else []

    report = runlog._api.forget(
        tenant=opts.tenant,
        run_id=opts.run,
        reason="art. 17 request",
        by="dpo",
        shredder=Shredder(),
        settings=settings,
        wait_s=60,
    )
    flags.set("report", json.dumps(dataclasses.asdict(report)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
