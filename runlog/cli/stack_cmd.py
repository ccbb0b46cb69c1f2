"""``runlog stack up|down|status|env``: the local Kafka + Redis stack (see runlog.stack)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from typing import Any

from runlog import stack


def register(subparsers: Any) -> None:
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "stack",
        help="local Kafka (KRaft) + Redis stack without Docker",
        description=stack.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="stack_command", required=True)

    p_up = sub.add_parser("up", help="start the stack (idempotent) and wait until it answers")
    p_up.add_argument(
        "--timeout", type=float, default=90.0, help="seconds to wait for readiness (default 90)"
    )
    p_up.set_defaults(func=_up)

    p_down = sub.add_parser("down", help="stop the stack (data is kept)")
    p_down.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait after SIGTERM before SIGKILL"
    )
    p_down.set_defaults(func=_down)

    p_status = sub.add_parser("status", help="running or not, ports, pids, logs, data")
    p_status.set_defaults(func=_status)

    p_env = sub.add_parser("env", help='print export lines: eval "$(runlog stack env)"')
    p_env.set_defaults(func=_env)


def _echo(msg: str) -> None:
    print(f"runlog stack: {msg}", file=sys.stderr, flush=True)


def _up(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    st = stack.up(timeout=args.timeout, echo=_echo)
    print(st.describe())
    print(f"ready in {time.monotonic() - t0:.1f}s; point clients at it with:")
    print('  eval "$(runlog stack env)"')
    return 0


def _down(args: argparse.Namespace) -> int:
    st = stack.down(timeout=args.timeout)
    print(st.describe())
    return 0 if not any(s.running and s.managed for s in st.services) else 1


def _status(args: argparse.Namespace) -> int:
    st = stack.status()
    print(st.describe())
    return 0 if st.running else 3


def _env(args: argparse.Namespace) -> int:
    for key, value in stack.env().items():
        print(f"export {key}={shlex.quote(value)}")
    return 0
