"""Launch records made in C beside the packed launch (``PackedLaunch.recorded``), for a recorder
with a ``launch_sink``: the same records, field for field, as the call state's Python report
makes for a recorder without one (CPU, the null backend packing in C)."""

from __future__ import annotations

import pytest
import torch

import jitcore as jc
from jitcore import recorder
from jitcore.backends import use_backend

from .fakes import PACKINGS, CountingBackend, ListRecorder, track_layouts

pytestmark = pytest.mark.skipif("packed" not in PACKINGS, reason="jitcore.backends._native is not built here")


class SinkRecorder(ListRecorder):
    """A recorder that takes records made in C: its ``launch`` does what the sink does."""

    def __init__(self, tail=None):
        super().__init__()
        self.nodes = []
        self.tail = tail
        self.launch_sink = (self.records, self.nodes, tail)

    def launch(self, record):
        self.records.append(record)
        nodes = self.tail(record.stream) if record.launched and self.tail is not None else None
        self.nodes.append(nodes[0] if nodes and len(nodes) == 1 else None)


@pytest.fixture
def backend():
    fake = CountingBackend(packed=True)
    with use_backend(fake):
        yield fake


def kernel_of(backend, source: str, name: str):
    kernel = jc.Kernel(source, name)
    track_layouts(backend, kernel.instantiate())
    return kernel


AFFINE = "__global__ void affine(const float* x, float* y, float a, float b, long long n) {}"
WRITE = "__global__ void write(float* row, float value, long long n) {}"


def launchers(backend):
    affine_kernel = kernel_of(backend, AFFINE, "affine")
    write_kernel = kernel_of(backend, WRITE, "write")

    @jc.jit
    def affine(x, y, a, b):
        n = x.numel()
        affine_kernel[jc.cdiv(n, 256), 256](x, y, a, b, n)

    @jc.jit
    def shifted(x, y, a):  # pointers at offsets computed from sizes
        affine_kernel[1, 64](x[1:], y[2:], a, 0.5, x.numel() - 2)

    @jc.jit
    def write_row(cache, pos, n, value):  # a pointer offset and a grid from runtime scalars
        write_kernel[jc.cdiv(n, 64), 64](cache[pos], value * 2.0, n)

    return affine, shifted, write_row


def records_of(launch, args, hook):
    with recorder.recording(hook):
        launch(*args)
    return hook


def assert_same_records(made_in_c, made_in_python):
    assert len(made_in_c) == len(made_in_python)
    for a, b in zip(made_in_c, made_in_python):
        assert type(a) is type(b) is recorder.LaunchRecord
        for name in recorder.LaunchRecord._fields:
            assert getattr(a, name) == getattr(b, name), name
            assert type(getattr(a, name)) is type(getattr(b, name)), name
        assert a.params is b.params  # one params tuple per offsets, whichever way the record was made
        assert a.args is not None


def test_records_made_in_c_are_the_python_reports_field_for_field(backend):
    affine, shifted, write_row = launchers(backend)
    x, y, cache = torch.randn(64), torch.empty(64), torch.zeros(8, 16)
    calls = [
        (affine, (x, y, 1.5, -0.25)),
        (affine, (torch.randn(0), torch.empty(0), 1.0, 0.0)),  # an empty grid: reported, not launched
        (shifted, (x, y, 2.0)),
        (write_row, (cache, 3, 100, 1.0)),
        (write_row, (cache, 5, 0, 1.0)),
    ]
    for launch, args in calls:
        launch(*args)  # compiled outside the recording
    for launch, args in calls:
        python = records_of(launch, args, ListRecorder())  # no sink: the Python report, which makes templates
        in_c = records_of(launch, args, SinkRecorder())
        again = records_of(launch, args, SinkRecorder())
        assert_same_records(in_c.records, python.records)
        assert_same_records(again.records, python.records)
    assert [r.launched for r in records_of(affine, calls[1][1], SinkRecorder()).records] == [False]


def test_a_launch_records_itself_only_where_its_record_serves_every_call(backend):
    affine, shifted, write_row = launchers(backend)
    x, y, cache = torch.randn(64), torch.empty(64), torch.zeros(8, 16)
    for launch, args in ((affine, (x, y, 1.0, 0.0)), (shifted, (x, y, 1.0)), (write_row, (cache, 1, 10, 1.0))):
        launch(*args)
        state = next(iter(launch.jit.states.values())).call_state
        assert state._templates == [None]
        records_of(launch, args, SinkRecorder())
        # pointer offsets computed from sizes (shifted) or from a runtime scalar (write_row) vary
        # from call to call: those launches are reported by the call state's Python
        assert (state._templates[0] is None) == (launch is not affine)


def test_the_sink_notes_the_node_each_launch_became_as_a_recorders_launch_would(backend):
    affine, _, _ = launchers(backend)
    x, y = torch.randn(64), torch.empty(64)
    affine(x, y, 1.0, 0.0)
    asked = []

    def tail(stream):
        asked.append(stream)
        return (0xAB,) if len(asked) == 1 else (1, 2) if len(asked) == 2 else None

    hook = SinkRecorder(tail)
    records_of(affine, (x, y, 1.0, 0.0), hook)  # the first report makes the template, through launch()
    for _ in range(3):  # then in C: one node, two nodes (unknown: None), no answer
        records_of(affine, (x, y, 1.0, 0.0), hook)
    records_of(affine, (torch.randn(0), torch.empty(0), 1.0, 0.0), hook)  # empty: tail not asked
    assert hook.nodes == [0xAB, None, None, None, None]
    assert len(asked) == 4 and len(hook.records) == 5


def affine_with_its_template(backend):
    """The affine launcher called once and once recorded (its record template made), its
    arguments and its call state."""
    affine, _, _ = launchers(backend)
    x, y = torch.randn(64), torch.empty(64)
    affine(x, y, 1.0, 0.0)
    state = next(iter(affine.jit.states.values())).call_state
    records_of(affine, (x, y, 1.0, 0.0), SinkRecorder())
    assert state._templates[0] is not None
    return affine, x, y, state


def test_a_new_drift_check_is_carried_by_the_records_made_after_it(backend):
    affine, x, y, state = affine_with_its_template(backend)

    def check():
        return None

    state.check_globals = check
    assert state._templates[0] is None  # the template carried the old check
    for _ in range(2):
        (record,) = records_of(affine, (x, y, 1.0, 0.0), SinkRecorder()).records
        assert record.check_globals is check


def test_recorded_checks_the_sink_and_the_template_before_launching(backend):
    _affine, x, y, state = affine_with_its_template(backend)
    launcher, template = state.namespace["_L0"], state._templates[0]
    values = (x, y, 1.0, 0.0, 64)
    launched = len(backend.calls)
    good = ([], [], None)
    for sink, record, error in [
        ([], template, TypeError),  # not a tuple
        (([], [], None, None), template, TypeError),
        (((), [], None), template, TypeError),  # records not a list
        (([], (), None), template, TypeError),  # nodes neither a list nor None
        (([], [], 3), template, TypeError),  # tail not callable
        (good, tuple(template), TypeError),  # not a LaunchRecord
    ]:
        with pytest.raises(error):
            launcher.recorded(sink, record, (), 1, 1, 1, 256, 1, 1, 0, 0, *values)
    with pytest.raises(TypeError):
        launcher.recorded(good, template, ())
    assert len(backend.calls) == launched and good == ([], [], None)
    launcher.recorded(good, template, ("args",), 1, 1, 1, 256, 1, 1, 0, 7, *values)
    (record,) = good[0]
    assert (record.grid, record.block, record.shared_bytes, record.stream) == ((1, 1, 1), (256, 1, 1), 0, 7)
    assert record.args == ("args",) and record.launched is True and good[1] == [None]
    assert len(backend.calls) == launched + 1
