"""Pieces of replay.recording that need a GPU (the capture itself is tested through sessions,
in test_replay_gpu.py and test_hazards_gpu.py)."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

import jitcore as jc
import replay
from replay import instrumentation
from replay.recording import _OnStream

pytestmark = pytest.mark.gpu


def test_a_capture_stream_is_current_inside_and_the_callers_after_even_on_error():
    device = torch.cuda.current_device()
    caller, capture = torch.cuda.Stream(device), torch.cuda.Stream(device)
    with torch.cuda.stream(caller):
        with _OnStream(capture):
            assert torch.cuda.current_stream() == capture
        assert torch.cuda.current_stream() == caller
        with pytest.raises(ZeroDivisionError), _OnStream(capture):
            assert torch.cuda.current_stream() == capture
            1 / 0  # noqa: B018
        assert torch.cuda.current_stream() == caller and torch.cuda.current_device() == device


@pytest.mark.multigpu
def test_a_stream_of_another_device_switches_the_device_as_torchs_context_does():
    other = 1 - torch.cuda.current_device()
    stream = torch.cuda.Stream(other)
    before = torch.cuda.current_device()
    with _OnStream(stream):
        assert torch.cuda.current_device() == other and torch.cuda.current_stream() == stream
    assert torch.cuda.current_device() == before


@jc.jit
def _shift(x, y, by):
    n = x.numel()
    _SHIFT[jc.cdiv(n, 128), 128](x, y, by, n)


_SHIFT = jc.Kernel(
    "__global__ void shift(const float* x, float* y, float by, long long n) {"
    " long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; if (i < n) y[i] = x[i] + by; }",
    "shift",
)


def _shifted_twice(x):
    y = torch.empty_like(x)
    _shift(x, y, 1.5)
    z = torch.empty_like(y)
    _shift(y, z, -0.25)
    return z


#: The steps a recording call marks, in the order they run (benchmarks/replay.py reports
#: them): the capture's begin, checks and end are one step, marked in two parts around the
#: region it captures.
RECORDING_CALL_STEPS = [
    "prepare",
    "capture begin, checks, end",
    "region",
    "capture begin, checks, end",
    "pool snapshot",
    "own outputs",
    "extents and records",
    "instantiate",
]


def _in_order_inside(steps, started: float, ended: float) -> bool:
    """Each step takes time, begins where the last one ended or later (none inside another),
    and all of them lie inside [started, ended]."""
    return (
        all(step.began <= step.ended for step in steps)
        and all(before.ended <= after.began for before, after in itertools.pairwise(steps))
        and started <= steps[0].began
        and steps[-1].ended <= ended
    )


def test_a_recording_times_its_steps_apart_and_they_fit_inside_its_call():
    x = torch.randn(4, 300, device="cuda")
    _shifted_twice(x)  # the jit's compile, outside the recording
    session = replay.capture(record_after=0)
    try:
        step = session.region(_shifted_twice)
        torch.cuda.synchronize()
        with instrumentation.timing() as recording_call:
            started = time.perf_counter()
            first = step(x)
            torch.cuda.synchronize()
            ended = time.perf_counter()
        assert torch.equal(first, x + 1.5 - 0.25)
        assert [s.name for s in recording_call.steps] == RECORDING_CALL_STEPS
        assert _in_order_inside(recording_call.steps, started, ended)
        # the capture's seconds (the session's capture_seconds) are its steps after prepare
        (entry,) = step.entries.values()
        parts = recording_call.seconds()
        assert list(parts) == list(dict.fromkeys(RECORDING_CALL_STEPS))
        assert sum(parts.values()) <= ended - started
        assert entry.unanalysed.seconds == pytest.approx(sum(parts.values()) - parts["prepare"], rel=0.05)
        with instrumentation.timing() as second_call:
            started = time.perf_counter()
            second = step(x)
            ended = time.perf_counter()
        assert torch.equal(second, x + 1.5 - 0.25)
        assert [s.name for s in second_call.steps] == ["analyse", "build replay"]
        assert _in_order_inside(second_call.steps, started, ended)
        # the block over, timing is off again
        assert instrumentation.steps is instrumentation.NOT_TIMING
    finally:
        session.close()
