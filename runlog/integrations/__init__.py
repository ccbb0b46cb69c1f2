"""Agent frameworks driven as runlog runs (each needs its optional extra installed)."""
