"""The benchmarks' step timing: off by default, on for a block, steps that follow each other."""

from __future__ import annotations

import itertools

import pytest
import torch

from replay import instrumentation
from tests.replay.test_session import add, session_factory  # noqa: F401 (a fixture)


def _clock(*readings: float):
    return iter(readings).__next__


def test_marks_do_nothing_until_a_block_turns_timing_on_and_after_it():
    assert instrumentation.steps is instrumentation.NOT_TIMING
    instrumentation.steps.start()
    instrumentation.steps.mark("prepare")  # no clock read, nothing kept
    with instrumentation.timing(_clock(1.0, 3.0)) as times:
        assert instrumentation.steps is times
        instrumentation.steps.start()
        instrumentation.steps.mark("prepare")
    assert instrumentation.steps is instrumentation.NOT_TIMING
    assert times.steps == [instrumentation.Step("prepare", 1.0, 3.0)]


def test_timing_ends_with_its_block_even_on_error():
    with pytest.raises(ZeroDivisionError), instrumentation.timing():
        1 / 0  # noqa: B018
    assert instrumentation.steps is instrumentation.NOT_TIMING


def test_each_mark_ends_the_step_the_last_one_began_and_parts_of_a_step_add_up():
    times = instrumentation.StepTimes(_clock(0.0, 1.0, 3.0, 6.0, 10.0, 20.0, 30.0, 31.0))
    times.mark("begun before timing")  # its start was never read: left out
    times.start()
    times.mark("prepare")
    times.mark("capture")
    times.mark("region")
    times.mark("capture")  # the capture's second part, after the region
    times.start()  # time that is no step (between two calls)
    times.mark("analyse")
    names = [s.name for s in times.steps]
    assert names == ["prepare", "capture", "region", "capture", "analyse"]
    assert all(a.ended <= b.began for a, b in itertools.pairwise(times.steps))
    assert times.seconds() == {"prepare": 2.0, "capture": 3.0 + 10.0, "region": 4.0, "analyse": 1.0}


class _Step:
    """Stands for csrc/replay_step.c's ReplayStep: a C step that runs its generated Python
    function (``fallback``) where it does not serve a call itself."""

    def __init__(self, fallback) -> None:
        self.fallback = fallback

    def __call__(self, *leaves):
        raise AssertionError("the C step ran inside the hook")


def test_the_generated_python_hook_replays_through_the_fallback_and_puts_the_step_back(session_factory):  # noqa: F811
    session = session_factory(record_after=0)
    step = session.region(add)
    x = torch.ones(3)
    step(x, x)  # recorded
    step(x, x)  # analysed, replayed
    ((guard, run, entry),) = candidates = next(iter(step.by_pre_key.values()))
    assert instrumentation.graphs_held(step) == [entry.graph]
    stepped = _Step(run)
    candidates[:] = [(guard, stepped, entry)]
    replays = entry.graph.replays
    with instrumentation.measure_generated_python(step):
        assert torch.equal(step(x, x), x + x)
    assert entry.graph.replays == replays + 1
    assert candidates == [(guard, stepped, entry)]
    with pytest.raises(AssertionError, match="the C step ran"):
        step(x, x)
