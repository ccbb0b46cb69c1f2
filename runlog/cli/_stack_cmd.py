"""``runlog stack up|down|status|env``: the local Kafka + Redis stack (see runlog.stack)."""

from __future__ import annotations

import argparse
import shlex
import signal
import sys
import time
from typing import Any

from runlog import stack
from runlog.cli._groups import EXIT_OK, EXIT_STACK_DOWN, command_group, print_json
from runlog.stack import _redis_cluster as redis_cluster
from runlog.stack import _registry as registry
from runlog.stack import _secure as secure


def register(subparsers: Any) -> None:
    sub = command_group(
        subparsers,
        "stack",
        help="local Kafka (KRaft) + Redis stack without Docker",
        description=stack.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )

    p_up = sub.add_parser("up", help="start the stack (idempotent) and wait until it answers")
    p_up.add_argument(
        "--timeout", type=float, default=90.0, help="seconds to wait for readiness (default 90)"
    )
    p_up.add_argument(
        "--registry",
        action="store_true",
        help="also start a Confluent-compatible schema registry (Apicurio; fetched once) on "
        f"127.0.0.1:RUNLOG_STACK_REGISTRY_PORT ({registry.DEFAULT_REGISTRY_PORT}); `stack env` "
        "then prints "
        "RUNLOG_SCHEMA_REGISTRY_URL",
    )
    _cluster_option(p_up, "also start a local Redis Cluster of three masters")
    _nodes_option(p_up)
    p_up.set_defaults(func=_up)

    p_down = sub.add_parser("down", help="stop the stack (data is kept)")
    p_down.add_argument(
        "--timeout", type=float, default=60.0, help="seconds to wait after SIGTERM before SIGKILL"
    )
    _cluster_option(p_down, "also stop the local Redis Cluster")
    _nodes_option(p_down)
    p_down.set_defaults(func=_down)

    p_status = sub.add_parser("status", help="running or not, ports, pids, logs, data")
    _nodes_option(p_status)
    p_status.add_argument("--json", action="store_true")
    p_status.set_defaults(func=_status)

    p_env = sub.add_parser("env", help='print export lines: eval "$(runlog stack env)"')
    _nodes_option(p_env)
    _cluster_option(p_env, "point RUNLOG_REDIS_URL at the local Redis Cluster")
    p_env.add_argument(
        "--role",
        choices=secure.ALL_ROLES,
        default="admin",
        help="secure stack: the principal to connect as (default admin: it creates topics "
        "and ACLs); passwords are never printed, see the comment lines",
    )
    p_env.add_argument("--json", action="store_true", help="the variables as one JSON object")
    p_env.set_defaults(func=_env)

    p_init = sub.add_parser(
        "init",
        help="secure stack: make its certificates, passwords and Redis ACL file without "
        "starting it (for docker compose --profile secure)",
    )
    _nodes_option(p_init)
    p_init.set_defaults(func=_init)

    p_node = sub.add_parser(
        "node", help="fault injection on one Kafka node of a cluster: kill -9, stop, start"
    )
    p_node.add_argument("action", choices=("kill", "stop", "start"))
    p_node.add_argument("node_id", type=int, help="node id (1..N)")
    _nodes_option(p_node, default=3)
    p_node.set_defaults(func=_node)


def _cluster_option(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument(
        "--redis-cluster",
        action="store_true",
        help=f"{what} (ports RUNLOG_STACK_REDIS_CLUSTER_PORT and the two after it, "
        f"default {redis_cluster.DEFAULT_PORT})",
    )


def _nodes_option(parser: argparse.ArgumentParser, default: int = 1) -> None:
    parser.add_argument(
        "--nodes",
        type=int,
        default=default,
        help="1: the single-node stack; 3: the three-node cluster on its own ports and "
        f"state dir, for fault tests (default {default})",
    )
    if default == 1:
        parser.add_argument(
            "--secure",
            action="store_true",
            help="the secure stack (TLS, SASL/SCRAM, ACLs; Redis TLS + ACL users) on its own "
            "ports and state dir (RUNLOG_SECURE_*)",
        )


def _config(args: argparse.Namespace) -> stack.StackConfig:
    return stack.StackConfig.from_env(nodes=args.nodes, secure=getattr(args, "secure", False))


def _flags(args: argparse.Namespace) -> str:
    nodes = f" --nodes {args.nodes}" if args.nodes != 1 else ""
    return nodes + (" --secure" if getattr(args, "secure", False) else "")


def _echo(msg: str) -> None:
    print(f"runlog stack: {msg}", file=sys.stderr, flush=True)


def _up(args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    cfg = _config(args)
    st = stack.up(cfg, timeout=args.timeout, echo=_echo)
    print(st.describe())
    if args.registry:
        print(f"  schema registry: {registry.up(cfg, echo=_echo, advertise=True)}")
    if args.redis_cluster:
        print(f"  redis cluster: {redis_cluster.up(cfg.state_dir)} (3 masters)")
    print(f"ready in {time.monotonic() - t0:.1f}s; point clients at it with:")
    cluster = " --redis-cluster" if args.redis_cluster else ""
    print(f'  eval "$(runlog stack env{_flags(args)}{cluster})"')
    if args.secure:
        folder = secure.secrets_dir(_config(args))
        print(f"  set -a; . {folder}/admin.env; set +a    # its passwords (admin; or another role)")
        print("  runlog topics create                  # as admin: topics and the roles' ACLs")
    return 0


def _down(args: argparse.Namespace) -> int:
    cfg = _config(args)
    registry.down(cfg, timeout=args.timeout)
    if args.redis_cluster:
        redis_cluster.down(cfg.state_dir, timeout=args.timeout)
    st = stack.down(cfg, timeout=args.timeout)
    print(st.describe())
    return 0 if not any(s.running and s.managed for s in st.services) else 1


def _status(args: argparse.Namespace) -> int:
    cfg = _config(args)
    st = stack.status(cfg)
    url = registry.url_if_running(cfg)
    if args.json:
        print_json(
            {
                "running": st.running,
                "services": [
                    {
                        "name": s.name,
                        "running": s.running,
                        "managed": s.managed,
                        "address": s.address,
                        "pid": s.pid,
                        "log_file": s.log_file,
                        "data_dir": s.data_dir,
                    }
                    for s in st.services
                ],
                "bootstrap_servers": st.bootstrap_servers,
                "redis_url": st.redis_url,
                "state_dir": st.state_dir,
                "kafka_version": st.kafka_version,
                "schema_registry": url,
                "notes": list(st.notes),
            }
        )
        return EXIT_OK if st.running else EXIT_STACK_DOWN
    print(st.describe())
    if url is not None and registry.advertised_url(cfg) is None:
        url += " (not exported by `stack env`: started without `stack up --registry`)"
    print(f"  schema registry: {url or 'not running'}")
    return EXIT_OK if st.running else EXIT_STACK_DOWN


def _env(args: argparse.Namespace) -> int:
    cfg = _config(args)
    variables = stack.env(cfg, role=args.role)
    url = registry.advertised_url(cfg)
    if url is not None:
        variables["RUNLOG_SCHEMA_REGISTRY_URL"] = url
    if args.redis_cluster:
        variables["RUNLOG_REDIS_URL"] = redis_cluster.url()
        variables["RUNLOG_REDIS_CLUSTER"] = "1"
    if args.json:
        print_json(variables)  # passwords are never in it, as in the export lines
        return EXIT_OK
    for key, value in variables.items():
        print(f"export {key}={shlex.quote(value)}")
    if cfg.secure:
        path = shlex.quote(str(secure.secrets_file(cfg, args.role)))
        print(f"# passwords of {secure.username(args.role)} are not printed; they are in {path}")
        print(f"# (mode 0600). Export them with:  set -a; . {path}; set +a")
    return 0


def _init(args: argparse.Namespace) -> int:
    cfg = _config(args)
    folder = stack.init_secure(cfg)
    print(f"certificates in {secure.tls_dir(cfg)}, passwords in {secure.secrets_dir(cfg)} (0600),")
    print(f"Redis ACL file {secure.redis_acl_path(cfg)}; for docker compose:")
    print(f"  RUNLOG_SECURE_DIR={folder} docker compose --profile secure up -d --wait")
    return 0


def _node(args: argparse.Namespace) -> int:
    cfg = _config(args)
    if args.action == "start":
        started = stack.start_node(cfg, args.node_id)
        print(f"kafka node {args.node_id} running (pid {started})")
        return 0
    sig = signal.SIGKILL if args.action == "kill" else signal.SIGTERM
    pid = stack.kill_node(cfg, args.node_id, sig=sig)
    print(
        f"kafka node {args.node_id}: " + ("was not running" if pid is None else f"pid {pid} gone")
    )
    return 0
