"""The worker fleet: agents registered by name, durable start requests, dispatch by
Kafka's consumer-group protocol over the run-lifecycle topic (``docs/concepts/fleet.md``).

Layer: beside the producers (it drives runs through ``open_run_with``) and never imported
by them; the facade (``runlog.start``) and the CLI (``runlog worker``) compose it.
"""
