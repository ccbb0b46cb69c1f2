"""Log access, written once for every reader: locate a run, read its records, fold a range.

The writer (``runlog.producers``), the projection services, replay and verify
(``runlog.consumers``) all read the events topic through this package, so a rule about
where a run lives or which of its records count is never answered two ways.
"""
