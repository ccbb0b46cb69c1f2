"""The console's pages: Jinja2 templates kept in code, autoescaped, no build step.

Each page puts what changes in ``<main id="live">``. ``console.js`` (the only script, served
from this origin) refetches that part every few seconds, unless someone is typing in it,
so the lists and a run's timeline follow the log without a manual reload.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from jinja2 import DictLoader, Environment, select_autoescape

CONSOLE_JS = """\
(function () {
  var main = document.getElementById("live");
  if (!main) return;
  var every = Number(main.getAttribute("data-refresh") || 0) * 1000;
  if (!every) return;
  function busy() {
    var a = document.activeElement;
    if (a && main.contains(a) && (a.tagName === "INPUT" || a.tagName === "TEXTAREA")) return true;
    var fields = main.querySelectorAll("input[type=text], textarea");
    for (var i = 0; i < fields.length; i++) { if (fields[i].value) return true; }
    return false;
  }
  setInterval(function () {
    if (busy()) return;
    fetch(location.href, {headers: {"X-Fragment": "1"}, credentials: "same-origin"})
      .then(function (r) { return r.ok ? r.text() : undefined; })
      .then(function (t) { if (t !== undefined && !busy()) main.innerHTML = t; })
      .catch(function () {});
  }, every);
})();
"""

_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;color:#1b1f24;background:#f6f7f9}
header{background:#1f2937;color:#fff;padding:8px 16px;display:flex;gap:18px;align-items:center}
header a{color:#e5e7eb;text-decoration:none}header a:hover{color:#fff}
header .who{margin-left:auto;color:#9ca3af;font-size:12px}
header form{margin:0}header button{font-size:12px}
main{padding:12px 16px}h1{font-size:18px;margin:6px 0 12px}h2{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;background:#fff;width:100%;font-size:13px}
th,td{border-bottom:1px solid #e5e7eb;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f4f6;font-weight:600}td.num{text-align:right;font-variant-numeric:tabular-nums}
code,.mono{font-family:ui-monospace,monospace;font-size:12px}
.st{padding:1px 6px;border-radius:8px;font-size:12px;color:#fff;white-space:nowrap}
.st-running{background:#2563eb}.st-waiting{background:#d97706}.st-uncertain{background:#9333ea}
.st-stopped{background:#dc2626}.st-finished{background:#059669}
.st-orphaned{background:#6b7280}.st-cancelling{background:#b45309}.st-failed{background:#dc2626}
.st-cancelled{background:#4b5563}.st-terminated{background:#7f1d1d}
tr.fenced td{color:#9ca3af;text-decoration:line-through}tr.fenced td.why{text-decoration:none;color:#dc2626}
tr.superseded td{color:#9ca3af}
.overdue{color:#dc2626;font-weight:600}.muted{color:#6b7280}
.card{background:#fff;border:1px solid #e5e7eb;border-radius:6px;padding:8px 12px;margin:8px 0}
.counts span{margin-right:14px}.flash{background:#ecfdf5;border:1px solid #a7f3d0;padding:6px 10px}
form.decide{display:flex;gap:6px;align-items:center;margin:4px 0}
form.decide input[type=text]{width:260px}
"""

_BASE = (
    """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{% block title %}runlog{% endblock %} - runlog console</title>
<style>"""
    + _CSS
    + """</style>
<script src="/static/console.js" defer></script></head>
<body>
{% if grant %}<header><strong>runlog</strong>
<a href="/">Runs</a><a href="/approvals">Approvals</a><a href="/uncertain">Uncertain calls</a>
<a href="/lag">Projection lag</a>
<span class="who">{{ grant.name }} &middot; tenants: {{ tenants_label }}</span>
<form method="post" action="/logout"><input type="hidden" name="csrf" value="{{ csrf }}">
<button type="submit">Log out</button></form></header>{% endif %}
<main id="live" data-refresh="{{ refresh_s }}">{% block content %}{% endblock %}</main>
</body></html>
"""
)

_LOGIN = """{% extends "base.html" %}{% block title %}Log in{% endblock %}
{% block content %}<h1>runlog console</h1>
{% if error %}<p class="overdue">{{ error }}</p>{% endif %}
<form method="post" action="/login" class="card">
<label>Access token <input type="password" name="token" id="token" autocomplete="off"></label>
<button type="submit" id="login">Log in</button></form>
<p class="muted">Tokens are configured in RUNLOG_UI_TOKENS; each names the tenants it may see.</p>
{% endblock %}"""

_RUNS = """{% extends "base.html" %}{% block title %}Runs{% endblock %}
{% block content %}<h1>Runs</h1>
<div class="counts">{% for s, n in counts.items() %}<span><span class="st st-{{ s }}">{{ s }}</span>
{{ n }}</span>{% endfor %}</div>
<form method="get" action="/" class="card">
<label>Tenant <select name="tenant"><option value="">all visible</option>
{% for t in tenants %}<option value="{{ t }}" {% if t == tenant %}selected{% endif %}>{{ t }}</option>
{% endfor %}</select></label>
<label>Status <select name="status"><option value="">any</option>
{% for s in statuses %}<option value="{{ s }}" {% if s == status %}selected{% endif %}>{{ s }}</option>
{% endfor %}</select></label>
<label>Since <input name="since" value="{{ since }}" placeholder="15m, 2h or ISO time" size="16">
</label><button type="submit">Filter</button></form>
{% if asked %}<h2>Start requests the run index does not hold yet</h2>
<table id="requested"><thead><tr><th>Tenant</th><th>Run</th><th>Agent</th><th>Status</th>
<th>Requested by</th></tr></thead><tbody>
{% for r in asked %}<tr data-run="{{ r.run_id }}" class="{{ '' if r.served_by else 'overdue' }}">
<td>{{ r.tenant }}</td><td><a class="mono" href="/runs/{{ r.run_id }}">{{ r.run_id }}</a></td>
<td>{{ r.agent }}</td><td class="requested-status">{{ r.text() }}</td>
<td>{{ r.requested_by or "" }}</td></tr>{% endfor %}</tbody></table>{% endif %}
<table id="runs"><thead><tr><th>Tenant</th><th>Run</th><th>Status</th><th>Outcome</th>
<th>Seq</th><th>Epoch</th><th>Resumed</th><th>Age</th><th>Last event</th></tr></thead><tbody>
{% for r in rows %}<tr data-run="{{ r.run_id }}"><td>{{ r.tenant }}</td>
<td><a class="mono" href="/runs/{{ r.run_id }}">{{ r.run_id }}</a></td>
<td><span class="st st-{{ r.status }}">{{ r.status }}</span>
{% if r.pending_approvals %}<span class="muted">{{ r.pending_approvals }} approval(s)</span>{% endif %}
{% if r.uncertain_calls %}<span class="muted">{{ r.uncertain_calls }} uncertain</span>{% endif %}</td>
<td>{{ r.outcome or "" }}</td><td class="num">{{ r.seq }}</td><td class="num">{{ r.epoch }}</td>
<td class="num">{{ r.resumptions }}</td><td class="num">{{ ages[r.run_id] }}</td>
<td>{{ r.last_type }} <span class="muted">{{ lasts[r.run_id] }} ago</span></td></tr>
{% else %}<tr><td colspan="9" class="muted">No runs in the index for this filter (the index is
kept by <code>runlog project state</code>).</td></tr>{% endfor %}</tbody></table>
{% if next_url %}<p><a href="{{ next_url }}" id="next">Next page</a></p>{% endif %}
{% endblock %}"""

_DECIDE = """<form class="decide" method="post"
 action="/runs/{{ run_id }}/approvals/{{ a.approval_id }}">
<input type="hidden" name="csrf" value="{{ csrf }}"><input type="hidden" name="next" value="{{ next }}">
<input type="text" name="note" placeholder="why (recorded with your name)" maxlength="2000">
<button type="submit" name="decision" value="approve" class="approve">Approve</button>
<button type="submit" name="decision" value="reject" class="reject">Reject</button>
{% if q is defined and q.undoable and not q.decided %}<button type="submit" name="decision"
 value="undo_and_retry" class="undo" id="undo-and-retry">Undo and retry</button>{% endif %}</form>"""

_RUN = (
    """{% extends "base.html" %}{% block title %}Run {{ run_id }}{% endblock %}
{% block content %}<h1>Run <span class="mono">{{ run_id }}</span>
<span class="st st-{{ status }}" id="status">{{ status }}</span></h1>
{% if flash %}<p class="flash">{{ flash }}</p>{% endif %}
<p class="card" id="status-detail">{{ told.text() }}</p>
{% if st.erased %}<p class="card overdue" id="erased">Content erased by <b>{{ st.erased.erased_by }}</b>
at {{ st.erased.erased_at.isoformat() }} (seq {{ st.erased.erased_seq }}): {{ st.erased.reason }}
<br><span class="muted">subject {{ st.erased.subject }}; {{ st.erased.key_ids|length }} key(s)
destroyed; what users said, model text, tool arguments and results read as erased</span></p>{% endif %}
{% if st.cancel %}<p class="card" id="cancel-request">Cancel requested by <b>{{ st.cancel.requested_by }}</b>
at {{ st.cancel.requested_at.isoformat() }} (seq {{ st.cancel.requested_seq }}): {{ st.cancel.reason }}</p>{% endif %}
{% if not told.ended %}<div class="card" id="stop">
<a href="/runs/{{ run_id }}/stop/cancel" id="cancel-run">Cancel this run&hellip;</a> &middot;
<a href="/runs/{{ run_id }}/stop/terminate" id="terminate-run">Terminate this run&hellip;</a></div>{% endif %}
{% if left_open %}<h2>Open calls left for reconciliation</h2><table id="left-open"><thead><tr>
<th>Tool</th><th>Key</th><th>Risk</th><th>Status</th><th>Started</th><th>Last error / evidence</th>
<th></th></tr></thead><tbody>{% for c in left_open %}<tr><td>{{ c.name }}</td><td class="mono">{{ c.idempotency_key }}</td>
<td>{{ c.risk }}</td><td>{{ c.status }}</td><td class="mono">{{ c.started_at.isoformat() }}</td>
<td>{{ c.last_error or "" }} {{ c.last_evidence or "" }}</td><td><form method="post" action="/runs/{{ run_id }}/reconcile" class="reconcile"><input type="hidden"
 name="csrf" value="{{ csrf }}"><input type="hidden" name="key" value="{{ c.idempotency_key }}"><button
 type="submit" class="reconcile" data-key="{{ c.idempotency_key }}">Reconcile</button></form></td></tr>{% endfor %}</tbody></table>
<p class="muted">Reconcile runs the tool's declared lookup on a worker of the run's agent and records
what it finds, as recovery does: the run is not resumed.</p>{% endif %}
{% if forked %}<p class="flash" id="forked">Forked into <a class="mono" href="/runs/{{ forked }}">{{
 forked }}</a> (it appears here once the state projection has it).</p>{% endif %}
{% if st.lineage %}<div class="card" id="lineage">forked from <a class="mono" id="parent"
 href="/runs/{{ st.lineage.parent_run_id }}">{{ st.lineage.parent_run_id }}</a> at seq
 {{ st.lineage.at_seq }} by {{ st.lineage.forked_by }} (effects {{ st.lineage.effects_mode }})
{% if st.lineage.reason %}: {{ st.lineage.reason }}{% endif %}
<br><span class="muted">parent state digest {{ st.lineage.parent_digest[:16] }}</span>
{% set others = st.lineage.not_inherited() %}{% if others %}
<h3>What the other timeline did (not inherited)</h3><table id="other-timeline"><thead><tr>
<th>Tool</th><th>Arguments</th><th>Run</th><th>Seq</th><th>Status</th><th>This fork</th>
<th>Undo</th></tr></thead><tbody>{% for e in others %}<tr><td>{{ e.name }}</td>
<td class="mono">{{ e.args_json }}</td><td class="mono">{{ e.run_id }}</td>
<td class="num">{{ e.seq }}</td><td>{{ e.status }}</td><td>{{ e.resolution or "not met" }}</td>
<td>{{ "its tool has an inverse" if e.compensable else "" }}</td></tr>{% endfor %}
</tbody></table>{% endif %}</div>{% endif %}
{% if forks %}<div class="card" id="forks">Forks of this run: {% for f in forks %}<a class="mono"
 href="/runs/{{ f.run_id }}">{{ f.run_id }}</a> ({{ f.status }}){{ ", " if not loop.last }}{% endfor %}</div>{% endif %}
<div class="card">tenant <b>{{ tl.tenant }}</b> &middot; outcome <b id="outcome">{{ st.outcome or "-" }}</b>
&middot; seq {{ st.seq }} &middot; epoch {{ st.epoch }} &middot; resumptions {{ st.resumptions }}
&middot; fenced writes {{ st.fenced_writes }} &middot; turns {{ st.turns }}
&middot; tokens {{ st.input_tokens }}/{{ st.output_tokens }} &middot; cost ${{ "%.6f"|format(st.cost_usd) }}</div>
{% if pending %}<h2>Waiting for a person</h2>
{% for a in pending %}<div class="card approval" data-approval="{{ a.approval_id }}">
<b>{{ a.approval_id }}</b> ({{ a.kind }}) asked {{ a.requested_at }}: {{ a.reason }}
{% if a.due != "-" %}<br><span class="due">due {{ a.due }}</span>{% endif %}
{% if a.idempotency_key %}<br><span class="muted">call key {{ a.idempotency_key }}</span>{% endif %}
{% if a.about_a_call %}<br><a class="question" href="/runs/{{ run_id }}/approvals/{{ a.approval_id }}">What
may have happened, and what each answer does</a>{% endif %}
"""
    + _DECIDE
    + """</div>{% endfor %}{% endif %}
<h2>Timeline</h2>
<table id="timeline"><thead><tr><th>Seq</th><th>Epoch</th><th>At (UTC)</th><th>Event</th>
<th>What happened</th><th></th></tr></thead><tbody>
{% if hidden %}<tr><td colspan="5" class="muted">{{ hidden }} earlier record(s) not shown:
<a href="/runs/{{ run_id }}?all=1" id="all">show the whole run</a></td></tr>{% endif %}
{% for e in entries %}<tr class="{{ 'fenced' if not e.valid else 'superseded' if e.superseded else '' }}"><td class="num">{{ e.seq }}</td>
<td class="num">{{ e.epoch }}</td><td class="mono">{{ e.at|clock }}</td><td>{{ e.type }}</td>
<td class="{{ 'why' if not e.valid else '' }}">{{ e.text }}</td><td>{% if e.valid %}<form
 method="post" action="/runs/{{ run_id }}/fork" class="fork"><input type="hidden" name="csrf"
 value="{{ csrf }}"><input type="hidden" name="seq" value="{{ e.seq }}"><button type="submit"
 class="fork" data-seq="{{ e.seq }}">fork from here</button></form>{% endif %}</td></tr>{% endfor %}</tbody></table>
{% if tl.calls %}<h2>Tool calls</h2><table id="calls"><thead><tr><th>Tool</th><th>Key</th><th>Risk</th>
<th>Attempts</th><th>Outcome</th><th>Arguments</th><th>Result</th><th>Reconciliation</th><th></th></tr></thead><tbody>
{% for c in tl.calls %}<tr><td>{{ c.tool }}</td><td class="mono">{{ c.idempotency_key }}</td>
<td>{{ c.risk }}</td><td class="num">{{ c.attempts }}</td><td>{{ c.outcome }}{% if c.source
 == "reconciliation" %} (by evidence){% endif %}</td><td class="mono">{{ c.args_json }}</td>
<td class="mono">{{ c.result or "" }}</td><td>{{ c.reconciliations|join("; ") }}</td>
<td>{% set oc = st.open_calls.get(c.idempotency_key) %}{% if not told.ended and oc and oc.status == "uncertain" %}<form method="post" action="/runs/{{ run_id }}/reconcile" class="reconcile"><input type="hidden"
 name="csrf" value="{{ csrf }}"><input type="hidden" name="key" value="{{ c.idempotency_key }}"><button
 type="submit" class="reconcile" data-key="{{ c.idempotency_key }}">Reconcile</button></form>{% endif %}</td></tr>
{% endfor %}</tbody></table>{% endif %}
<h2>Audit trail</h2>
<table id="audit"><thead><tr><th>At</th><th>Seq</th><th>Kind</th><th>Details</th></tr></thead><tbody>
{% for e in audit %}<tr><td class="mono">{{ e.at|clock }}</td><td class="num">{{ e.seq }}</td>
<td>{{ e.kind }}</td><td>{{ e.detail }}</td></tr>
{% else %}<tr><td colspan="4" class="muted">No audit entries yet (kept by
<code>runlog project audit</code>).</td></tr>{% endfor %}</tbody></table>
<p class="muted">Read from the log ({{ tl.source }}); the audit trail from its projection.</p>
{% endblock %}"""
)

_APPROVALS = (
    """{% extends "base.html" %}{% block title %}Approvals{% endblock %}
{% block content %}<h1>Approvals waiting for a person</h1>
{% if flash %}<p class="flash">{{ flash }}</p>{% endif %}
<table id="approvals"><thead><tr><th>Tenant</th><th>Run</th><th>Approval</th><th>Kind</th>
<th>Reason</th><th>Waiting</th><th>Due</th><th>Decide</th></tr></thead><tbody>
{% for a in approvals %}<tr><td>{{ a.tenant }}</td>
<td><a class="mono" href="/runs/{{ a.run_id }}">{{ a.run_id }}</a></td>
<td class="mono">{% if a.about_a_call %}<a class="question"
 href="/runs/{{ a.run_id }}/approvals/{{ a.approval_id }}">{{ a.approval_id }}</a>{% else %}{{
 a.approval_id }}{% endif %}</td><td>{{ a.kind }}</td><td>{{ a.reason }}</td>
<td class="num">{{ a.age }}</td><td class="due">{{ a.due }}</td><td>{% with run_id=a.run_id %}"""
    + _DECIDE
    + """{% endwith %}</td></tr>
{% else %}<tr><td colspan="8" class="muted">Nothing is waiting for a person.</td></tr>
{% endfor %}</tbody></table>{% endblock %}"""
)

_QUESTION_FACTS = """<p class="card" id="reason">{{ q.reason }} <span class="muted">(asked
{{ q.requested_at|clock }} UTC, {{ q.kind }})</span></p>
{% if q.tool %}<table id="question" class="card"><tbody>
<tr><th>Tool</th><td id="q-tool">{{ q.tool }}</td></tr>
<tr><th>Risk</th><td>{{ q.risk or "" }}</td></tr>
<tr><th>Intended payload</th><td class="mono" id="q-args">{{ q.args_json or "" }}</td></tr>
<tr><th>Idempotency key</th><td class="mono" id="q-key">{{ q.idempotency_key or "" }}</td></tr>
<tr><th>Started</th><td id="q-started">{{ q.started_at or "" }} ({{ q.attempts|length }} attempt(s))</td></tr>
<tr><th>Last error</th><td id="q-error">{{ q.last_error or "-" }}</td></tr>
<tr><th>Receiver deduplicates by the key</th><td id="q-dedupes">{{ {True: "declared", False: "not declared",
 None: "not recorded"}[q.dedupes_by_key] }}</td></tr>
{% if q.risk == "reversible" %}<tr><th>Inverse (compensate)</th><td>{{ {True: "declared",
 False: "not declared", None: "not recorded"}[q.compensable] }}</td></tr>{% endif %}
{% if q.detail %}<tr><th>Intended and found</th><td class="mono">{{ q.detail }}</td></tr>{% endif %}
</tbody></table>{% endif %}
{% if q.attempts %}<h2>Attempts</h2><table id="attempts"><thead><tr><th>Attempt</th><th>Seq</th>
<th>Started (UTC)</th><th>Outcome</th><th>Error</th></tr></thead><tbody>
{% for t in q.attempts %}<tr><td class="num">{{ t.attempt }}</td><td class="num">{{ t.seq }}</td>
<td class="mono">{{ t.started_at }}</td><td>{{ t.outcome }}{% if t.detected_by %} ({{ t.detected_by }}){% endif %}</td>
<td>{{ t.error or "" }}</td></tr>{% endfor %}</tbody></table>{% endif %}
{% if q.reconciliations %}<h2>Reconciliation</h2><table id="reconciliations"><thead><tr><th>Seq</th>
<th>At (UTC)</th><th>Outcome</th><th>Action</th><th>Rule</th><th>Evidence</th></tr></thead><tbody>
{% for r in q.reconciliations %}<tr><td class="num">{{ r.seq }}</td><td class="mono">{{ r.at|clock }}</td>
<td>{{ r.outcome }}</td><td>{{ r.action }}</td><td>{{ r.rule }}</td><td class="mono">{{ r.evidence }}</td></tr>
{% endfor %}</tbody></table>{% endif %}"""

_QUESTION = (
    """{% extends "base.html" %}{% block title %}Approval {{ q.approval_id }}{% endblock %}
{% block content %}<h1>Approval <span class="mono">{{ q.approval_id }}</span> of run
<a class="mono" href="/runs/{{ run_id }}">{{ run_id }}</a></h1>
"""
    + _QUESTION_FACTS
    + """<h2>What each answer does</h2><ul id="choices">
<li id="approve-means">{{ q.approve }}</li><li id="reject-means">{{ q.reject }}</li>
{% if q.undo_and_retry %}<li id="undo-means">{{ q.undo_and_retry }}</li>{% endif %}</ul>
{% if q.decided %}<p class="card" id="decided">Decided: {{ q.decided }}</p>
{% else %}<div class="card approval" data-approval="{{ q.approval_id }}">"""
    + _DECIDE
    + """</div>{% endif %}{% endblock %}"""
)

_CONFIRM = (
    """{% extends "base.html" %}{% block title %}Confirm {{ decision }}{% endblock %}
{% block content %}<h1>Confirm: {{ decision }} <span class="mono">{{ q.approval_id }}</span></h1>
<p class="card overdue" id="confirmation">{{ sentence }}</p>
<form method="post" action="/runs/{{ run_id }}/approvals/{{ q.approval_id }}" class="card">
<input type="hidden" name="csrf" value="{{ csrf }}"><input type="hidden" name="next" value="{{ next }}">
<input type="hidden" name="decision" value="{{ decision }}"><input type="hidden" name="note" value="{{ note }}">
<input type="hidden" name="confirm" value="yes">
<button type="submit" id="confirm">Confirm: {{ decision }}</button>
<a href="/runs/{{ run_id }}/approvals/{{ q.approval_id }}" id="cancel">Cancel</a></form>
{% if note %}<p>Your note: <i>{{ note }}</i></p>{% endif %}
<h2>What you are deciding about</h2>
"""
    + _QUESTION_FACTS
    + """{% endblock %}"""
)

_STOP = """{% extends "base.html" %}{% block title %}{{ verb }} run {{ run_id }}{% endblock %}
{% block content %}<h1>{{ verb }} run <span class="mono">{{ run_id }}</span>?</h1>
<p class="card overdue" id="what">{% if action == "cancel" %}Cancelling asks the run to stop: the
request is recorded in its log with your name ({{ grant.name }}), the time and your reason. The
worker that holds it sees the request before its next model turn or tool call, the agent is told
(it may clean up) and the run ends <b>cancelled</b>. A call already under way finishes or stays
uncertain under the recovery rules: nothing is closed without evidence. A run no one holds shows
as cancelling and is cancelled when next opened.{% else %}Terminating ends the run now, without its
worker: the run is taken with a higher epoch, so the worker that holds it is fenced (its next append
is refused and it calls no further tool), and the run is recorded as <b>terminated</b> with your
name ({{ grant.name }}), the time and your reason. Nothing is recovered: a call under way is left
open and listed for reconciliation ({{ open_calls }} open now). This cannot be undone.{% endif %}</p>
<p>The run is <b id="stop-status">{{ status }}</b> now.</p>
<form method="post" action="/runs/{{ run_id }}/stop/{{ action }}" class="card">
<input type="hidden" name="csrf" value="{{ csrf }}">
<label>Reason (required, recorded) <input type="text" name="reason" id="reason" required
 maxlength="2000" value="{{ reason }}"></label>
{% if error %}<p class="overdue" id="error">{{ error }}</p>{% endif %}
<button type="submit" id="confirm-stop">Confirm: {{ verb|lower }}</button>
<a href="/runs/{{ run_id }}" id="back">Back</a></form>{% endblock %}"""

_UNCERTAIN = """{% extends "base.html" %}{% block title %}Uncertain calls{% endblock %}
{% block content %}<h1>Uncertain calls</h1>
<p>{{ calls|length }} open{% for risk, age in oldest.items() %} &middot; oldest {{ risk }}
{{ age }}{% endfor %}</p>
{% if overdue %}<div class="card"><b class="overdue">Overdue:</b><ul>
{% for c in overdue %}<li class="overdue">{{ c.tool }} in run <a href="/runs/{{ c.run_id }}">{{ c.run_id }}</a>
(key <span class="mono">{{ c.idempotency_key }}</span>, {{ c.risk }}, {{ c.status }}) open {{ c.age }},
deadline {{ c.deadline }}</li>{% endfor %}</ul></div>{% endif %}
<table id="uncertain"><thead><tr><th>Status</th><th>Risk</th><th>Age</th><th>Tenant</th><th>Run</th>
<th>Tool</th><th>Key</th><th>Attempts</th><th>Arguments</th><th>Last error / evidence</th><th></th></tr></thead><tbody>
{% for c in calls %}<tr><td class="{{ 'overdue' if c.overdue else '' }}">{{ "OVERDUE " if c.overdue else "" }}{{ c.status }}</td>
<td>{{ c.risk }}</td><td class="num">{{ c.age }}</td><td>{{ c.tenant }}</td>
<td><a class="mono" href="/runs/{{ c.run_id }}">{{ c.run_id }}</a></td><td>{{ c.tool }}</td>
<td class="mono">{{ c.idempotency_key }}</td><td class="num">{{ c.attempts }}</td>
<td class="mono">{{ c.args_json }}</td><td>{{ c.last_error or "" }} {{ c.last_evidence or "" }}</td>
<td>{% if c.status not in ("escalated", "conflict", "decided") %}<form method="post" action="/runs/{{ c.run_id }}/reconcile" class="reconcile"><input type="hidden"
 name="csrf" value="{{ csrf }}"><input type="hidden" name="key" value="{{ c.idempotency_key }}"><button
 type="submit" class="reconcile" data-key="{{ c.idempotency_key }}">Reconcile</button></form>{% endif %}</td></tr>
{% else %}<tr><td colspan="11" class="muted">No call of a visible tenant has an unknown outcome.</td></tr>
{% endfor %}</tbody></table>{% endblock %}"""

_LAG = """{% extends "base.html" %}{% block title %}Projection lag{% endblock %}
{% block content %}<h1>Projection lag</h1>
<p class="muted">Records of <code>{{ snap.topic }}</code> not yet folded, per projection and
partition (high watermark minus the next offset to apply).</p>
<table id="lag"><thead><tr><th>Projection</th><th>Lag (records)</th><th>Applied</th>
<th>Quarantined</th><th>Sealed, no key (runs)</th><th>Per partition (lag)</th></tr></thead><tbody>
{% for name, body in snap.projections.items() %}<tr><td>{{ name }}</td><td class="num">{{ body.lag }}</td>
<td class="num">{{ body.applied }}</td><td class="num">{{ body.quarantined }}</td>
<td class="num sealed">{{ body.sealed_runs }}</td>
<td class="mono">{% for p, row in body.partitions.items() %}{{ p }}:{{ row.lag }} {% endfor %}</td></tr>
{% endfor %}</tbody></table>{% endblock %}"""

_REQUESTED = """{% extends "base.html" %}{% block title %}Run {{ req.run_id }}{% endblock %}
{% block content %}<h1>Run <span class="mono">{{ req.run_id }}</span>
<span class="st st-requested" id="status">requested</span></h1>
<p class="card {{ '' if req.served_by else 'overdue' }}" id="status-detail">{{ req.text() }}</p>
<table class="card"><tbody>
<tr><th>Agent</th><td id="agent">{{ req.agent }}</td></tr>
<tr><th>Tenant</th><td>{{ req.tenant }}</td></tr>
<tr><th>Requested by</th><td id="requested-by">{{ req.requested_by or "?" }}</td></tr>
<tr><th>Since</th><td>{{ req.since.isoformat() if req.since else "?" }}</td></tr>
<tr><th>Live workers serving it</th><td>{{ req.served_by|join(", ") or "none" }}</td></tr>
</tbody></table>
<p class="muted">No event of this run is in the log yet: a <code>runlog worker</code> that
registers the agent starts it.</p>
<p><a href="/">Back to the runs</a></p>{% endblock %}"""
_RECONCILE = """{% extends "base.html" %}{% block title %}Not reconciled{% endblock %}
{% block content %}<h1>Not reconciled</h1>
<p class="card overdue" id="refused">{% if key %}Call <span class="mono">{{ key }}</span> of run{% else %}Run{% endif %}
<a class="mono" href="/runs/{{ run_id }}">{{ run_id }}</a>: {{ why }}. Nothing was recorded.</p>
{% if approval %}<p><a href="/runs/{{ run_id }}/approvals/{{ approval }}" id="question">What may have
happened, and what each answer does</a></p>{% endif %}
<p><a href="/runs/{{ run_id }}">Back to the run</a> &middot; <a href="/uncertain">Uncertain calls</a></p>
{% endblock %}"""

_NOT_FOUND = """{% extends "base.html" %}{% block title %}Not found{% endblock %}
{% block content %}<h1>Not found</h1><p id="notfound">{{ message }}</p>
<p><a href="/">Back to the runs</a></p>{% endblock %}"""

_NOT_UNDOABLE = """{% extends "base.html" %}{% block title %}Cannot undo{% endblock %}
{% block content %}<h1>Cannot undo and retry</h1>
<p id="refused">Your decision (undo and retry) on approval <code>{{ approval_id }}</code> of run
<a class="mono" href="/runs/{{ run_id }}">{{ run_id }}</a> was not recorded: {{ why }}</p>
<p><a href="/runs/{{ run_id }}/approvals/{{ approval_id }}">Back to the question</a></p>
{% endblock %}"""

_DECIDED = """{% extends "base.html" %}{% block title %}Already decided{% endblock %}
{% block content %}<h1>Already decided</h1>
<p id="refused">Your decision ({{ yours }}) on approval <code>{{ approval_id }}</code> of run
<a class="mono" href="/runs/{{ run_id }}">{{ run_id }}</a> was not recorded: a person's
decision is final, and the first one in the run's log stands.</p>
<table id="standing" class="card"><tbody>
<tr><th>Decision</th><td>{{ standing_verb }}</td></tr>
<tr><th>By</th><td>{{ standing.decided_by }}</td></tr>
<tr><th>At</th><td>{{ standing.decided_at.isoformat() if standing.decided_at else "" }}</td></tr>
<tr><th>Note</th><td>{{ standing.note }}</td></tr></tbody></table>
<p><a href="/runs/{{ run_id }}">Back to the run</a> &middot; <a href="/approvals">Approvals</a></p>
{% endblock %}"""

_FORK_CONFIRM = """{% extends "base.html" %}{% block title %}Fork {{ run_id }}{% endblock %}
{% block content %}<h1>Fork run <span class="mono">{{ run_id }}</span> after seq {{ seq }}</h1>
<p class="card" id="fork-means">A new run begins with this run's state after seq {{ seq }}
(this run is not changed). Calls completed up to there are the fork's own: asking again
returns their recorded results. A call this run also completed after seq {{ seq }} (the same
tool, arguments and occurrence) does what you choose below; any other call is a new action
of the fork.</p>
<form method="post" action="/runs/{{ run_id }}/fork" class="card">
<input type="hidden" name="csrf" value="{{ csrf }}"><input type="hidden" name="seq" value="{{ seq }}">
<input type="hidden" name="confirm" value="yes">
<label>Effects <select name="effects" id="fork-effects">
<option value="inherit" selected>inherit: return this run's result, never repeat it</option>
<option value="ask">ask: stop for a person before repeating it</option>
<option value="execute">execute: repeat it under the fork's own key (the world sees it again)</option>
</select></label><br>
<label>Why <input name="reason" id="fork-reason" maxlength="500"></label><br>
<button type="submit" id="confirm-fork">Confirm: fork after seq {{ seq }}</button>
<a href="/runs/{{ run_id }}" id="cancel">Cancel</a></form>
{% endblock %}"""

_TEMPLATES = {
    "fork.html": _FORK_CONFIRM,
    "decided.html": _DECIDED,
    "not_undoable.html": _NOT_UNDOABLE,
    "question.html": _QUESTION,
    "confirm.html": _CONFIRM,
    "base.html": _BASE,
    "login.html": _LOGIN,
    "runs.html": _RUNS,
    "run.html": _RUN,
    "stop.html": _STOP,
    "approvals.html": _APPROVALS,
    "uncertain.html": _UNCERTAIN,
    "lag.html": _LAG,
    "notfound.html": _NOT_FOUND,
    "requested.html": _REQUESTED,
    "reconcile.html": _RECONCILE,
}

ENV = Environment(
    loader=DictLoader(_TEMPLATES),
    autoescape=select_autoescape(default=True, default_for_string=True),
)


def _clock(iso: str | None) -> str:
    """``HH:MM:SS.mmm`` of an ISO time (UTC in the log); empty for none."""
    if not iso:
        return ""
    return datetime.fromisoformat(iso).strftime("%H:%M:%S.%f")[:-3]


ENV.filters["clock"] = _clock


def render(name: str, fragment: bool, **context: Any) -> str:
    """A whole page, or only its ``content`` block when the page refreshes itself."""
    template = ENV.get_template(name)
    if not fragment:
        return template.render(**context)
    block = template.blocks["content"]
    return "".join(block(template.new_context(context)))
