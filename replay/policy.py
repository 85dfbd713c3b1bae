"""A session's policy: when to record, how many graphs to keep, how outputs are returned."""

from __future__ import annotations

import os

import attrs


def _non_negative_int(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{attribute.name} must be an int >= 0, got {value!r}")


def _positive_int(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attribute.name} must be an int >= 1, got {value!r}")


def _fraction(instance, attribute, value):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"{attribute.name} must be a number in (0, 1], got {value!r}")


def _buckets(value: object) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        sizes = list(value)  # type: ignore[call-overload]
    except TypeError:
        raise ValueError(f"buckets must be a list of ints >= 1, got {value!r}") from None
    if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in sizes):
        raise ValueError(f"buckets must be a non-empty list of ints >= 1, got {value!r}")
    return tuple(sorted(set(sizes)))


def _bool(instance, attribute, value):
    if not isinstance(value, bool):
        raise ValueError(f"{attribute.name} must be True or False, got {value!r}")


def _debug_default(value: object) -> object:
    """None: on where ``REPLAY_DEBUG`` is set (and not 0)."""
    if value is None:
        return os.environ.get("REPLAY_DEBUG", "").strip() not in ("", "0")
    return value


@attrs.frozen(kw_only=True)
class Policy:
    """How a session records, keeps and hands out graphs (``capture(**options)``, ``graphed``).

    - ``record_after`` (int >= 0, default 1): a key is recorded once it has been called more
      often than this recently (its first calls run eagerly and compile what it needs); see
      replay.admission.
    - ``max_graphs`` (int >= 1, default 64): graphs kept per session; beyond, a new key replaces
      the least frequently replayed graph only if it was called more often recently.
    - ``record_budget`` (in (0, 1], default 0.03): the grace, in units of
      ``replay.admission.GRACE_SECONDS``: how far the time recording takes may run ahead of
      what replays saved (each replay: its region's eager time less its replay time), so that
      a loop whose recordings are never repaid loses at most the grace; the session's first
      recordings, made as soon as admitted, take part of it. 1 turns the budget, and the
      payback rule, off (replay.admission; docs/benchmarks/shapes.md).
    - ``buckets`` (ints >= 1, or None): the sizes ``replay.padded`` arguments are padded to
      (replay.buckets).
    - ``polymorphic`` (default False): a padded call smaller than its bucket runs the bucket's
      graph at its own size, once one eager run at that size has shown the same launches
      (replay.polymorphic), instead of padding; needs ``buckets``.
    - ``clone_outputs`` (default False): return copies instead of the graph's own output buffers.
    - ``verify_every`` (int >= 0, default 0): every Nth replay of a graph is also run eagerly
      and compared bitwise (0 turns it off).
    - ``check_stale`` (default None: on where ``REPLAY_DEBUG=1``): outputs raise
      StaleOutputError when read after a later replay overwrote them (a debug aid)."""

    record_after: int = attrs.field(default=1, validator=_non_negative_int)
    max_graphs: int = attrs.field(default=64, validator=_positive_int)
    record_budget: float = attrs.field(default=0.03, validator=_fraction)
    buckets: tuple[int, ...] | None = attrs.field(default=None, converter=_buckets)
    polymorphic: bool = attrs.field(default=False, validator=_bool)
    clone_outputs: bool = attrs.field(default=False, validator=_bool)
    verify_every: int = attrs.field(default=0, validator=_non_negative_int)
    check_stale: bool = attrs.field(default=None, converter=_debug_default, validator=_bool)

    def __attrs_post_init__(self) -> None:
        if self.polymorphic and self.buckets is None:
            raise ValueError("polymorphic=True serves the sizes below each bucket: capture(buckets=[...]) lists them")
