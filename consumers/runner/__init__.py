"""The projection runner (``loop``), re-exported where callers have always imported it."""

from runlog.consumers.runner.loop import (
    ProjectionRebuilt,
    ProjectionRunner,
    RebuildBusy,
    RebuildIncomplete,
    RunnerStats,
    Stopped,
    default_group,
    delete_projection,
    rebuild,
    streaming_gc,
    transient_redis_error,
)

__all__ = [
    "ProjectionRebuilt",
    "ProjectionRunner",
    "RebuildBusy",
    "RebuildIncomplete",
    "RunnerStats",
    "Stopped",
    "default_group",
    "delete_projection",
    "rebuild",
    "streaming_gc",
    "transient_redis_error",
]
