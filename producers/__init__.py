"""Agent-worker side: leases, durable appends, open_run, the tool-call path, recovery."""
