"""A draining worker hands its runs over at their next step.

A worker told to stop (SIGTERM: a node drain, a rolling update) sets its ``draining``
flag. Each of its runs finishes the step it is in (a tool call in flight completes and is
recorded), and the next step's check (``Engine.cancel_check``, the same place a
person's cancellation is seen) raises ``HandingOver`` into the agent. The worker then
releases the run's lease as a handover (``LeaseManager.hand_over``) so another worker
resumes it at once, instead of waiting for the lease to expire.
"""

from __future__ import annotations


class HandingOver(BaseException):
    """The run's worker is draining: unwinds the agent function to its worker at a step's
    start, where nothing of the run is in flight.

    A ``BaseException`` (as ``TimerPending``) so that an agent's ``except Exception``
    around a step never swallows it.
    """

    def __init__(self, run_id: str) -> None:
        super().__init__(f"run {run_id} is handed over: its worker is draining")
        self.run_id = run_id
