"""Measurement for the benchmarks, kept off the call path.

The recording marks its steps on :data:`steps` as it goes. Unless a benchmark turned timing
on (:func:`timing`), that is :data:`NOT_TIMING`, whose marks do nothing: the call path pays an
attribute read and an empty call per step, and carries no clock readings of its own. Timed,
each mark ends the step that began at the previous mark (or at :meth:`StepTimes.start`), so
the steps of one call follow each other, none inside another.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from replay import lifecycle, object_calls, region_keys

# --- the steps of a call ------------------------------------------------------------------


@attrs.frozen
class Step:
    """One timed step: its name and the clock's readings as it began and ended."""

    name: str
    began: float
    ended: float

    @property
    def seconds(self) -> float:
        return self.ended - self.began


class StepTimes:
    """The steps marked while timing is on, in the order they ended."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock
        self.steps: list[Step] = []
        self._began: float | None = None

    def start(self) -> None:
        """A step begins now: the first of a call's, or one after time that is no step."""
        self._began = self.clock()

    def mark(self, name: str) -> None:
        """The step ``name`` ends now, and the next one begins. A step that began before
        timing was turned on is left out."""
        now = self.clock()
        if self._began is not None:
            self.steps.append(Step(name, self._began, now))
        self._began = now

    def seconds(self) -> dict[str, float]:
        """Seconds per step, in the order the steps first ended. A step marked in parts (the
        capture's begin and end, around the region it captures) is the sum of its parts."""
        total: dict[str, float] = {}
        for step in self.steps:
            total[step.name] = total.get(step.name, 0.0) + step.seconds
        return total


class _NotTiming:
    """What :data:`steps` is while no benchmark times: every mark does nothing."""

    __slots__ = ()

    def start(self) -> None:
        pass

    def mark(self, name: str) -> None:
        pass


NOT_TIMING = _NotTiming()

#: Where the recording marks its steps (read at each mark, so that :func:`timing` can swap it).
steps: StepTimes | _NotTiming = NOT_TIMING


@contextlib.contextmanager
def timing(clock: Callable[[], float] = time.perf_counter) -> Iterator[StepTimes]:
    """Time the steps that the calls made in this block mark. Meant for one thread's calls:
    the marks of recordings in several threads at once would interleave."""
    global steps
    previous, times = steps, StepTimes(clock)
    steps = times
    try:
        yield times
    finally:
        steps = previous


# --- the replay path's measurement ------------------------------------------------------------
# Hooks that swap parts of a replay for the benchmarks, so that each part's cost shows as a
# difference (docs/benchmarks/replay.md). Calls made inside them are not protected: never use
# them around calls whose results matter.


def graphs_held(region) -> list:
    """The graphs ``region``'s keys hold now (what the hooks below take)."""
    return [entry.graph for entry in region.entries.values() if entry.graph is not None]


def _unchanged() -> bool:
    """The settings check of a graph measured without checks: nothing changed."""
    return False


def _no_check() -> None:
    """A launcher-globals check of a graph measured without checks: nothing to raise."""
    return None


def measure_without_checks(graphs: Sequence) -> contextlib.AbstractContextManager:
    """While the context lasts, ``graphs`` skip the per-call checks that guard exactness
    beyond the key (the torch settings, the jit launchers' globals)."""

    def skipped(graph) -> dict[str, object]:
        checks = (name for name in graph.namespace if re.fullmatch(r"_check\d+", name))
        return {"_modes_changed": _unchanged, **dict.fromkeys(checks, _no_check)}

    return _namespaces_swapped(graphs, skipped)


#: The ways :func:`measure_with_settings_check` can make the settings check: (compiled, watch).
_SETTINGS_CHECK_WAYS = {"python": (False, False), "c": (True, False)}


def measure_with_settings_check(graphs: Sequence, way: str) -> contextlib.AbstractContextManager:
    """While the context lasts, ``graphs`` check the torch settings another way than the
    fastest one built, so a benchmark can time what each step saves: ``"python"`` the
    generated Python check (where no C helper was built), ``"c"`` csrc/replay_checks.c's
    without the torch-side helper's settings watch. Every way is exact."""
    compiled, watch = _SETTINGS_CHECK_WAYS[way]
    return _namespaces_swapped(
        graphs,
        lambda graph: {"_modes_changed": region_keys.modes_changed(graph.key[2], compiled=compiled, watch=watch)},
    )


def measure_generated_python(region) -> contextlib.AbstractContextManager:
    """Inside the context, ``region``'s recorded keys replay through their generated Python
    function alone, without csrc/replay_step.c in front of it (what a replay costs where that
    file is not built)."""
    return lifecycle.runs_replaced(region, generated_replay)


def generated_replay(run: Callable) -> Callable:
    """The generated Python function behind a replay: a C step's fallback, or ``run`` itself
    where it is one."""
    return getattr(run, "fallback", run)


@contextlib.contextmanager
def _namespaces_swapped(graphs: Sequence[Any], replacements: Callable[[Any], dict[str, object]]) -> Iterator[None]:
    """Each graph's replay namespace with ``replacements(graph)`` in place while the context
    lasts, then its own values back. The C step reads these names from the same namespace at
    every call, so the hooks apply to it too."""
    saved = []
    for graph in graphs:
        values = replacements(graph)
        saved.append((graph, {name: graph.namespace[name] for name in values}))
        graph.namespace.update(values)
    try:
        yield
    finally:
        for graph, values in saved:
            graph.namespace.update(values)


# --- a call passing objects ------------------------------------------------------------------


class ObjectMemos:
    """The memos of repeated object calls (replay.object_calls) switched on or off for the
    whole process, so that a benchmark times a call with its memo and on the full path alone,
    round robin (:meth:`off` drops ``region``'s memos; measurement only)."""

    def __init__(self, region) -> None:
        self.region = region
        self._saved = object_calls.serve, object_calls.remember

    def on(self) -> None:
        object_calls.serve, object_calls.remember = self._saved

    def off(self) -> None:
        object_calls.serve = _not_served
        object_calls.remember = _not_remembered
        self.region.object_memos = ()


def _not_served(region, args: tuple, kwargs: dict, miss: object) -> object:
    return miss


def _not_remembered(*memo: object) -> None:
    return None


def full_key_steps(region, args: tuple) -> dict[str, Callable[[], object]]:
    """The full path's steps for a call of ``region`` with ``args`` (objects among them), each
    callable alone: the walk (``flat_call``), admission's count and the full key."""
    call = region_keys.flat_call(args, {}, walk_objects=True)
    device = region.session.current_device()
    return {
        "the walk (flat_call)": lambda: region_keys.flat_call(args, {}, walk_objects=True),
        "admission's count": lambda: region.keying.counted(call),
        "the full key": lambda: region.keying.key_of(call, device),
    }
