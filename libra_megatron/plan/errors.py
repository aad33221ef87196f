"""Errors raised by the planner and by plan validation."""

__all__ = ["PlanError"]


class PlanError(ValueError):
    """A plan (or its inputs) is inconsistent. The message names the rank and tile where it can.

    Subclasses ValueError so that user-facing bad input (e.g. a block straddling homes that cannot be
    split) is still a ValueError for callers that catch those.
    """
