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


def _paused_inside_its_capture(capturing, proceed):
    """A region that, while it is being captured, says so and waits to be let go."""

    def shifted_twice_after_a_pause(x):
        if torch.cuda.is_current_stream_capturing():
            capturing.set()
            assert proceed.wait(30)
        return _shifted_twice(x)

    return shifted_twice_after_a_pause


def test_eager_draws_in_another_thread_wait_for_a_recording_inside_the_capture_exclusion():
    """A capture registers the default CUDA generator (torch's capture_begin does, for every
    graph) and keeps it in capture mode until it ends: a draw on it in another thread, outside
    any capture, raises torch's "Offset increment outside graph capture encountered
    unexpectedly" meanwhile. Drawn inside ``jitcore.recorder.CAPTURES.shared()`` (what the
    session's own eager runs hold), the draw waits for the recording and then draws the numbers
    the generator would have given it in the first place; a generator of one's own is never
    registered and draws at once."""
    import threading

    x = torch.randn(4, 300, device="cuda")
    _shifted_twice(x)  # the jit's compile, outside any recording
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    seed, offset = generator.initial_seed(), generator.get_offset()
    capturing, proceed, drawn = threading.Event(), threading.Event(), []
    session = replay.capture(record_after=0)
    try:
        step = session.region(_paused_inside_its_capture(capturing, proceed))
        recorded = []
        recorder = threading.Thread(target=lambda: recorded.append(step(x)))
        recorder.start()
        assert capturing.wait(30)
        with pytest.raises(RuntimeError, match="Offset increment outside graph capture encountered unexpectedly"):
            torch.randn(8, device="cuda")  # torch's answer, unprotected
        own = torch.Generator(device="cuda")
        own.manual_seed(7)
        assert torch.randn(8, device="cuda", generator=own).shape == (8,)  # never registered: at once

        def protected_draw():
            with jc.recorder.CAPTURES.shared():
                drawn.append(torch.randn(1024, device="cuda"))

        drawer = threading.Thread(target=protected_draw)
        drawer.start()
        time.sleep(0.2)
        assert not drawn  # waiting for the recording
        proceed.set()
        recorder.join(30)
        drawer.join(30)
        assert torch.equal(recorded[0], x + 1.5 - 0.25) and session.stats().records == 1
        expected = torch.Generator(device="cuda")
        expected.manual_seed(seed)
        expected.set_offset(offset)  # the draw comes first from where the generator stood
        assert torch.equal(drawn[0], torch.randn(1024, device="cuda", generator=expected))
        assert generator.get_offset() == expected.get_offset()
    finally:
        proceed.set()
        session.close()


def test_eager_draws_inside_the_exclusion_never_meet_the_recordings_of_another_thread():
    """Many recordings in one thread, eager draws in another inside the capture exclusion:
    every draw succeeds, every recording is exact, and the draws are the default generator's
    stream in order (the recordings draw nothing)."""
    import threading

    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    shapes = [torch.randn(rows, 300, device="cuda") for rows in range(1, 25)]
    _shifted_twice(shapes[0])  # the jit's compile, outside any recording
    seed, offset = generator.initial_seed(), generator.get_offset()  # after the draws of the shapes
    drawn, results, stop = [], [], threading.Event()

    def draw():
        while not stop.is_set():
            with jc.recorder.CAPTURES.shared():
                drawn.append(torch.randn(256, device="cuda"))

    session = replay.capture(record_after=0)
    try:
        step = session.region(_shifted_twice)
        drawer = threading.Thread(target=draw)
        drawer.start()
        try:
            for x in shapes:
                results.append((x, step(x)))
        finally:
            stop.set()
            drawer.join(30)
        assert session.stats().records == len(shapes) and drawn
        for x, out in results:
            assert torch.equal(out, x + 1.5 - 0.25)
        expected = torch.Generator(device="cuda")
        expected.manual_seed(seed)
        expected.set_offset(offset)
        for value in drawn:
            assert torch.equal(value, torch.randn(256, device="cuda", generator=expected))
    finally:
        session.close()
