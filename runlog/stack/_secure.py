"""The secure variant of the local stack (``runlog stack up --secure``).

Kafka: clients connect to a ``SASL_SSL`` listener (TLS, SASL/SCRAM-SHA-512); the broker
talks to itself and to its controller over mutual-TLS listeners (``INTERNAL``,
``CONTROLLER``) as ``User:runlog-broker``, the CN of its certificate. The KRaft
``StandardAuthorizer`` denies everything no ACL allows (``allow.everyone.if.no.acl.found=
false``); ``User:runlog-admin`` and the broker are super users. The SCRAM credentials of
every role are written into the metadata when the storage is formatted (``--add-scram``),
so the broker never runs a moment without them.

Redis: TLS only (``port 0``, ``tls-port``), ACL users from an ACL file that stores SHA-256
hashes of the passwords, the ``default`` user switched off.

Everything is made at the first start and kept in the state dir (never in the source
tree): ``tls/`` (a local CA, the broker's and Redis' keys and certificates; keys 0600) and
``secrets/<role>.env`` (0600, in a 0700 directory): the role's Kafka and Redis passwords as
``RUNLOG_SASL_PASSWORD=...`` / ``RUNLOG_REDIS_PASSWORD=...`` lines, for
``set -a; . FILE; set +a``. ``runlog stack env --secure`` prints everything else.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import shutil
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from runlog._security import ROLES, redis_acl_rules
from runlog._settings import Settings
from runlog.errors import StackError
from runlog.schemas._signing import DecisionSigner, generate_key_pair, load_signer

if TYPE_CHECKING:  # the stack package imports this module: no cycle at run time
    from runlog.stack._config import NodeSpec, StackConfig

__all__ = [
    "ALL_ROLES",
    "BROKER_PRINCIPAL",
    "SCRAM_MECHANISM",
    "admin_kafka_conf",
    "admin_redis_kwargs",
    "client_env",
    "credentials",
    "decider_key_file",
    "decider_key_id",
    "decider_public_keys",
    "ensure_material",
    "issue_cert",
    "kafka_properties",
    "make_ca",
    "redis_acl_file",
    "redis_conf_lines",
    "role_settings",
    "scram_format_args",
    "secrets_file",
    "username",
]

SCRAM_MECHANISM = "SCRAM-SHA-512"
BROKER_CN = "runlog-broker"
BROKER_PRINCIPAL = f"User:{BROKER_CN}"
ALL_ROLES = ("admin", *ROLES)
"""Every principal the secure stack creates: the admin (super user) and the four roles."""

# Roles without a Redis user: analytics readers never touch Redis.
_NO_REDIS = frozenset({"analytics"})


def username(role: str) -> str:
    """The Kafka SCRAM user and Redis ACL user of ``role``: ``runlog-<role>``."""
    if role not in ALL_ROLES:
        raise StackError(f"unknown role {role!r}; roles: {', '.join(ALL_ROLES)}")
    return f"runlog-{role}"


def tls_dir(cfg: StackConfig) -> Path:
    return cfg.state_dir / "tls"


def secrets_dir(cfg: StackConfig) -> Path:
    return cfg.state_dir / "secrets"


def secrets_file(cfg: StackConfig, role: str) -> Path:
    username(role)  # validates the role
    return secrets_dir(cfg) / f"{role}.env"


def ca_file(cfg: StackConfig) -> Path:
    return tls_dir(cfg) / "ca.pem"


# --------------------------------------------------------------------------- material


def _openssl() -> str:
    found = shutil.which("openssl")
    if found is None:
        raise StackError(
            "no `openssl` on PATH: the secure stack makes its certificates with it "
            "(`apt-get install -y openssl`)"
        )
    return found


def _run(argv: list[str], cwd: Path) -> None:
    proc = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=60, check=False)
    if proc.returncode != 0:
        raise StackError(
            f"{' '.join(argv[:3])} ... failed (exit {proc.returncode}):\n{proc.stderr}"
        )


def _private(path: Path) -> None:
    os.chmod(path, 0o600)


def issue_cert(openssl: str, work: Path, name: str, cn: str) -> None:
    """``work/<name>.key`` (P-256, PKCS#8: what Kafka's PEM keystore reads) and
    ``work/<name>.pem``, signed by the CA in ``work`` (see :func:`make_ca`).

    The SAN names 127.0.0.1 and localhost: librdkafka, redis-py and Java verify the host.
    Both server and client use: the broker presents its certificate to its controller.
    """
    ext = work / f"{name}.ext"
    ext.write_text(
        "basicConstraints=CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\n"
        "extendedKeyUsage=serverAuth,clientAuth\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
    )
    _run(
        [
            openssl, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}",
        ],
        work,
    )  # fmt: skip
    _private(work / f"{name}.key")
    _run(
        [
            openssl, "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-set_serial", str(int.from_bytes(os.urandom(8), "big")), "-days", "825",
            "-out", f"{name}.pem", "-extfile", ext.name,
        ],
        work,
    )  # fmt: skip
    (work / f"{name}.csr").unlink()
    ext.unlink()


def make_ca(openssl: str, work: Path, cn: str = "runlog local CA") -> None:
    """A self-signed CA in ``work`` (``ca.key``, ``ca.pem``); also used by tests for a rogue CA."""
    work.mkdir(parents=True, exist_ok=True)
    _run(
        [
            openssl, "req", "-x509", "-new", "-newkey", "ec",
            "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "ca.key",
            "-out", "ca.pem", "-days", "3650", "-subj", f"/CN={cn}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        ],
        work,
    )  # fmt: skip
    _private(work / "ca.key")


def _ensure_tls(cfg: StackConfig) -> None:
    target = tls_dir(cfg)
    if (target / "broker-keystore.pem").is_file() and (target / "redis.pem").is_file():
        return
    openssl = _openssl()
    work = cfg.state_dir / f".tls-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, mode=0o700)
    try:
        make_ca(openssl, work)
        issue_cert(openssl, work, "broker", BROKER_CN)
        issue_cert(openssl, work, "redis", "runlog-redis")
        # Kafka's PEM keystore: the private key and its certificate in one file.
        keystore = work / "broker-keystore.pem"
        keystore.write_text((work / "broker.key").read_text() + (work / "broker.pem").read_text())
        _private(keystore)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(work, target)
        os.chmod(target, 0o700)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _write_private(path: Path, text: str) -> None:
    """Create ``path`` readable by its owner only, before any secret is in it."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def _ensure_credentials(cfg: StackConfig) -> None:
    folder = secrets_dir(cfg)
    missing = [r for r in ALL_ROLES if not secrets_file(cfg, r).is_file()]
    if not missing:
        return
    formatted = any((n.data_dir / "meta.properties").is_file() for n in cfg.nodes())
    if formatted:
        # SCRAM credentials live in the formatted metadata; new passwords would not match.
        raise StackError(
            f"{folder} lacks {', '.join(f'{r}.env' for r in missing)} but Kafka's storage in "
            f"{cfg.kafka_dir} was formatted with the old credentials: stop the stack and "
            f"delete {cfg.state_dir} to start over"
        )
    folder.mkdir(parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    # URL-safe passwords: the --add-scram syntax ([name=..,password=..]) and the env files
    # take them unquoted.
    for role in missing:
        lines = [
            f"# runlog secure stack: passwords of role {role} (Kafka SASL/SCRAM and Redis ACL "
            f"user {username(role)}).",
            "# Export with: set -a; . THIS_FILE; set +a   Never commit or print this file.",
            f"RUNLOG_SASL_PASSWORD={secrets.token_urlsafe(24)}",
        ]
        if role not in _NO_REDIS:
            lines.append(f"RUNLOG_REDIS_PASSWORD={secrets.token_urlsafe(24)}")
        _write_private(secrets_file(cfg, role), "\n".join(lines) + "\n")


DECIDER_ROLES = ("operator",)
"""Roles that decide approvals: they hold a decider's private key. Every role holds the
public keys (readers check decisions with them); workers never hold a private key."""


def decider_key_file(cfg: StackConfig, role: str) -> Path:
    return secrets_dir(cfg) / f"{role}-decider.key"


def decider_key_id(cfg: StackConfig, role: str) -> str:
    """The name of ``role``'s decider key (what a signed decision's ``key_id`` says)."""
    return f"{role}@{cfg.state_dir.name}"


def decider_public_keys(cfg: StackConfig) -> Path:
    """The trusted deciders' public keys (not secret: readable by every role's process)."""
    return cfg.state_dir / "deciders.pub"


def _ensure_deciders(cfg: StackConfig) -> None:
    """A decider key pair per deciding role: private key 0600 in ``secrets/``, public key
    in ``deciders.pub``. Made once; a missing public file is rebuilt from the keys."""
    lines: list[str] = []
    for role in DECIDER_ROLES:
        path = decider_key_file(cfg, role)
        if not path.is_file():
            private, _ = generate_key_pair(decider_key_id(cfg, role))
            _write_private(path, private)
        signer: DecisionSigner = load_signer(path)
        lines.append(f"{signer.key_id} {base64.b64encode(signer.public_bytes()).decode()}")
    text = "# runlog secure stack: trusted deciders (NAME BASE64-ED25519-PUBLIC-KEY)\n"
    text += "\n".join(lines) + "\n"
    pub = decider_public_keys(cfg)
    if not pub.is_file() or pub.read_text() != text:
        pub.write_text(text)
        os.chmod(pub, 0o644)


def ensure_material(cfg: StackConfig) -> None:
    """Certificates, credentials and decider keys, made once (the first ``up --secure``)."""
    cfg.state_dir.mkdir(parents=True, exist_ok=True)
    _ensure_tls(cfg)
    _ensure_credentials(cfg)
    _ensure_deciders(cfg)


def credentials(cfg: StackConfig, role: str) -> dict[str, str]:
    """The role's passwords: ``RUNLOG_SASL_PASSWORD``, ``RUNLOG_REDIS_PASSWORD`` (not analytics)."""
    path = secrets_file(cfg, role)
    try:
        text = path.read_text()
    except OSError as exc:
        raise StackError(
            f"no credentials for role {role} ({path}): run `runlog stack up --secure`"
        ) from exc
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip()
    return out


# --------------------------------------------------------------------------- clients


def client_env(cfg: StackConfig, role: str) -> dict[str, str]:
    """``RUNLOG_*`` variables a client of ``role`` needs, passwords excepted."""
    user = username(role)
    out = {
        "RUNLOG_BOOTSTRAP_SERVERS": cfg.bootstrap_servers,
        "RUNLOG_SECURITY_PROTOCOL": "SASL_SSL",
        "RUNLOG_SASL_MECHANISM": SCRAM_MECHANISM,
        "RUNLOG_SASL_USERNAME": user,
        "RUNLOG_SSL_CA_LOCATION": str(ca_file(cfg)),
        "RUNLOG_REDIS_URL": cfg.redis_url,
        "RUNLOG_REDIS_SSL_CA": str(ca_file(cfg)),
    }
    if role not in _NO_REDIS:
        out["RUNLOG_REDIS_USERNAME"] = user
    out["RUNLOG_DECIDER_PUBLIC_KEYS"] = str(decider_public_keys(cfg))
    if role in DECIDER_ROLES:
        out["RUNLOG_DECIDER_KEY_FILE"] = str(decider_key_file(cfg, role))
    return out


def role_settings(cfg: StackConfig, role: str, **update: Any) -> Settings:
    """``Settings`` of a client of ``role`` on this stack, passwords included.

    ``update`` sets other fields (topic prefix, partitions...). For programs and tests;
    a shell gets the same from ``runlog stack env --secure --role ROLE`` and the role's file.
    """
    creds = credentials(cfg, role)
    redis_password = creds.get("RUNLOG_REDIS_PASSWORD")
    fields: dict[str, Any] = {
        "bootstrap_servers": cfg.bootstrap_servers,
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": SCRAM_MECHANISM,
        "sasl_username": username(role),
        "sasl_password": SecretStr(creds["RUNLOG_SASL_PASSWORD"]),
        "ssl_ca_location": str(ca_file(cfg)),
        "redis_url": cfg.redis_url,
        "redis_ssl_ca": str(ca_file(cfg)),
        "redis_username": None if role in _NO_REDIS else username(role),
        "redis_password": SecretStr(redis_password) if redis_password else None,
        "redis_key_prefix": cfg.redis_key_prefix,
        "decider_public_keys": str(decider_public_keys(cfg)),
        "decider_key_file": str(decider_key_file(cfg, role)) if role in DECIDER_ROLES else None,
    }
    fields.update(update)
    return Settings(**fields)


def admin_kafka_conf(cfg: StackConfig) -> dict[str, Any]:
    """librdkafka properties of the admin (for the stack's readiness check)."""
    return {
        "bootstrap.servers": cfg.bootstrap_servers,
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": SCRAM_MECHANISM,
        "sasl.username": username("admin"),
        "sasl.password": credentials(cfg, "admin")["RUNLOG_SASL_PASSWORD"],
        "ssl.ca.location": str(ca_file(cfg)),
    }


def admin_redis_kwargs(cfg: StackConfig) -> dict[str, Any]:
    """redis-py keyword arguments of the Redis admin user (readiness check, fault tools)."""
    return {
        "username": username("admin"),
        "password": credentials(cfg, "admin")["RUNLOG_REDIS_PASSWORD"],
        "ssl_ca_certs": str(ca_file(cfg)),
    }


# --------------------------------------------------------------------------- Kafka


def kafka_properties(cfg: StackConfig, node: NodeSpec) -> dict[str, str]:
    """What the secure stack adds to (and replaces in) a node's ``server.properties``."""
    tls = tls_dir(cfg)
    host = "127.0.0.1"
    return {
        "listeners": (
            f"SASL_SSL://{host}:{node.kafka_port},INTERNAL://{host}:{node.internal_port},"
            f"CONTROLLER://{host}:{node.controller_port}"
        ),
        "advertised.listeners": (
            f"SASL_SSL://{host}:{node.kafka_port},INTERNAL://{host}:{node.internal_port}"
        ),
        "listener.security.protocol.map": "SASL_SSL:SASL_SSL,INTERNAL:SSL,CONTROLLER:SSL",
        "inter.broker.listener.name": "INTERNAL",
        # Clients: TLS + SCRAM. The broker itself: mutual TLS, no password anywhere.
        "sasl.enabled.mechanisms": SCRAM_MECHANISM,
        "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config": (
            "org.apache.kafka.common.security.scram.ScramLoginModule required;"
        ),
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(tls / "broker-keystore.pem"),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(tls / "ca.pem"),
        "listener.name.internal.ssl.client.auth": "required",
        "listener.name.controller.ssl.client.auth": "required",
        # A certificate's principal is its CN (User:runlog-broker), not the whole DN.
        "ssl.principal.mapping.rules": "RULE:^CN=([a-zA-Z0-9._-]*).*$/$1/,DEFAULT",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found": "false",
        "super.users": f"User:{username('admin')};{BROKER_PRINCIPAL}",
    }


def scram_format_args(cfg: StackConfig) -> list[str]:
    """``--add-scram`` arguments of ``StorageTool format``: every role's SCRAM credential.

    The passwords are on that short-lived command line only; the metadata keeps a salted
    hash (SCRAM), and the broker's config holds no password at all.
    """
    args: list[str] = []
    for role in ALL_ROLES:
        password = credentials(cfg, role)["RUNLOG_SASL_PASSWORD"]
        args += ["--add-scram", f"{SCRAM_MECHANISM}=[name={username(role)},password={password}]"]
    return args


# --------------------------------------------------------------------------- Redis


def redis_acl_path(cfg: StackConfig) -> Path:
    return cfg.redis_dir / "users.acl"


def redis_acl_file(cfg: StackConfig, key_prefix: str) -> str:
    """The ACL file: SHA-256 of each password (``#<hex>``), never the password itself."""
    rules = redis_acl_rules(key_prefix)
    # Nobody can log in as `default` (off), but Redis 7.0 replays the append-only file as
    # that user and checks its permissions on every EXEC: a default user without them made
    # Redis drop every MULTI/EXEC (projection writes, lease scripts' effects) on restart.
    lines = ["user default off nopass ~* &* +@all"]
    for role, rule in rules.items():
        password = credentials(cfg, role)["RUNLOG_REDIS_PASSWORD"]
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(f"user {username(role)} on #{digest} {rule}")
    return "\n".join(lines) + "\n"


def redis_conf_lines(cfg: StackConfig) -> list[str]:
    """Listener lines of the secure Redis: TLS only, users from the ACL file."""
    tls = tls_dir(cfg)
    return [
        "port 0",
        f"tls-port {cfg.redis_port}",
        f"tls-cert-file {tls / 'redis.pem'}",
        f"tls-key-file {tls / 'redis.key'}",
        f"tls-ca-cert-file {tls / 'ca.pem'}",
        # Clients prove who they are with an ACL user and password, not a certificate.
        "tls-auth-clients no",
        f"aclfile {redis_acl_path(cfg)}",
        # In the config so that `up` with another RUNLOG_REDIS_KEY_PREFIX sees the change.
        f"# ACL users are limited to keys under {cfg.redis_key_prefix}:",
    ]


def write_redis_acl(cfg: StackConfig) -> None:
    cfg.redis_dir.mkdir(parents=True, exist_ok=True)
    _write_private(redis_acl_path(cfg), redis_acl_file(cfg, cfg.redis_key_prefix))
