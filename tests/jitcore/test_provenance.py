"""What the recorder hook tells the replay layer (CPU, null backend): pointer offsets and launch
configurations that depend on runtime scalars, with evaluators for new argument values, and
launches skipped for an empty grid."""

from __future__ import annotations

import enum
import struct

import numpy as np
import pytest
import torch

import jitcore as jc
from jitcore import recorder
from jitcore.backends import use_backend

from .fakes import PACKINGS, CountingBackend, ListRecorder, track_layouts


@pytest.fixture(params=PACKINGS)
def backend(request):
    fake = CountingBackend(packed=request.param == "packed")
    with use_backend(fake):
        yield fake


def new_kernel(backend, source: str, name: str):
    kernel = jc.Kernel(source, name)
    track_layouts(backend, kernel.instantiate())
    return kernel


def record(launch, *args):
    hook = ListRecorder()
    with recorder.recording(hook):
        launch(*args)
    return hook.records


WRITE = "__global__ void write(float* row, float value, long long n) {}"


def make_writer(backend):
    kernel = new_kernel(backend, WRITE, "write")

    @jc.jit
    def write_row(cache, pos, n, value):
        row = cache[pos]
        kernel[jc.cdiv(n, 64), 64](row, value * 2.0, n)

    return write_row


@pytest.mark.parametrize("as_", [list, tuple, dict])
def test_pointer_offset_and_grid_from_runtime_scalars(backend, as_):
    write_row = make_writer(backend)
    cache = torch.zeros(8, 16)
    write_row(cache, 3, 100, 1.0)  # compile outside the recording
    (launch,) = record(write_row, cache, 3, 100, 1.0)
    assert launch.launched is True and launch.grid == (2, 1, 1)

    def scalars(**values):
        full = [cache, values.get("pos", 3), values.get("n", 100), values.get("value", 1.0)]
        return dict(enumerate(full)) if as_ is dict else as_(full)

    pointer, value, n = launch.params
    assert pointer.kind == "pointer" and pointer.arg_index == 0
    assert pointer.byte_offset == 3 * 16 * 4
    assert pointer.offset_scalar_args == (1,)
    assert pointer.offset_evaluate(scalars(pos=5)) == 5 * 16 * 4
    assert pointer.offset_evaluate(scalars(pos=-1)) == 7 * 16 * 4  # torch's negative index
    assert pointer.offset_evaluate({1: 0}) == 0  # only the indices it depends on are read
    assert value.kind == "scalar" and value.scalar_args == (3,)
    assert value.evaluate(scalars(value=4.0)) == 8.0 and value.expression == "({3} * 2.0)"
    assert n.kind == "scalar" and n.evaluate(scalars(n=7)) == 7
    (grid,) = launch.dynamic_config
    assert isinstance(grid, recorder.ConfigRecord)
    assert (grid.field, grid.scalar_args) == ("grid_x", (2,))
    assert [grid.evaluate(scalars(n=m)) for m in (1, 64, 65, 130, 0)] == [1, 1, 2, 3, 0]
    assert grid.expression == "cdiv({2}, 64)"


def test_offsets_from_sizes_only_have_no_evaluator(backend):
    kernel = new_kernel(backend, WRITE, "write")

    @jc.jit
    def last_row(cache, n):
        kernel[1, 64](cache[-1], 1.0, n)

    cache = torch.zeros(8, 16)
    last_row(cache, 4)
    (launch,) = record(last_row, cache, 4)
    pointer = launch.params[0]
    assert pointer.byte_offset == 7 * 16 * 4 and pointer.offset_scalar_args == () and pointer.offset_evaluate is None
    assert launch.dynamic_config == ()


def test_offset_depending_on_a_runtime_scalar_and_a_dynamic_stride(backend):
    kernel = new_kernel(backend, WRITE, "write")

    @jc.jit
    def column_block(cache, pos, start):
        view = cache[pos, start:]
        kernel[1, 64](view, 1.0, view.shape[0])

    cache = torch.zeros(6, 10)
    column_block(cache, 2, 3)
    (launch,) = record(column_block, cache, 2, 3)
    pointer = launch.params[0]
    assert pointer.byte_offset == (2 * 10 + 3) * 4 and pointer.offset_scalar_args == (1, 2)
    assert pointer.offset_evaluate([None, 4, 1]) == (4 * 10 + 1) * 4  # the recorded stride, 10
    assert launch.params[2].kind == "scalar" and launch.params[2].evaluate([None, 4, 1]) == 9


def test_block_and_shared_from_runtime_scalars(backend):
    kernel = new_kernel(backend, WRITE, "write")

    class Width(enum.IntEnum):
        WARP = 32

    @jc.jit
    def launch(x, warps, extra):
        kernel[(2, warps), warps * Width.WARP, extra * 4 + x.shape[0]](x, 1.0, 1)

    x = torch.zeros(16)
    launch(x, 2, 8)
    (record_,) = record(launch, x, 2, 8)
    assert record_.block == (64, 1, 1) and record_.shared_bytes == 48 and record_.grid == (2, 2, 1)
    config = {c.field: c for c in record_.dynamic_config}
    assert set(config) == {"grid_y", "block_x", "shared"}
    assert config["block_x"].evaluate([None, 4, 0]) == 128
    assert config["shared"].evaluate({2: 100}) == 416  # x.shape[0] fixed at 16
    assert config["shared"].scalar_args == (2,) and "16" in config["shared"].expression
    assert config["grid_y"].evaluate({1: 3}) == 3


def test_float_constants_in_evaluators_are_bound_not_pasted(backend):
    kernel = new_kernel(backend, WRITE, "write")

    @jc.jit
    def launch(x, value):
        kernel[1, 64](x, value * np.float64(0.5) + -0.0, 1)

    x = torch.zeros(4)
    launch(x, 3.0)
    (record_,) = record(launch, x, 3.0)
    scalar = record_.params[1]
    assert scalar.evaluate({1: 5.0}) == 2.5
    assert "0.5" in scalar.expression
    assert scalar.encode(2.5) == struct.pack("<f", 2.5)


def test_an_empty_grid_is_reported_as_not_launched(backend):
    write_row = make_writer(backend)
    cache = torch.zeros(8, 16)
    write_row(cache, 3, 100, 1.0)
    backend.calls.clear()
    (launch,) = record(write_row, cache, 3, 0, 1.0)
    assert backend.calls == []  # nothing reached the driver
    assert launch.launched is False and launch.grid == (0, 1, 1)
    assert launch.dynamic_config[0].evaluate({2: 64}) == 1  # replay can still see how to launch it
    assert launch.params[0].byte_offset == 3 * 16 * 4  # the parameters were packed all the same
    (again,) = record(write_row, cache, 3, 64, 1.0)
    assert again.launched is True and len(backend.calls) == 1


def test_a_static_empty_grid_is_reported_as_not_launched(backend):
    kernel = new_kernel(backend, WRITE, "write")

    @jc.jit
    def launch(x):
        kernel[(4, 0), 64](x, 1.0, 1)
        kernel[1, 64](x, 2.0, 2)

    x = torch.zeros(4)
    launch(x)
    backend.calls.clear()
    first, second = record(launch, x)
    assert (first.launched, second.launched) == (False, True)
    assert first.grid == (4, 0, 1) and len(backend.calls) == 1


def test_a_record_holds_the_bytes_that_were_launched(backend):
    # the recording path launches through the same packer as the hot path (the C one where
    # built: PackedLaunch.reporting returns what it packed) and reports those very bytes
    write_row = make_writer(backend)
    cache = torch.randn(8, 16)
    write_row(cache, 3, 100, 1.0)
    for pos, n, value in ((3, 100, 1.0), (5, 7, -2.5), (0, 1, 1e38)):
        backend.calls.clear()
        (launch,) = record(write_row, cache, pos, n, value)
        (call,) = backend.calls
        layout = launch.layout
        assert len(launch.param_bytes) == layout.size
        for index, launched in enumerate(call[7]):
            at = layout.offsets[index]
            assert launch.param_bytes[at : at + len(launched)] == launched, index
        assert struct.unpack_from("<Q", launch.param_bytes, layout.offsets[0])[0] == cache[pos].data_ptr()


def test_launches_with_pointers_at_the_same_offsets_share_one_params_tuple(backend):
    # replay makes its views of a launch's parameters once per tuple (replay.recording)
    write_row = make_writer(backend)
    cache = torch.zeros(8, 16)
    write_row(cache, 3, 100, 1.0)
    (first,) = record(write_row, cache, 3, 100, 1.0)
    (second,) = record(write_row, torch.zeros(8, 16), 3, 64, 2.0)  # another tensor, same row
    (other,) = record(write_row, cache, 5, 100, 1.0)
    assert second.params is first.params
    assert other.params is not first.params and other.params[0].byte_offset == 5 * 16 * 4
    assert first.params[0].byte_offset == 3 * 16 * 4 and other.params[1:] == first.params[1:]
    (again,) = record(write_row, cache, 5, 1, 1.0)
    assert again.params is other.params


def test_a_one_launch_state_with_a_static_empty_grid_reports_its_packed_bytes(backend):
    kernel = new_kernel(backend, WRITE, "write")

    @jc.jit
    def launch(x, value):
        kernel[(4, 0), 64](x, value, 1)

    x = torch.zeros(4)
    launch(x, 1.0)
    (first,) = record(launch, x, 2.0)
    assert backend.calls == [] and first.launched is False
    assert struct.unpack_from("<f", first.param_bytes, first.layout.offsets[1])[0] == 2.0


def test_a_value_refused_while_recording_names_its_argument_and_reports_nothing(backend):
    write_row = make_writer(backend)
    cache = torch.zeros(8, 16)
    write_row(cache, 3, 100, 1.0)
    backend.calls.clear()
    hook = ListRecorder()
    with recorder.recording(hook), pytest.raises(jc.ArgumentError, match="does not fit"):
        write_row(cache, 3, 100, 3e38)  # value * 2.0 overflows the kernel's float
    assert hook.records == [] and backend.calls == []


def test_a_record_with_other_arguments_keeps_every_other_field(backend):
    """``LaunchRecord.with_args`` (how replay drops a capture's tensors from the records it
    keeps) changes ``args`` and nothing else, and leaves the record it copies alone."""
    write_row = make_writer(backend)
    cache = torch.zeros(4, 64)
    (launch,) = record(write_row, cache, 2, 64, 1.5)
    assert launch.args[0] is cache
    kept = launch.with_args((None, 2, 64, 1.5))
    assert kept == launch.replace(args=(None, 2, 64, 1.5)) and kept is not launch
    assert type(kept) is recorder.LaunchRecord
    for name in recorder.LaunchRecord._fields:
        if name != "args":
            assert getattr(kept, name) is getattr(launch, name), name
    assert launch.args[0] is cache and kept.args == (None, 2, 64, 1.5)
