"""Only a decider decides: forged decisions on the secure stack are ignored by every reader.

The secure stack (``runlog stack up --secure``) makes a decider key pair for the operator
role and gives every role the public keys only. An attacker holding the *worker*
principal's credentials (a compromised agent) writes APPROVAL_DECIDED records with a raw
``confluent_kafka.Producer`` straight into another tenant's run, at the next seq and the
current epoch (so the ownership rule alone would accept them):

* unsigned, "approved by" a person's name;
* signed with a key of its own that no reader trusts;
* carrying a genuine operator signature copied from another approval.

Each is ignored by the fold (``open_run``'s state: the escalated irreversible call stays
pending and its tool is not run), by the projections (state, uncertain, audit: the audit
names each forgery), named by ``runlog verify`` (which fails) and by ``runlog show``. A real
decision by the operator (signed with its key) then works end to end.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient

import runlog
from runlog import stack
from runlog._bootstrap import Services
from runlog._settings import Settings
from runlog._topics import ensure_topics
from runlog.consumers import _queries as queries
from runlog.consumers._verify import verify_run
from runlog.consumers.runner import ProjectionRunner
from runlog.consumers.stores import PROJECTIONS
from runlog.errors import NotADecider
from runlog.log._clients import redis_client
from runlog.log._fold import read_run
from runlog.log._reader import LogReader
from runlog.producers._opening import open_run_with, submit_decision
from runlog.schemas import _codec as codec
from runlog.schemas import _models as m
from runlog.schemas._signing import DecisionSigner, generate_key_pair
from runlog.schemas._vocabulary import EventType
from runlog.stack import _secure as secure

pytestmark = pytest.mark.timeout(300)

PARTITIONS = 3
VICTIM = "tenant-b"


@pytest.fixture(scope="module")
def prefix(secure_stack: stack.StackConfig) -> Iterator[str]:
    """This module's topics, created with the roles' ACLs by the admin."""
    name = f"sd-{uuid.uuid4().hex[:8]}"
    admin = secure.role_settings(secure_stack, "admin", topic_prefix=name, partitions=PARTITIONS)
    ensure_topics(admin, acls=True).raise_for_drift()
    worker = _settings(secure_stack, "worker", name)
    probe = AdminClient(worker.kafka_common())
    for _ in range(200):  # ACLs reach the authorizer through the metadata log
        topic = probe.list_topics(timeout=5).topics.get(worker.events_topic)
        if topic is not None and topic.error is None:
            break
    yield name
    AdminClient(admin.kafka_common()).delete_topics(
        [admin.events_topic, admin.quarantine_topic], operation_timeout=10
    )


def _settings(cfg: stack.StackConfig, role: str, prefix: str) -> Settings:
    return secure.role_settings(
        cfg, role, topic_prefix=prefix, partitions=PARTITIONS, lease_ttl_ms=1000
    )


class Charge:
    """An irreversible tool whose first invocation times out after the request left."""

    def __init__(self) -> None:
        self.invocations = 0

    def tool(self) -> runlog.Tool:
        def charge(args: dict[str, Any], *, idempotency_key: str) -> str:
            self.invocations += 1
            if self.invocations == 1:
                raise TimeoutError("gateway did not answer")
            return f"charged {args['amount']}"

        return runlog.tool("charge", risk="irreversible")(charge)


def _escalated(deps: Any, charge: Charge) -> tuple[str, str]:
    """A run of the victim tenant whose irreversible call waits for a person."""
    with open_run_with(deps, None, tenant=VICTIM, tools=[charge.tool()]) as run:
        with pytest.raises(runlog.Escalated) as info:
            run.call_tool("charge", {"amount": 7})
        assert info.value.approval_id is not None
        return run.run_id, info.value.approval_id


def _state(settings: Settings, run_id: str) -> Any:
    with LogReader(settings) as reader, redis_client(settings) as client:
        return read_run(reader, client, settings, VICTIM, run_id).state


def _forge(worker: Settings, run_id: str, approval_id: str, **signed: Any) -> m.ApprovalDecided:
    """Produce a decision into ``run_id`` with a raw producer and the worker's credentials,
    at the next seq and the current epoch of the log's valid state."""
    st = _state(worker, run_id)
    payload = m.ApprovalDecided(
        approval_id=approval_id,
        approved=True,
        decided_by="Alice Example (head of payments)",
        note="forged",
        **signed,
    )
    ev = m.Event(
        event_id=uuid.uuid4().hex,
        run_id=run_id,
        tenant=VICTIM,
        seq=st.seq + 1,
        epoch=st.epoch,
        type=EventType.APPROVAL_DECIDED,
        schema_version=codec.registry().current[EventType.APPROVAL_DECIDED],
        occurred_at=datetime.now(UTC),
        writer_id="attacker",
        payload=payload,
    )
    producer = Producer({**worker.kafka_common(), "partitioner": "murmur2_random"})
    errors: list[Any] = []
    producer.produce(
        worker.events_topic,
        codec.encode(ev),
        key=run_id.encode(),
        headers=codec.headers(ev),
        on_delivery=lambda e, _m: errors.append(e),
    )
    assert producer.flush(30) == 0 and errors == [None], errors  # the broker took it
    return payload


def _cli(
    cfg: stack.StackConfig, prefix: str, *argv: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``runlog ARGV`` as the operator (``runlog stack env --secure --role operator``)."""
    import os

    child = {k: v for k, v in os.environ.items() if not k.startswith("RUNLOG_")}
    child.update(secure.client_env(cfg, "operator"))
    child.update(secure.credentials(cfg, "operator"))
    child.update(
        RUNLOG_TOPIC_PREFIX=prefix,
        RUNLOG_PARTITIONS=str(PARTITIONS),
        RUNLOG_REDIS_KEY_PREFIX=cfg.redis_key_prefix,
    )
    child.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "runlog.cli", *argv],
        env=child,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_worker_cannot_decide_an_escalated_call_only_the_operator_can(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    cfg = secure_stack
    worker, operator = _settings(cfg, "worker", prefix), _settings(cfg, "operator", prefix)
    assert worker.decider_public_keys and not worker.decider_key_file  # workers: public only
    charge = Charge()
    wsvc, osvc = Services(worker, writer_id="w"), Services(operator, writer_id="ops")
    try:
        rid, ap = _escalated(wsvc.run_deps(), charge)
        # A genuine operator decision on another run: its signature is what an attacker
        # could copy from the log.
        other_rid, other_ap = _escalated(wsvc.run_deps(), Charge())
        assert (
            submit_decision(
                osvc.run_deps(), other_rid, other_ap, approved=True, decided_by="ops", tenant=VICTIM
            )
            == "recorded"
        )
        genuine = next(
            e.payload
            for e in (r.event for r in _records(operator, other_rid))
            if isinstance(e.payload, m.ApprovalDecided)
        )
        assert genuine.signature and genuine.key_id

        # The runlog writer itself refuses a worker's decision: it holds no decider key.
        with (
            open_run_with(wsvc.run_deps(), rid, tenant=VICTIM, tools=[], recover=False) as run,
            pytest.raises(NotADecider),
        ):
            run.decide(ap, approved=True, decided_by="Alice Example")

        # Three forgeries by a raw producer with the worker's credentials.
        rogue_text, _ = generate_key_pair("operator@" + cfg.state_dir.name)  # a same-named key
        from cryptography.hazmat.primitives import serialization

        rogue_key = serialization.load_pem_private_key(rogue_text.encode(), password=None)
        rogue = DecisionSigner("operator@" + cfg.state_dir.name, rogue_key)  # type: ignore[arg-type]
        at = datetime.now(UTC).isoformat()
        forged_sig = rogue.sign_decision(
            run_id=rid,
            tenant=VICTIM,
            approval_id=ap,
            approved=True,
            decided_by="Alice Example (head of payments)",
            note="forged",
            decided_at=at,
        )
        _forge(worker, rid, ap)
        _forge(worker, rid, ap, **forged_sig.fields())
        _forge(
            worker,
            rid,
            ap,
            decided_at=genuine.decided_at,
            key_id=genuine.key_id,
            signature=genuine.signature,
        )

        # The fold, as every reader folds it: the call still waits for a person.
        st = _state(worker, rid)
        assert st.approvals[ap].approved is None and ap in st.pending_approvals
        (call,) = st.open_calls.values()
        assert call.status == "escalated" and call.decision is None
        assert st.fenced_writes == 3
        # open_run's state: recovery does not run the tool.
        with (
            open_run_with(wsvc.run_deps(), rid, tenant=VICTIM, tools=[charge.tool()]) as run,
            pytest.raises(runlog.Escalated),
        ):
            assert run.state.approvals[ap].approved is None
            run.call_tool("charge", {"amount": 7})
        assert charge.invocations == 1

        # The projections, as the projection service folds them.
        projections = _settings(cfg, "projections", prefix)
        with redis_client(projections) as pclient:
            ProjectionRunner(projections, pclient, PROJECTIONS).catch_up(timeout_s=60)
        with redis_client(operator) as oclient:
            view = queries.get_state(oclient, operator, rid, tenant=VICTIM)
            assert view is not None
            assert view["state"]["approvals"][ap]["approved"] is None
            assert view["state"]["fenced_writes"] == 3
            audit = queries.get_audit(oclient, operator, rid, tenant=VICTIM)
            queue = queries.uncertain_report(oclient, operator)
        (waiting,) = [c for c in queue.open if c["run_id"] == rid]
        assert waiting["status"] == "escalated"  # still waiting for a person
        forged = [e for e in audit if e["kind"] == "forged_decision"]
        assert len(forged) == 3 and all(e["approval_id"] == ap for e in forged)
        assert [e["text"].split(" (")[1] for e in forged] == [
            "unsigned)",
            f"bad signature for key {rogue.key_id!r})",
            f"bad signature for key {genuine.key_id!r})",
        ]
        assert not [e for e in audit if e["kind"] == "approval_decided"]

        # runlog verify names them and fails; runlog show tells them.
        report = verify_run(operator, redis_client(operator), rid, tenant=VICTIM)
        assert not report.ok
        (decisions,) = [c for c in report.checks if c.name == "decisions"]
        assert not decisions.ok and decisions.counts == {"forged": 3}
        assert decisions.detail.count("not signed by a decider") == 3
        done = _cli(cfg, prefix, "verify", rid, "--tenant", VICTIM)
        assert done.returncode != 0 and "not signed by a decider" in done.stdout, done
        shown = _cli(cfg, prefix, "show", rid, "--tenant", VICTIM)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.count("FORGED DECISION") == 3, shown.stdout

        # The operator's real decision (`runlog approve`, signed with its key) works end to
        # end: the worker's next open_run retries the call with the same key, once.
        keyless = _cli(
            cfg,
            prefix,
            *("approve", rid, ap, "--tenant", VICTIM, "--by", "ops"),
            env={"RUNLOG_DECIDER_KEY_FILE": ""},  # the operator's env without its key
        )
        assert keyless.returncode == 1 and "not signed by a decider" in keyless.stderr, keyless
        approved = _cli(cfg, prefix, "approve", rid, ap, "--tenant", VICTIM, "--by", "ops")
        assert approved.returncode == 0 and "recorded" in approved.stdout, approved.stderr
        with open_run_with(wsvc.run_deps(), rid, tenant=VICTIM, tools=[charge.tool()]) as run:
            assert run.call_tool("charge", {"amount": 7}) == "charged 7"
        assert charge.invocations == 2  # the retry with the same key ran, once
        st = _state(worker, rid)
        assert st.approvals[ap].approved is True and st.approvals[ap].key_id == genuine.key_id
        assert not st.open_calls
        shown = _cli(cfg, prefix, "show", rid, "--tenant", VICTIM)
        assert f"approved by ops (signed by decider key {genuine.key_id})" in shown.stdout
        report = verify_run(operator, redis_client(operator), rid, tenant=VICTIM)
        (decisions,) = [c for c in report.checks if c.name == "decisions"]
        assert decisions.counts == {"forged": 3, "signed": 1}
        other = verify_run(operator, redis_client(operator), other_rid, tenant=VICTIM)
        assert other.ok, other.text()
    finally:
        wsvc.close()
        osvc.close()


def test_a_queued_decision_carries_the_deciders_signature_through_the_worker(
    secure_stack: stack.StackConfig, prefix: str
) -> None:
    """The worker that owns the run records the decision from its inbox with the signature
    the operator made: it never signs, and the decision counts."""
    cfg = secure_stack
    worker, operator = _settings(cfg, "worker", prefix), _settings(cfg, "operator", prefix)
    charge = Charge()
    wsvc, osvc = Services(worker, writer_id="w"), Services(operator, writer_id="ops")
    try:
        rid, ap = _escalated(wsvc.run_deps(), charge)
        with open_run_with(wsvc.run_deps(), rid, tenant=VICTIM, tools=[charge.tool()]) as run:
            got = submit_decision(
                osvc.run_deps(), rid, ap, approved=True, decided_by="ops", tenant=VICTIM, wait_s=0
            )
            assert got == "queued"
            assert run.poll_decisions() == 1
            assert run.call_tool("charge", {"amount": 7}) == "charged 7"
        decided = [
            r.event for r in _records(worker, rid) if r.event.type is EventType.APPROVAL_DECIDED
        ]
        (ev,) = decided
        assert ev.writer_id == "w"  # appended by the worker...
        assert isinstance(ev.payload, m.ApprovalDecided)
        assert ev.payload.key_id == secure.decider_key_id(cfg, "operator")  # ...signed by ops
        assert verify_run(operator, redis_client(operator), rid, tenant=VICTIM).ok
    finally:
        wsvc.close()
        osvc.close()


def _records(settings: Settings, run_id: str) -> list[Any]:
    with LogReader(settings) as reader, redis_client(settings) as client:
        return read_run(reader, client, settings, VICTIM, run_id, keep=True).folded.kept


def test_the_stack_gives_the_private_key_to_the_operator_only(
    secure_stack: stack.StackConfig,
) -> None:
    for role in secure.ALL_ROLES:
        env = secure.client_env(secure_stack, role)
        assert env["RUNLOG_DECIDER_PUBLIC_KEYS"] == str(secure.decider_public_keys(secure_stack))
        assert ("RUNLOG_DECIDER_KEY_FILE" in env) == (role == "operator"), role
    key = secure.decider_key_file(secure_stack, "operator")
    assert key.stat().st_mode & 0o077 == 0
    public = secure.decider_public_keys(secure_stack).read_text()
    assert "PRIVATE" not in public and base64.b64decode(public.split()[-1])
    assert json.dumps(secure.client_env(secure_stack, "worker")).count("decider.key") == 0


# ------------------------------------------------------------------ tenants' writers apart


def _tenant_files(tmp: Any) -> dict[str, Any]:
    """Per-tenant MAC keys: each tenant's workers get their own line, readers every line."""
    import os

    lines = {t: f"{t} {t}-1 {base64.b64encode(os.urandom(32)).decode()}\n" for t in ("a", "b")}
    out = {}
    for name, text in (("a", lines["a"]), ("b", lines["b"]), ("readers", "".join(lines.values()))):
        path = tmp / f"tenant-keys-{name}"
        path.write_text(text)
        path.chmod(0o600)
        out[name] = path
    return out


def test_a_worker_of_tenant_a_cannot_write_into_a_run_of_tenant_b(
    secure_stack: stack.StackConfig, prefix: str, tmp_path: Any
) -> None:
    cfg = secure_stack
    files = _tenant_files(tmp_path)

    def as_(role: str, keys: str) -> Settings:
        return _settings(cfg, role, prefix).model_copy(update={"tenant_keys": str(files[keys])})

    worker_a, worker_b = as_("worker", "a"), as_("worker", "b")
    operator, projections = as_("operator", "readers"), as_("projections", "readers")
    bsvc, asvc = Services(worker_b, writer_id="wb"), Services(worker_a, writer_id="wa")
    try:
        with open_run_with(bsvc.run_deps(), None, tenant="b", tools=[]) as run:
            rid = run.run_id
            run.append(EventType.USER_MESSAGE, content="tenant b's own work")
        with open_run_with(asvc.run_deps(), None, tenant="a", tools=[]) as own:
            own.append(EventType.USER_MESSAGE, content="tenant a's own work")
            a_rid = own.run_id

        # The attacker: worker A's Kafka credentials (the broker lets it write the topic)
        # and A's MAC key; it claims tenant B and B's run at the next seq, current epoch.
        with LogReader(operator) as reader, redis_client(operator) as client:
            st = read_run(reader, client, operator, "b", rid).state
        assert st.status == "running" and st.seq == 2 and st.fenced_writes == 0
        from runlog.log._authority import tenant_keys_for

        a_keys = tenant_keys_for(worker_a)
        producer = Producer({**worker_a.kafka_common(), "partitioner": "murmur2_random"})
        for mac_with_a in (False, True):
            ev = m.Event(
                event_id=uuid.uuid4().hex,
                run_id=rid,
                tenant="b",
                seq=st.seq + 1,
                epoch=st.epoch,
                type=EventType.RUN_FINISHED,
                schema_version=codec.registry().current[EventType.RUN_FINISHED],
                occurred_at=datetime.now(UTC),
                writer_id="attacker-of-a",
                payload=m.RunFinished(outcome="cancelled", summary="forged by tenant a"),
            )
            value = codec.encode(ev)
            headers = codec.headers(ev)
            if mac_with_a:  # A's valid MAC, presented as if it were B's
                mac = a_keys.header("a", rid.encode(), value)
                assert mac is not None
                headers.append(mac)
            producer.produce(worker_a.events_topic, value, key=rid.encode(), headers=headers)
        assert producer.flush(30) == 0

        # Every reader: the fold (the operator's read, and worker B's open_run)...
        with LogReader(operator) as reader, redis_client(operator) as client:
            st = read_run(reader, client, operator, "b", rid).state
        assert st.status == "running" and st.fenced_writes == 2 and st.outcome is None
        with open_run_with(bsvc.run_deps(), rid, tenant="b", tools=[]) as run:
            assert run.state.status == "running"
            run.append(EventType.USER_MESSAGE, content="still mine")
        # ...the projections...
        with redis_client(projections) as pclient:
            ProjectionRunner(projections, pclient, PROJECTIONS).catch_up(timeout_s=60)
        with redis_client(operator) as oclient:
            view = queries.get_state(oclient, operator, rid, tenant="b")
            assert view is not None and view["state"]["status"] == "running"
            audit = queries.get_audit(oclient, operator, rid, tenant="b")
        assert [e["kind"] for e in audit].count("forged_tenant_record") == 2
        # ...verify (fails, naming both) and show.
        report = verify_run(operator, redis_client(operator), rid, tenant="b")
        (tenants,) = [c for c in report.checks if c.name == "tenants"]
        assert not report.ok and tenants.counts == {"forged_tenant": 2}
        assert "no MAC of tenant 'b'" in tenants.detail
        assert "key 'a-1' is not one of tenant 'b'" in tenants.detail
        assert all(c.ok for c in report.checks if c.name != "tenants"), report.text()
        env_keys = {"RUNLOG_TENANT_KEYS": str(files["readers"])}
        shown = _cli(cfg, prefix, "show", rid, "--tenant", "b", env=env_keys)
        assert shown.stdout.count("FORGED run_finished") == 2, shown.stdout + shown.stderr
        # Tenant A's own run is authentic for every reader.
        assert verify_run(operator, redis_client(operator), a_rid, tenant="a").ok
    finally:
        asvc.close()
        bsvc.close()
