"""Errors and warnings of the replay layer."""

from __future__ import annotations


class ReplayError(Exception):
    """Base class of replay errors."""


class SessionClosedError(ReplayError, RuntimeError):
    """A region of a session that has been closed (its ``with capture()`` block ended)."""


class StaleOutputError(ReplayError, RuntimeError):
    """An output of a replayed graph was read after a later replay overwrote it."""


class ReplayMismatchError(ReplayError, AssertionError):
    """``verify_every`` found a replay whose results differ from an eager run."""


class DynamicScalarError(ReplayError, TypeError):
    """A ``replay.dynamic`` scalar was used where a graph would bake its value in."""


class ReplayWarning(UserWarning):
    """A key fell back to eager execution (the message says why)."""
