"""Projection runners, stores, replay jobs and snapshots."""
