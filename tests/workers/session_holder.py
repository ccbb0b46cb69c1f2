"""Holds run leases bound to its process's session, for the liveness tests.

Usage: python session_holder.py PREFIX TENANT LIVENESS_MS RUN_ID...
Prints ``held <epoch> ...`` once it holds them all, then answers each line of stdin
(``check``) with ``check <verdict of each lease's authoritative check>``.
"""

from __future__ import annotations

import os
import sys

import redis

from runlog.errors import RedisUnavailable
from runlog.producers._lease import Lease, LeaseManager


def main() -> None:
    prefix, tenant, liveness, *runs = sys.argv[1:]
    client = redis.Redis.from_url(os.environ["RUNLOG_REDIS_URL"])
    mgr = LeaseManager(client, key_prefix=prefix, liveness_ttl_ms=int(liveness))
    leases = []
    for rid in runs:
        got = mgr.try_acquire(tenant, rid, f"holder-{os.getpid()}", 60_000)
        assert isinstance(got, Lease), got
        leases.append(got)
    print("held", *(lease.epoch for lease in leases), flush=True)
    for line in sys.stdin:
        if line.strip() == "check":
            verdicts = []
            for lease in leases:
                try:
                    verdicts.append(str(lease.locally_valid() or lease.check()))
                except RedisUnavailable:
                    verdicts.append("False")
            print("check", *verdicts, flush=True)


if __name__ == "__main__":
    main()
