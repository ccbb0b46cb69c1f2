"""Pure folds over the event log. No Kafka, no Redis, no clock, no I/O."""

from runlog.projections._run_state import FOLD_VERSION, OpenCall, RunState, apply, fold, is_valid

__all__ = ["FOLD_VERSION", "OpenCall", "RunState", "apply", "fold", "is_valid"]
