"""The jit core's logic on the CPU, with a driver test double (GPU tests run the real one)."""

from __future__ import annotations

import ctypes
import struct
import sys
import threading
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore import recorder
from jitcore.backends import use_backend
from jitcore.errors import (
    ArgumentError,
    CaptureMissError,
    DeviceError,
    GlobalDriftError,
    LaunchConfigError,
    LayoutError,
    SymbolicValueError,
    UnsupportedTensorError,
)
from jitcore.recorder import CaptureBusy, CaptureExclusion

from .fakes import PACKINGS, CountingBackend, ListRecorder, track_layouts

AXPY = r"""
template <typename T>
__global__ void axpy(const T* __restrict__ x, const T* __restrict__ y, T* __restrict__ out, T alpha, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = alpha * x[i] + y[i];
}
"""
ROWS = r"""
__global__ void rows(const float* x, float* out, int rows, int cols, long long row_stride, bool flag) {}
"""
axpy = jc.Kernel(AXPY, "axpy")
rows_kernel = jc.Kernel(ROWS, "rows")
BLOCK = 256


@pytest.fixture(params=PACKINGS)
def backend(request):
    fake = CountingBackend(packed=request.param == "packed")
    with use_backend(fake):
        yield fake


def make_axpy():
    @jc.jit
    def launch_axpy(x, y, out, alpha):
        n = x.numel()
        axpy.instantiate(x.dtype)[jc.cdiv(n, BLOCK), BLOCK](x, y, out, alpha, n)

    return launch_axpy


def unpack(fmt: str, raw: bytes):
    return struct.unpack("<" + fmt, raw)[0]


def test_hit_path_packs_pointers_scalars_and_sizes(backend):
    launch = make_axpy()
    x, y, out = torch.randn(1000), torch.randn(1000), torch.empty(1000)
    launch(x, y, out, 2.5)
    track_layouts(backend, axpy.instantiate(torch.float32))
    backend.calls.clear()
    launch(x, y, out, 2.5)
    x2 = torch.randn(3000)
    launch(x2, y, out, -1.0)
    assert launch.cache_info().compiles == 1  # layout-dynamic: one call state for both sizes
    (_, grid1, block1, *_r1, params1), (_, grid2, _b, *_r2, params2) = (c[:3] + c[3:6] + (c[7],) for c in backend.calls)
    assert grid1 == (4, 1, 1) and block1 == (256, 1, 1) and grid2 == (12, 1, 1)
    assert [unpack("Q", params1[i]) for i in range(3)] == [x.data_ptr(), y.data_ptr(), out.data_ptr()]
    assert unpack("f", params1[3]) == 2.5 and unpack("q", params1[4]) == 1000
    assert unpack("Q", params2[0]) == x2.data_ptr() and unpack("f", params2[3]) == -1.0
    assert unpack("q", params2[4]) == 3000


def test_views_carry_their_element_offset_and_dynamic_strides(backend):
    @jc.jit
    def launch_rows(x, out, flag: jc.Constexpr[bool]):
        view = x[1:, 2:]
        rows_kernel[view.shape[0], 32](view, out, view.shape[0], view.shape[1], view.stride(0), flag)

    x, out = torch.randn(6, 10), torch.empty(60)
    launch_rows(x, out, True)
    track_layouts(backend, rows_kernel.instantiate())
    backend.calls.clear()
    launch_rows(x, out, True)
    params = backend.calls[0][7]
    assert unpack("Q", params[0]) == x.data_ptr() + (1 * 10 + 2) * 4
    assert [unpack("i", params[2]), unpack("i", params[3]), unpack("q", params[4])] == [5, 8, 10]
    assert unpack("?", params[5]) is True
    wide = torch.randn(4, 12)
    launch_rows(wide, out, True)
    assert unpack("Q", backend.calls[-1][7][0]) == wide.data_ptr() + (12 + 2) * 4
    assert unpack("q", backend.calls[-1][7][4]) == 12
    launch_rows(x, out, False)  # a Constexpr value is part of the key
    assert launch_rows.cache_info().compiles == 2


def test_static_adaptors_compile_once_per_shape(backend):
    launch = make_axpy()
    for n in (128, 256, 128, 256):
        x = torch.randn(n)
        launch(jc.from_dlpack(x), jc.from_dlpack(x), jc.from_dlpack(torch.empty(n)), 1.0)
    assert launch.cache_info().compiles == 2
    for n in (64, 512):
        launch(torch.randn(n), torch.randn(n), torch.empty(n), 1.0)
    assert launch.cache_info().compiles == 3


def test_constants_are_written_once_and_never_rewritten(backend):
    @jc.jit
    def launch_const(x, out):
        rows_kernel[1, 32](x, out, 7, 9, 11, False)

    x, out = torch.randn(8), torch.empty(8)
    launch_const(x, out)
    state = launch_const.jit.states[next(iter(launch_const.jit.states))].call_state
    hot = state.source.split("\n\n")[0]  # the run function (the recording variant follows it)
    if backend._packed:  # the constants live in the packed launch's template, copied each call
        call = hot.split("_L0(")[1].split("\n")[0]
        assert hot.count("_L0(") == 1 and ", 7," not in call and "False" not in call
        track_layouts(backend, rows_kernel.instantiate())
        launch_const(x, out)
        types = rows_kernel.instantiate().layout.types
        packed = backend.calls[-1][7]
        assert [packed[i] for i in range(2, 6)] == [
            struct.pack("<" + types[i].fmt, v) for i, v in zip(range(2, 6), (7, 9, 11, False))
        ]
        return
    assert hot.count("_pack0_") == 1 and ", 7," not in hot.split("_pack0_0(")[1]
    # scribble over the constant's slot, found through the void* array the driver was given
    params = backend.calls[-1][5]
    slot = ctypes.c_void_p.from_address(params + 2 * ctypes.sizeof(ctypes.c_void_p)).value
    ctypes.c_int.from_address(slot).value = 12345
    track_layouts(backend, rows_kernel.instantiate())
    launch_const(x, out)
    assert unpack("i", backend.calls[-1][7][2]) == 12345  # the call did not touch it


# --- errors raised before any GPU work, and nothing left half-built --------------------------
def assert_nothing_built(launch, before):
    assert launch.cache_info().states == before


def test_wrong_argument_count_and_unknown_keyword(backend):
    launch = make_axpy()
    x = torch.randn(4)
    with pytest.raises(TypeError, match="launch_axpy"):
        launch(x, x, x)
    with pytest.raises(TypeError, match="unexpected keyword argument 'beta'"):
        launch(x, x, x, 1.0, beta=2)
    assert_nothing_built(launch, 0)
    assert backend.calls == []


def test_wrong_kernel_argument_count_names_the_kernel(backend):
    @jc.jit
    def bad(x):
        axpy.instantiate(x.dtype)[1, 32](x, x)

    with pytest.raises(ArgumentError, match=r"axpy<float> takes 5 arguments .*got 2"):
        bad(torch.randn(4))
    assert_nothing_built(bad, 0)


def test_cpu_tensor_and_other_device_are_device_errors():
    fake = CountingBackend(device_name="cuda:0", device=0)
    with use_backend(fake):
        launch = make_axpy()
        with pytest.raises(DeviceError, match="parameter 'x' is a CPU tensor"):
            launch(torch.randn(4), torch.randn(4), torch.randn(4), 1.0)
        assert_nothing_built(launch, 0)
        assert fake.calls == []


def test_cpu_tensors_without_a_usable_gpu_are_jitcores_device_error_first():
    """The backend this machine selects, for real: where torch has no CUDA (or no vendor binding
    is installed) the user's mistake is still the CPU tensor, and jitcore's error says so on
    top, with torch's complaint only in its text; on a GPU machine the same DeviceError comes
    from the trace."""
    launch = make_axpy()
    with pytest.raises(DeviceError, match="parameter 'x' is a CPU tensor") as raised:
        launch(torch.randn(4), torch.randn(4), torch.randn(4), 1.0)
    assert raised.value.__cause__ is None and raised.value.__suppress_context__
    assert_nothing_built(launch, 0)


class NoDeviceBackend(CountingBackend):
    def current_device(self):
        raise AssertionError("Torch not compiled with CUDA enabled")


def test_a_launcher_without_tensors_and_no_usable_gpu_is_a_device_error():
    @jc.jit
    def scalars_only(n):
        rows_kernel[1, 32](0, 0, n, n, n, True)

    with use_backend(NoDeviceBackend()):
        with pytest.raises(DeviceError, match="scalars_only: no GPU device is usable here: Torch not") as raised:
            scalars_only(4)
        assert isinstance(raised.value.__cause__, AssertionError)
        with pytest.raises(DeviceError, match="parameter 'x' is a CPU tensor, but kernels launch on a GPU"):
            make_axpy()(torch.randn(4), torch.randn(4), torch.randn(4), 1.0)


def test_dtype_the_kernel_cannot_take(backend):
    @jc.jit
    def mixed(x, out):
        axpy.instantiate(torch.float32)[1, 32](x, x, out, 1.0, 4)

    with pytest.raises(ArgumentError, match=r"argument 0 \(const float\* __restrict__ x\).*dtype float16"):
        mixed(torch.randn(4).half(), torch.empty(4))
    assert_nothing_built(mixed, 0)


def test_tensor_without_unit_stride_axis(backend):
    launch = make_axpy()
    strided = torch.randn(16)[::2]
    with pytest.raises(LayoutError, match="from_dlpack"):
        launch(strided, strided, strided, 1.0)
    assert_nothing_built(launch, 0)


@pytest.mark.parametrize(
    "value, match", [("text", "unsupported argument type str"), (1 + 2j, "complex"), ([1.0], "list")]
)
def test_unsupported_scalar_type(backend, value, match):
    launch = make_axpy()
    x = torch.randn(4)
    with pytest.raises(ArgumentError, match=f"parameter 'alpha'.*{match}"):
        launch(x, x, x, value)
    assert_nothing_built(launch, 0)


def test_int_into_float_parameter_is_fine_float_into_int_is_not(backend):
    @jc.jit
    def launch_n(x, out, n):
        rows_kernel[1, 32](x, out, n, 1, 1, False)

    x = torch.randn(4)
    launch_n(x, x, 3)
    with pytest.raises(ArgumentError, match="is a float; the parameter is an integer"):
        launch_n(x, x, 3.0)
    launch(make_axpy(), x, 1)


def launch(fn, x, alpha):
    fn(x, x, x, alpha)


@pytest.mark.parametrize(
    "grid, block, shared, match",
    [
        (-1, 32, 0, "grid dimension x is -1"),
        ((1, 70000), 32, 0, "grid dimension y"),
        (1, 2048, 0, "block dimension x"),
        (1, (32, 32, 2), 0, "1024 threads|2048 threads"),
        (1, 32, 10**7, "shared memory"),
        (1, 32, -1, "shared memory"),
        ((1, 1, 1, 1), 32, 0, "tuple of 1 to 3"),
        (1.5, 32, 0, "must be ints"),
    ],
)
def test_launch_configuration_limits(backend, grid, block, shared, match):
    @jc.jit
    def bad(x):
        rows_kernel[grid, block, shared](x, x, 1, 1, 1, False)

    with pytest.raises(LaunchConfigError, match=match):
        bad(torch.randn(4))
    assert_nothing_built(bad, 0)


def test_dynamic_grid_of_zero_is_a_skipped_launch(backend):
    launch = make_axpy()
    launch(torch.randn(8), torch.randn(8), torch.empty(8), 1.0)
    calls = len(backend.calls)
    launch(torch.randn(0), torch.randn(0), torch.empty(0), 1.0)  # cdiv(0, 256) == 0: nothing to do
    assert len(backend.calls) == calls and launch.cache_info().compiles == 1


def test_symbolic_value_in_control_flow_names_the_expression(backend):
    @jc.jit
    def branchy(x, out):
        if x.shape[0] > 4:
            rows_kernel[1, 32](x, out, 1, 1, 1, False)

    with pytest.raises(SymbolicValueError, match=r"x\.shape\[0\].*from_dlpack.*Constexpr"):
        branchy(torch.randn(8), torch.empty(8))
    assert_nothing_built(branchy, 0)
    branchy(jc.from_dlpack(torch.randn(8)), torch.empty(8))  # static: fine

    @jc.jit
    def to_int(x, out, n):
        rows_kernel[int(n * 2), 32](x, out, 1, 1, 1, False)

    with pytest.raises(SymbolicValueError, match=r"int\(\) of the symbolic value \(n \* 2\)"):
        to_int(torch.randn(8), torch.empty(8), 3)


def test_global_drift_raises_and_keeps_the_cache(backend, monkeypatch):
    launch = make_axpy()
    x = torch.randn(8)
    launch(x, x, x, 1.0)
    monkeypatch.setitem(globals(), "BLOCK", 128)
    with pytest.raises(GlobalDriftError, match="'BLOCK'.*pass it as an argument"):
        launch(x, x, x, 1.0)
    with pytest.raises(GlobalDriftError):  # the miss path checks too
        launch(torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4), 1.0)
    assert launch.cache_info().states == 1
    monkeypatch.setitem(globals(), "BLOCK", 256)
    launch(x, x, x, 1.0)


def test_unsupported_tensors_are_refused_before_work(backend):
    launch = make_axpy()
    z = torch.randn(4, dtype=torch.complex64)
    with pytest.raises(UnsupportedTensorError, match="negative bit"):
        launch(z.conj().imag, torch.randn(4), torch.randn(4), 1.0)
    assert_nothing_built(launch, 0)


def test_tensors_not_passed_as_arguments_are_refused(backend):
    captured = torch.randn(4)

    @jc.jit
    def uses_global_tensor(x):
        axpy.instantiate(x.dtype)[1, 32](x, captured, x, 1.0, 4)

    with pytest.raises(ArgumentError, match="not an argument of the launcher"):
        uses_global_tensor(torch.randn(4))


def test_torch_ops_inside_a_launcher_are_refused(backend):
    @jc.jit
    def does_torch(x):
        torch.add(x, 1)

    with pytest.raises(TypeError, match="runs once, at trace time"):
        does_torch(torch.randn(4))


def test_launchers_may_return_their_arguments(backend):
    @jc.jit
    def returns(x, out):
        rows_kernel[1, 32](x, out, 1, 1, 1, False)
        return out

    x, out = torch.randn(4), torch.empty(4)
    assert returns(x, out) is out
    assert returns(x, out) is out

    @jc.jit
    def returns_view(x, out):
        return out[1:]

    with pytest.raises(ArgumentError, match="may return None or its own tensor arguments"):
        returns_view(x, out)


def test_numpy_scalars_and_bool_scalars(backend):
    @jc.jit
    def launch_np(x, out, n, flag):
        rows_kernel[1, 32](x, out, n, 1, 1, flag)

    x = torch.randn(4)
    launch_np(x, x, np.int32(3), np.bool_(True))
    launch_np(x, x, 3, True)
    assert launch_np.cache_info().compiles == 2


def test_lru_bound(backend):
    @jc.jit(cache_size=2)
    def small(x, n: jc.Constexpr[int]):
        rows_kernel[1, 32](x, x, n, 1, 1, False)

    x = torch.randn(4)
    for n in (1, 2, 1, 3):
        small(x, n)
    info = small.cache_info()
    assert (info.states, info.capacity, info.compiles, info.evictions) == (2, 2, 3, 1)
    keys = [k[-1] for k in small.jit.states]
    assert keys == [("int", 1), ("int", 3)]  # 2 was least recently used


def test_stream_argument(backend):
    launch = make_axpy()
    x = torch.randn(4)

    class FakeStream:
        cuda_stream = 0xABC

    launch(x, x, x, 1.0, stream=FakeStream())
    launch(x, x, x, 1.0, stream=0xDEF)
    assert [c[4] for c in backend.calls[-2:]] == [0xABC, 0xDEF]
    with pytest.raises(TypeError, match="stream="):
        launch(x, x, x, 1.0, stream="default")


def test_launcher_parameter_named_stream_is_refused():
    with pytest.raises(TypeError, match="'stream'"):
        jc.jit(lambda x, stream: None)


def test_dump_shows_generated_source(backend, monkeypatch, capsys):
    monkeypatch.setenv("JITCORE_DUMP", "1")
    launch = make_axpy()
    x = torch.randn(4)
    launch(x, x, x, 1.0)
    printed = capsys.readouterr().out
    assert "def launch_axpy__state0(_a0, _a1, _a2, _a3, /, stream=None):" in printed
    assert "arguments: _a0 = x, _a1 = y, _a2 = out, _a3 = alpha" in printed
    if backend._packed:  # one C call packs and launches, on both paths; the recording path keeps the bytes
        assert "_L0(" in printed and "_p0 = _L0.reporting(" in printed and "_pack0_0(" not in printed
    else:
        assert "_pack0_0(" in printed and "_a0.data_ptr()" in printed
    assert "def launch_axpy(_a0, _a1, _a2, _a3, *, stream=None):" in launch.dump()


def test_compile_returns_a_pinned_handle_without_launching(backend):
    launch = make_axpy()
    x, y, out = torch.randn(16), torch.randn(16), torch.empty(16)
    handle = jc.compile(launch, x, y, out, 2.0)
    assert backend.calls == []
    track_layouts(backend, axpy.instantiate(torch.float32))
    x2 = torch.randn(32)
    handle(x2, y, out, 3.0)
    assert unpack("Q", backend.calls[-1][7][0]) == x2.data_ptr()
    assert unpack("q", backend.calls[-1][7][4]) == 32
    with pytest.raises(TypeError):
        handle(x=x2, y=y, out=out, alpha=3.0)  # positional only
    assert launch.cache_info().states == 1  # shared with the jit function's cache


def test_concurrent_first_calls_compile_once(backend):
    launch = make_axpy()
    barrier = threading.Barrier(8)
    errors = []

    def worker():
        try:
            barrier.wait()
            x = torch.randn(64)
            launch(x, x, x, 1.0)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert launch.cache_info().compiles == 1


def test_concurrent_hits_never_share_a_parameter_buffer(backend):
    launch = make_axpy()
    warm = torch.randn(64)
    launch(warm, warm, warm, 1.0)
    track_layouts(backend, axpy.instantiate(torch.float32))
    backend.calls.clear()
    tensors = {i: torch.randn(64 + i) for i in range(6)}
    barrier = threading.Barrier(len(tensors))
    finished = threading.Barrier(len(tensors))  # keep every thread (and its buffers) alive to the end

    def worker(i):
        barrier.wait()
        for _ in range(300):
            launch(tensors[i], tensors[i], tensors[i], float(i))
        finished.wait()

    threads = [threading.Thread(target=worker, args=(i,)) for i in tensors]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pointer_to_index = {t.data_ptr(): i for i, t in tensors.items()}
    assert len(backend.calls) == 300 * len(tensors)
    for call in backend.calls:
        params = call[7]
        i = pointer_to_index[unpack("Q", params[0])]
        assert unpack("Q", params[2]) == tensors[i].data_ptr()
        assert unpack("f", params[3]) == float(i)
        assert unpack("q", params[4]) == 64 + i
    buffers_by_thread = {call[6]: call[5] for call in backend.calls}
    assert len(set(buffers_by_thread.values())) == len(tensors)


def test_overflowing_scalar_names_the_parameter(backend):
    @jc.jit
    def launch_n(x, n):
        rows_kernel[1, 32](x, x, n, 1, 1, False)

    x = torch.randn(4)
    launch_n(x, 5)
    with pytest.raises(ArgumentError, match=r"argument 2 \(int rows\) of rows gets 8589934592"):
        launch_n(x, 2**33)


# --- the recorder hook (tests/jitcore/fakes.ListRecorder) -----------------------------------------
class Dynamic:
    """A stand-in for replay.dynamic: carries a runtime scalar."""

    def __init__(self, value):
        self.value = value

    def __jit_scalar__(self):
        return self.value


def test_recorder_sees_every_launch_with_provenance(backend):
    @jc.jit
    def two(x, out, scale):
        axpy.instantiate(x.dtype)[1, 32](x[2:], x, out, scale * 2.0, x.numel() - 2)
        rows_kernel[1, 32](x, out, 3, 4, 5, True)

    x, out = torch.randn(10), torch.empty(10)
    two(x, out, 1.5)
    hook = ListRecorder()
    dynamic = Dynamic(0.25)
    with recorder.recording(hook):
        two(x, out, dynamic)
    first, second = hook.records
    assert (first.kernel, second.kernel) == ("axpy<float>", "rows")
    assert first.args[2] is dynamic
    pointer = first.params[0]
    assert (pointer.kind, pointer.arg_index, pointer.byte_offset, pointer.read_only) == ("pointer", 0, 8, True)
    assert first.params[2].read_only is False
    scalar = first.params[3]
    assert scalar.kind == "scalar" and scalar.scalar_args == (2,)
    assert scalar.evaluate({2: 4.0}) == 8.0
    assert scalar.expression == "({2} * 2.0)" and scalar.convert is None
    assert first.check_globals is not None
    assert scalar.encode(8.0) == struct.pack("<f", 8.0)
    assert first.param_bytes[scalar.offset : scalar.offset + 4] == struct.pack("<f", 0.5)
    assert first.params[4].kind == "constant"  # depends on sizes only
    assert unpack("q", first.param_bytes[first.params[4].offset :][:8]) == 8
    assert all(p.kind == "constant" for p in second.params[2:])
    assert hook.misses == []
    # outside the recording block nothing is reported and the fast path is back
    two(x, out, 1.5)
    assert len(hook.records) == 2


def test_recorder_can_refuse_a_miss(backend):
    launch = make_axpy()
    hook = ListRecorder(refuse_miss=True)
    x = torch.randn(4)
    with recorder.recording(hook), pytest.raises(CaptureMissError):
        launch(x, x, x, 1.0)
    assert hook.misses and launch.cache_info().states == 0


# --- the guarded fast path --------------------------------------------------------------------
def test_the_most_recent_state_is_served_by_its_guard(backend):
    launch = make_axpy()
    x = torch.randn(64)
    launch(x, x, x, 1.0)  # miss: builds the state
    launch(x, x, x, 1.0)  # lean hit: promotes it
    guard, run = launch.jit.mru[0]
    assert run is next(iter(launch.jit.states.values()))
    assert guard(x, x, x, 1.0) and guard(torch.randn(7), torch.randn(3), torch.randn(5), 2.0)
    # x is passed three times: one evaluator call each (one call would say no to it)
    assert "_tensor_guard0(_a0)" in guard.source and "_tensor_guard2(_a2)" in guard.source


def test_distinct_tensors_are_guarded_by_one_call(backend):
    launch = make_axpy()
    x, y, out = torch.randn(64), torch.randn(64), torch.randn(64)
    launch(x, y, out, 1.0)
    launch(x, y, out, 1.0)
    guard, _run = launch.jit.mru[0]
    assert "_tensor_guard0(_a0, _a1, _a2)" in guard.source
    assert guard(torch.randn(9), torch.randn(9), torch.randn(9), 2.0)
    assert not guard(x, x, out, 1.0)  # one tensor twice: the key path serves it
    before = launch.cache_info()
    launch(x, x, out, 1.0)  # ... and gets it right: the same state, found by key
    assert launch.cache_info().states == before.states


@pytest.mark.parametrize(
    "change",
    [
        lambda x: (x.double(), x, x, 1.0),
        lambda x: (x.view(8, 8), x, x, 1.0),
        lambda x: (x.view(8, 8).t(), x, x, 1.0),
        lambda x: (torch._neg_view(x), x, x, 1.0),
        lambda x: (x, x, x, 1),
        lambda x: (x, x, x, np.float32(1.0)),
        lambda x: (x.requires_grad_(False).clone().requires_grad_(True), x, x, 1.0),
        lambda x: (jc.from_dlpack(x).mark_layout_dynamic(), x, x, 1.0),
        lambda x: (torch.nn.Parameter(x.clone()), x, x, 1.0),
        lambda x: (x[::2], x, x, 1.0),
    ],
    ids=[
        "dtype",
        "rank",
        "transposed",
        "negative-bit",
        "scalar-type",
        "numpy-scalar",
        "requires-grad",
        "adaptor",
        "parameter-subclass",
        "strided",
    ],
)
def test_the_guard_rejects_what_the_state_was_not_compiled_for(backend, change):
    launch = make_axpy()
    x = torch.randn(64)
    launch(x, x, x, 1.0)
    launch(x, x, x, 1.0)
    guard, _ = launch.jit.mru[0]
    args = change(torch.randn(64))
    assert not guard(*args)


def test_the_guard_checks_the_current_device():
    fake = CountingBackend()
    with use_backend(fake):
        launch = make_axpy()
        x = torch.randn(64)
        launch(x, x, x, 1.0)
        launch(x, x, x, 1.0)
        guard, _ = launch.jit.mru[0]
        assert guard(x, x, x, 1.0)
        fake._device = 3  # as if torch.cuda.set_device(3) had been called (the backend's device reader says 3)
        assert not guard(x, x, x, 1.0)


def test_constexpr_values_are_guarded(backend):
    @jc.jit
    def with_n(x, n: jc.Constexpr[int]):
        rows_kernel[1, 32](x, x, n, 1, 1, False)

    x = torch.randn(4)
    with_n(x, 3)
    with_n(x, 3)
    guard, _ = with_n.jit.mru[0]
    assert guard(x, 3) and not guard(x, 4) and not guard(x, True)


def test_switching_states_keeps_the_lru_order_and_results(backend):
    launch = make_axpy()
    functions = {dtype: axpy.instantiate(dtype) for dtype in (torch.float32, torch.float64)}
    for dtype in (torch.float32, torch.float64):  # compile both, then watch the hits
        launch(torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype), torch.empty(16, dtype=dtype), 1.0)
        track_layouts(backend, functions[dtype])
    backend.calls.clear()
    served, orders = [], []
    for step, dtype in enumerate((torch.float32, torch.float64, torch.float32, torch.float64, torch.float64)):
        x, out = torch.randn(16 + step, dtype=dtype), torch.empty(16 + step, dtype=dtype)
        launch(x, x, out, 2.0)
        served.append(launch.jit.mru[0][1])  # the guarded fast path now holds this call's state
        orders.append([key[1].signature[0] for key in launch.jit.states])  # LRU order, oldest first
        function, *_rest, params = backend.calls[-1][:1] + backend.calls[-1][7:]
        assert function == functions[dtype].function(-1).handle  # the kernel of this call's dtype
        assert unpack("Q", params[0]) == x.data_ptr() and unpack("Q", params[2]) == out.data_ptr()
        assert unpack("d" if dtype == torch.float64 else "f", params[3]) == 2.0
        assert unpack("q", params[4]) == 16 + step
    assert launch.cache_info().compiles == 2 and len(backend.calls) == 5
    assert served[0] is served[2] and served[1] is served[3] is served[4] and served[0] is not served[1]
    assert orders == [
        ["float64", "float32"],
        ["float32", "float64"],
        ["float64", "float32"],
        ["float32", "float64"],
        ["float32", "float64"],
    ]
    assert launch.cache_info().compiles == 2
    assert list(launch.jit.states)[-1][1].signature[0] == "float64"


@st.composite
def guard_tensors(draw):
    shape = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16]))
    tensor = torch.empty(shape, dtype=dtype).permute(*draw(st.permutations(range(len(shape)))))
    return tensor[..., :: draw(st.integers(1, 2))]


_GUARD_TENSORS = guard_tensors()


@settings(max_examples=300, deadline=None)
@given(_GUARD_TENSORS, _GUARD_TENSORS)
def test_property_a_guard_only_accepts_tensors_its_state_fits(first, second):
    fake = CountingBackend()
    with use_backend(fake):

        @jc.jit
        def one(x):
            axpy.instantiate(x.dtype)[1, 32](x, x, x, 1.0, 1)

        try:
            one(first)
            one(first)
        except jc.JitError:
            return  # no unit-stride axis: not launchable layout-dynamic
        guard, run = one.jit.mru[0]
        if run is None:
            return
        state_signature = run.call_state.key[1].signature
        if guard(second):
            dtype, shape_spec, stride_spec, *_ = state_signature
            assert str(second.dtype).removeprefix("torch.") == dtype
            assert second.ndim == len(shape_spec)
            for stride, spec in zip(second.stride(), stride_spec):
                assert spec == "?" or stride == spec


#: The capture exclusion's shared side every way: without a lock (ordered by the GIL), in C
#: (csrc/jitcore_exclusion.c, the same protocol; the default where built) and with the lock (the
#: free-threaded build's).
_BOTH_SHARED_SIDES = pytest.mark.parametrize("lock_free", ["lock-free", "native", "locked"])


def _exclusion(side: str) -> CaptureExclusion:
    if side == "native":
        if recorder._native_shared_side() is None:
            pytest.skip("jitcore._exclusion is not built here (or JITCORE_NATIVE=0)")
        return CaptureExclusion(lock_free=True, native=True)
    return CaptureExclusion(lock_free=side == "lock-free", native=False)


@_BOTH_SHARED_SIDES
def test_capture_exclusion_keeps_shared_work_out_of_a_capture(lock_free):
    exclusion = _exclusion(lock_free)
    events = []
    inside = threading.Event()

    def capture():
        with exclusion.exclusive():
            inside.set()
            with exclusion.shared():  # the capturing thread itself: no wait
                events.append("capture, shared inside")
            time.sleep(0.05)
            events.append("capture ends")

    def compile_():
        inside.wait()
        with exclusion.shared(), exclusion.shared():  # reentrant
            events.append("compile")

    threads = [threading.Thread(target=capture), threading.Thread(target=compile_)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert events == ["capture, shared inside", "capture ends", "compile"]
    with exclusion.shared():  # and an exclusive section waits for shared holders
        got = []

        def exclusive():
            with exclusion.exclusive():
                got.append("exclusive")

        waiter = threading.Thread(target=exclusive)
        waiter.start()
        time.sleep(0.05)
        assert got == []
    waiter.join()
    assert got == ["exclusive"]


@_BOTH_SHARED_SIDES
def test_capture_exclusion_never_lets_shared_and_exclusive_overlap_under_contention(lock_free):
    # four threads take it shared in a tight loop while two take it exclusively: no shared
    # holder is ever inside during an exclusive section, and everything finishes
    exclusion = _exclusion(lock_free)
    inside = [0]
    count_lock = threading.Lock()
    overlaps = []

    def share():
        for _ in range(1500):
            with exclusion.shared():
                with count_lock:
                    inside[0] += 1
                time.sleep(0)  # let another thread run while inside
                with count_lock:
                    inside[0] -= 1
            time.sleep(0.0001)  # and leave gaps for the exclusive sections to start in

    def capture():
        for _ in range(200):
            with exclusion.exclusive():
                for _ in range(3):  # long enough for a shared holder that got in to be seen
                    with count_lock:
                        if inside[0]:
                            overlaps.append(inside[0])
                    time.sleep(0.0002)
                with exclusion.shared():  # the owner itself takes it shared: no wait
                    pass

    threads = [threading.Thread(target=share) for _ in range(4)] + [threading.Thread(target=capture) for _ in range(2)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads switch between almost any two bytecodes
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads) and overlaps == []
    assert exclusion._holders == {} and exclusion._owner is None


@_BOTH_SHARED_SIDES
def test_a_waiting_capture_is_not_held_back_by_a_stream_of_shared_holders(lock_free):
    # two threads take it shared back to back, each entering before the other leaves, so
    # shared holders never all leave at once: a capture must still get in (new shared holders
    # wait for a waiting capture), and a thread already inside may enter again meanwhile
    exclusion = _exclusion(lock_free)
    stop = threading.Event()
    captured = threading.Event()
    reentered = []

    def share():
        while not stop.is_set():
            with exclusion.shared():
                time.sleep(0.001)
                with exclusion.shared():  # inside already: never waits, even for a waiting capture
                    reentered.append(1)

    sharers = [threading.Thread(target=share) for _ in range(2)]
    for t in sharers:
        t.start()
    time.sleep(0.01)

    def capture():
        with exclusion.exclusive():
            captured.set()

    capturer = threading.Thread(target=capture)
    capturer.start()
    assert captured.wait(timeout=10), "the capture waited for the shared holders forever"
    stop.set()
    for t in [*sharers, capturer]:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in [*sharers, capturer]) and reentered
    assert exclusion._holders == {} and exclusion._owner is None


@_BOTH_SHARED_SIDES
def test_capture_exclusion_refuses_exclusive_inside_shared_instead_of_hanging(lock_free):
    exclusion = _exclusion(lock_free)
    with exclusion.shared(), pytest.raises(CaptureBusy):
        with exclusion.exclusive():
            pass
    with exclusion.exclusive():  # and nothing is left held
        pass


# --- the benchmarks' hook: the steps of a hit, each alone ---------------------------------------
def test_hit_path_parts_run_each_step_of_a_hit_alone_and_launch_nothing(backend):
    launch = make_axpy()
    x, out = torch.randn(64), torch.empty(64)
    parts = jc.hit_path_parts(launch, x, x, out, alpha=2.0)  # builds the call state, as a first call would
    assert list(parts) == ["key", "lookup", "drift check", "fill"]
    assert launch.cache_info().compiles == 1 and backend.calls == []
    (key,) = launch.jit.states
    device, elements = parts["key"]()
    assert (device, *elements) == key
    doubles = torch.randn(8, dtype=torch.float64)
    launch(doubles, doubles, torch.empty_like(doubles), 2.0)  # another state, now the most recent
    assert list(launch.jit.states)[-1] != key
    parts["lookup"]()
    assert list(launch.jit.states)[-1] == key  # the lookup touched the LRU as a hit does
    parts["drift check"]()
    parts["fill"]()
    assert len(backend.calls) == 1 and launch.cache_info().compiles == 2  # the float64 call alone launched


def test_hit_path_parts_check_the_launchers_globals(backend, monkeypatch):
    launch = make_axpy()
    x = torch.randn(64)
    parts = jc.hit_path_parts(launch, x, x, x, 2.0)
    monkeypatch.setitem(globals(), "BLOCK", 128)
    with pytest.raises(GlobalDriftError, match="'BLOCK'"):
        parts["drift check"]()


def test_hit_path_parts_needs_a_jit_launcher():
    with pytest.raises(TypeError, match="expects a @jit launcher"):
        jc.hit_path_parts(lambda x: None, 1)


BIASED = jc.Kernel("__global__ void biased(const float* x, const float* bias, float* out, long long n) {}", "biased")


def test_none_for_a_pointer_is_a_null_pointer_with_its_own_call_state(backend):
    @jc.jit
    def launch(x, bias, out):
        BIASED[1, 32](x, bias, out, x.numel())

    track_layouts(backend, BIASED.instantiate())
    x, bias, out = torch.randn(8), torch.randn(8), torch.empty(8)
    for passed in (None, bias, None, None, bias, bias, None):  # the MRU guard flips between both
        backend.calls.clear()
        launch(x, passed, out)
        (call,) = backend.calls
        params = call[7]
        assert unpack("Q", params[0]) == x.data_ptr() and unpack("Q", params[2]) == out.data_ptr()
        assert unpack("Q", params[1]) == (0 if passed is None else bias.data_ptr())
    assert launch.cache_info().compiles == 2  # None and a tensor: two call states
    with pytest.raises(ArgumentError, match=r"argument 3 \(long long n\).*None is only accepted for pointer"):

        @jc.jit
        def sized(x, n, out):
            BIASED[1, 32](x, x, out, n)

        sized(x, None, out)


@_BOTH_SHARED_SIDES
def test_shared_work_that_waits_for_other_shared_work_does_not_deadlock_with_a_waiting_capture(lock_free):
    # A holds it shared and waits for B, which takes it shared only after a capture began to
    # wait (for A): B waits for the capture at most SHARED_PATIENCE, then goes in
    exclusion = _exclusion(lock_free)
    a_inside = threading.Event()
    b_done = threading.Event()
    order = []

    def a():
        with exclusion.shared():
            a_inside.set()
            while not exclusion._waiting:  # the capture has started to wait for A
                time.sleep(0.001)
            worker = threading.Thread(target=b)
            worker.start()
            assert b_done.wait(timeout=10), "shared work waiting for shared work deadlocked with a capture"
            order.append("a")
            worker.join()

    def b():
        with exclusion.shared():
            order.append("b")
        b_done.set()

    def capture():
        a_inside.wait(timeout=10)
        with exclusion.exclusive():
            order.append("capture")

    threads = [threading.Thread(target=a), threading.Thread(target=capture)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    assert not any(t.is_alive() for t in threads)
    assert order == ["b", "a", "capture"]
    assert exclusion._holders == {} and exclusion._owner is None


def test_a_launch_the_driver_refuses_raises_both_ways(backend):
    # struct's path tests the status in Python; a packed launch calls the backend's error itself
    backend.hot_namespace["_null_launch"] = lambda *args: (1,)
    launch = make_axpy()
    with pytest.raises(RuntimeError, match="null launch"):
        launch(torch.randn(64), torch.randn(64), torch.empty(64), 2.0)


# --- a launcher of several launches: every error before the first launch (finding #2) ------------
_INT_TYPES = {
    "signed char": (-(2**7), 2**7 - 1),
    "short": (-(2**15), 2**15 - 1),
    "int": (-(2**31), 2**31 - 1),
    "long long": (-(2**63), 2**63 - 1),
    "unsigned char": (0, 2**8 - 1),
    "unsigned short": (0, 2**16 - 1),
    "unsigned int": (0, 2**32 - 1),
    "unsigned long long": (0, 2**64 - 1),
}
_TAKES = {c_type: jc.Kernel(f"__global__ void takes(float* x, {c_type} n) {{}}", "takes") for c_type in _INT_TYPES}


def _several(backend, c_types: tuple[str, ...]):
    """A launcher launching one kernel per C type, each given the same runtime scalar."""
    track_layouts(backend, *(_TAKES[c].instantiate() for c in c_types))
    kernels = [_TAKES[c] for c in c_types]

    @jc.jit
    def several(x, n):
        for kernel in kernels:
            kernel[1, 32](x, n)

    return several


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(PACKINGS),
    st.lists(st.sampled_from(sorted(_INT_TYPES)), min_size=2, max_size=4),
    st.integers(-(2**64), 2**65),
)
def test_property_a_value_any_launch_refuses_is_refused_before_the_first_launch(packing, c_types, n):
    """A call either makes every launch, each with the value, or raises ArgumentError and
    makes none (each launch packs the same value into its own C type: one that fits the
    first launch's type may overflow a later one's)."""
    backend = CountingBackend(packed=packing == "packed")
    with use_backend(backend):
        several = _several(backend, tuple(c_types))
        x = torch.zeros(4)
        several(x, 0)
        several(x, 0)  # the guarded hit path
        before = len(backend.calls)
        fits = all(low <= n <= high for low, high in (_INT_TYPES[c] for c in c_types))
        if fits:
            several(x, n)
            assert len(backend.calls) == before + len(c_types)
            for call, c_type in zip(backend.calls[before:], c_types):
                assert int.from_bytes(call[7][1], "little", signed=_INT_TYPES[c_type][0] < 0) == n
        else:
            with pytest.raises(ArgumentError, match=r"of takes gets -?\d+ \(launcher argument 'n'\)"):
                several(x, n)
            assert len(backend.calls) == before  # no launch ran
        several(x, 1)  # and the call state is intact
        assert len(backend.calls) == before + len(c_types) * (2 if fits else 1)
        assert several.cache_info().states == 1


@pytest.mark.parametrize(
    "second, value, error",
    [
        pytest.param("grid", -1, LaunchConfigError, id="dynamic-grid"),
        pytest.param("grid", 2**31, LaunchConfigError, id="grid-too-large"),
        pytest.param("block", 0, LaunchConfigError, id="dynamic-block"),
        pytest.param("shared", 1 << 40, LaunchConfigError, id="dynamic-shared"),
        pytest.param("index", 9, IndexError, id="runtime-index"),
        pytest.param("scalar", 2**31, ArgumentError, id="int-overflow"),
        pytest.param("float", 2**24 + 1, ArgumentError, id="inexact-int-for-float"),
    ],
)
def test_an_error_on_a_later_launch_comes_before_the_first_launch(backend, second, value, error):
    first_kernel = jc.Kernel("__global__ void first(float* x, long long n) {}", "first")
    second_kernel = jc.Kernel("__global__ void second(float* x, int n) {}", "second")
    float_kernel = jc.Kernel("__global__ void second_float(float* x, float a) {}", "second_float")
    track_layouts(backend, first_kernel.instantiate(), second_kernel.instantiate(), float_kernel.instantiate())

    @jc.jit
    def two(x, v):
        first_kernel[1, 32](x, 7)
        if second == "grid":
            second_kernel[v, 32](x, 1)
        elif second == "block":
            second_kernel[1, v](x, 1)
        elif second == "shared":
            second_kernel[1, 32, v](x, 1)
        elif second == "index":
            second_kernel[1, 32](x[v], 1)
        elif second == "float":
            float_kernel[1, 32](x, v)
        else:
            second_kernel[1, 32](x, v)

    x = torch.zeros(8)
    good = 1
    two(x, good)
    two(x, good)
    hook = ListRecorder()
    for recording in (False, True):  # the call state and its recording variant (__rec)
        before = len(backend.calls)
        with pytest.raises(error):
            if recording:
                with recorder.recording(hook):
                    two(x, value)
            else:
                two(x, value)
        assert len(backend.calls) == before  # the first launch did not run
        assert hook.records == []
    two(x, good)
    assert len(backend.calls) == before + 2 and two.cache_info().states == 1


# --- tensors whose memory does not hold their values (finding #7, #11) -------------------------
def test_efficient_zero_tensors_are_refused_on_every_path_naming_the_argument(backend):
    """torch._efficientzerotensor (autograd's undefined gradients) has a null data pointer: as
    an input or an output, on a miss, on the lean hit path and after the guarded hit path."""
    launch = make_axpy()
    track_layouts(backend, axpy.instantiate(torch.float32))
    x, y, out = torch.randn(4, 6), torch.randn(4, 6), torch.empty(4, 6)
    zero = torch._efficientzerotensor((4, 6))
    for name, args in (("x", (zero, y, out, 1.0)), ("out", (x, y, zero, 1.0))):
        launch(x, y, out, 1.0)
        launch(x, y, out, 1.0)  # the guarded hit path is warm, and the lean table knows the layout
        before = len(backend.calls)
        for _ in range(2):
            with pytest.raises(UnsupportedTensorError, match=rf"launch_axpy: parameter '{name}': .*efficient zero"):
                launch(*args)
        assert len(backend.calls) == before
    with pytest.raises(UnsupportedTensorError, match="parameter 'x'"):
        jc.compile(launch, zero, y, out, 1.0)
    assert launch.cache_info().states == 1


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_launcher_inside_a_torch_func_transform_is_refused_naming_the_argument(backend, transform):
    """A functorch wrapper passes for a plain tensor in a key and has no data pointer: the
    launcher refuses it with UnsupportedTensorError naming the parameter, not torch's bare
    RuntimeError from data_ptr(), and launches nothing."""
    launch = make_axpy()
    track_layouts(backend, axpy.instantiate(torch.float32))
    base = torch.randn(3, 4)
    launch(base[0], base[0], torch.empty(4), 1.0)
    launch(base[0], base[0], torch.empty(4), 1.0)
    before = len(backend.calls)
    errors = []
    x, out = torch.randn(4), torch.empty(4)

    def inner(row):
        for _ in range(2):
            try:
                launch(x, row, out, 1.0)
            except Exception as error:  # collected: a transform may wrap what escapes it
                errors.append(error)
        return row.sum()

    (torch.func.vmap if transform == "vmap" else torch.func.grad)(inner)(base if transform == "vmap" else base[0])
    assert [type(e) for e in errors] == [UnsupportedTensorError] * 2, errors
    assert all("launch_axpy: parameter 'y'" in str(e) and "torch.func transform" in str(e) for e in errors)
    assert len(backend.calls) == before and launch.cache_info().states == 1


def test_layout_errors_name_the_argument(backend):
    launch = make_axpy()
    with pytest.raises(LayoutError, match=r"launch_axpy: parameter 'out': tensor with strides \(2,\)"):
        launch(torch.randn(4), torch.randn(4), torch.randn(8)[::2], 1.0)


# --- jc.compile binds arguments as the launcher does (finding #11) ---------------------------
def test_compile_applies_the_launchers_defaults_and_keywords(backend):
    kernel = jc.Kernel("__global__ void scaled(float* x, long long n, int block) {}", "scaled")
    track_layouts(backend, kernel.instantiate())

    @jc.jit
    def launch(x, n, block: jc.Constexpr[int] = 128, extra=7):
        kernel[1, block](x, n, extra)

    x = torch.zeros(4)
    handle = jc.compile(launch, x, 3)  # what launch(x, 3) runs: block 128, extra 7
    assert launch.cache_info().states == 1 and backend.calls == []
    handle(x, 5, 128, 7)  # every argument positional, the defaulted ones too
    assert backend.calls[-1][2] == (128, 1, 1)
    assert [unpack(f, raw) for f, raw in zip("Qqi", backend.calls[-1][7])] == [x.data_ptr(), 5, 7]
    launch(x, 3)
    assert launch.cache_info().states == 1  # the state compile built serves the launcher's call
    jc.compile(launch, x, n=3, block=64)(x, 4, 64, 9)
    assert backend.calls[-1][2] == (64, 1, 1) and launch.cache_info().states == 2
    assert unpack("i", backend.calls[-1][7][2]) == 9
    with pytest.raises(TypeError, match=r"jitcore.compile\(launch, ...\): missing a required argument: 'n'"):
        jc.compile(launch, x)
    with pytest.raises(TypeError, match=r"jitcore.compile\(launch, ...\): got an unexpected keyword argument 'm'"):
        jc.compile(launch, x, 3, m=1)
    with pytest.raises(TypeError, match="too many positional arguments"):
        jc.compile(launch, x, 3, 64, 7, 8)
    assert launch.cache_info().states == 2
