"""Pieces of replay.recording that need a GPU (the capture itself is tested through sessions,
in test_replay_gpu.py and test_hazards_gpu.py)."""

from __future__ import annotations

import time

import pytest
import torch

import jitcore as jc
import replay
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


#: What a recording call times, in the order its steps run (benchmarks/replay.py reports them).
RECORDING_CALL_STEPS = [
    "prepare",
    "region",
    "capture begin, checks, end",
    "pool snapshot",
    "own outputs",
    "extents and records",
    "instantiate",
]


def test_a_recording_times_its_steps_apart_and_they_fit_inside_its_call():
    x = torch.randn(4, 300, device="cuda")
    _shifted_twice(x)  # the jit's compile, outside the recording
    session = replay.capture(record_after=0)
    try:
        step = session.region(_shifted_twice)
        torch.cuda.synchronize()
        started = time.perf_counter()
        first = step(x)
        torch.cuda.synchronize()
        call = time.perf_counter() - started
        assert torch.equal(first, x + 1.5 - 0.25)
        (entry,) = step.entries.values()
        capture = entry.unanalysed
        timings = dict(capture.timings)
        assert list(timings) == RECORDING_CALL_STEPS
        assert all(seconds >= 0 for seconds in timings.values())
        # none inside another: together they fit in the call, and the capture's seconds (the
        # session's capture_seconds) are its steps after prepare
        assert sum(timings.values()) <= call
        assert capture.seconds == pytest.approx(sum(timings.values()) - timings["prepare"], rel=0.05)
        second = step(x)
        assert torch.equal(second, x + 1.5 - 0.25)
        assert list(entry.graph.capture.timings) == [*RECORDING_CALL_STEPS, "analyse", "build replay"]
    finally:
        session.close()
