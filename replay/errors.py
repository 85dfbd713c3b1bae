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


class RefusedKey(ReplayError):
    """A call whose key cannot be made exactly, so no graph may be recorded or replayed for it:
    an argument a graph would bake without the key seeing its changes (an object compared by
    identity, whose attributes the region reads), a constant whose equality is not known to be
    exact (two values it calls equal could share a graph that bakes one of them), a tensor
    inside a constant, or a torch setting that cannot be read. The session runs such a call
    eagerly, with a ReplayWarning naming :attr:`reason` (once per reason and region); ``path``
    names the argument (``args[1].cfg``), None for a setting."""

    def __init__(self, reason: str, path: str | None = None):
        super().__init__(reason)
        self.reason = reason
        self.path = path


class ReplayWarning(UserWarning):
    """A key fell back to eager execution (the message says why)."""
