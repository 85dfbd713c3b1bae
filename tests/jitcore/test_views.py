"""Views inside launchers follow torch's indexing exactly, or raise torch's error.

Checked on the CPU through the byte-recording backend: the launcher passes a view of its
argument and the view's sizes and strides (as ``long long`` scalars) to a kernel, and the
recorded parameter bytes are compared with what ``t[index]`` gives on a real CPU tensor (its
storage offset, shape and strides), or with the IndexError torch raises. Runtime scalar
bounds, dynamic sizes and static adaptors all run through one call state per key, so every
later call checks that the symbolic normalization is recomputed, not baked in.
"""

from __future__ import annotations

import functools
import struct
import warnings

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore import symbolic
from jitcore.backends import use_backend
from jitcore.codegen import leaf_values
from jitcore.errors import ArgumentError
from jitcore.tracing import IndexCheck

from .fakes import CountingBackend, track_layouts

MAXD = 6  # the most dimensions a view may have here (rank 3 plus three None)
SLOTS = 6  # runtime scalar parameters a template may use
VIEW_SOURCE = (
    "__global__ void view(float* p, int ndim, "
    + ", ".join(f"long long n{d}, long long s{d}" for d in range(MAXD))
    + ") {}"
)
PLAIN_SOURCE = "__global__ void plain(float* p, long long n) {}"


def fresh_backend() -> tuple[CountingBackend, jc.Kernel, jc.Kernel]:
    """A recording backend and kernels loaded by it alone (a kernel keeps the functions it
    loaded, and the null backends of different tests hand out the same handles)."""
    backend = CountingBackend()
    view_kernel, plain_kernel = jc.Kernel(VIEW_SOURCE, "view"), jc.Kernel(PLAIN_SOURCE, "plain")
    with use_backend(backend):
        track_layouts(backend, view_kernel.instantiate(), plain_kernel.instantiate())
    backend.view_kernel, backend.plain_kernel = view_kernel, plain_kernel
    return backend, view_kernel, plain_kernel


def build_index(template: tuple, runtime: tuple) -> object:
    """The subscript a template describes; runtime bounds come from ``runtime`` (symbolic
    scalars while tracing, ints for torch)."""
    single, items = template

    def bound(spec):
        if spec is None:
            return None
        kind, value = spec
        return runtime[value] if kind == "runtime" else value

    built = []
    for item in items:
        if item[0] == "int":
            built.append(bound(item[1]))
        elif item[0] == "slice":
            built.append(slice(bound(item[1]), bound(item[2]), item[3]))
        elif item[0] == "none":
            built.append(None)
        else:
            built.append(Ellipsis)
    return built[0] if single else tuple(built)


def make_launcher(template: tuple, view_kernel: jc.Kernel):
    @jc.jit
    def launch(x, r0, r1, r2, r3, r4, r5):
        view = x[build_index(template, (r0, r1, r2, r3, r4, r5))]
        args = [view, view.ndim]
        for d in range(MAXD):
            args += [view.shape[d], view.stride(d)] if d < view.ndim else [-1, -1]
        view_kernel[1, 1](*args)

    return launch


def decode(params: tuple) -> tuple[int, tuple, tuple]:
    """(pointer, shape, strides) from the recorded bytes of one ``view`` launch."""
    (pointer,) = struct.unpack("<Q", params[0])
    (ndim,) = struct.unpack("<i", params[1])
    values = [struct.unpack("<q", raw)[0] for raw in params[2:]]
    shape, strides = tuple(values[0 : 2 * ndim : 2]), tuple(values[1 : 2 * ndim : 2])
    assert all(v == -1 for v in values[2 * ndim :])
    return pointer, shape, strides


def torch_view(tensor: torch.Tensor, index: object):
    """torch's answer: the view, or the IndexError it raises."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return tensor[index], None
        except IndexError as error:
            return None, error


@functools.cache
def checks_run_at_call_time() -> bool:
    """Whether generated call states raise for a violated ``trace.runtime_checks`` entry
    (jitcore/codegen.py emits them). Until they do, the fuzzer checks the recorded
    :class:`IndexCheck` itself instead of the call's IndexError."""
    backend, view_kernel, _ = fresh_backend()
    launch = make_launcher((True, (("int", ("runtime", 0)),)), view_kernel)
    with use_backend(backend):
        try:
            launch(torch.zeros(2), 5, 0, 0, 0, 0, 0)
        except IndexError:
            return True
    return False


def check_instance(backend, launch, template, base, wrapped, runtime) -> None:
    """One call: ours against torch, for this base tensor and these runtime values."""
    index = build_index(template, runtime)
    expected, torch_error = torch_view(base, index)
    backend.calls.clear()
    try:
        launch(wrapped, *runtime)
    except IndexError as error:
        assert torch_error is not None, f"{index!r}: jitcore raised {error!r}, torch gave a view"
        if not (base.ndim == 0 and template[0] and template[1][0][0] == "int"):
            assert str(error) == str(torch_error), index
        return
    except Exception:
        if torch_error is None or checks_run_at_call_time():
            raise
        # Without the checks emitted, a violating index may fail later (packing a pointer
        # before the tensor); the recorded check is what must be right.
    if torch_error is not None:
        # No error from the call: only acceptable while codegen does not yet emit the checks,
        # and then the recorded check must say exactly what torch said.
        assert not checks_run_at_call_time(), f"{index!r}: torch raised {torch_error!r}, jitcore launched"
        args = (wrapped, *runtime)
        state = launch.jit.state_for(args)
        values = leaf_values(state.trace, args)
        violated = [check for check in state.trace.runtime_checks if check.violated(values)]
        assert violated, f"{index!r}: torch raised {torch_error!r}, no runtime check fails"
        assert str(violated[0].error(values)) == str(torch_error)
        return
    pointer, shape, strides = decode(backend.calls[-1][7])
    assert shape == tuple(expected.shape), index
    assert strides == expected.stride(), index
    assert pointer - base.data_ptr() == (expected.storage_offset() - base.storage_offset()) * 4, index


# --- strategies ------------------------------------------------------------------------
small = st.integers(-9, 9)
huge = st.sampled_from([-(2**40), 2**40, -(2**63), 2**63 - 1])
runtime_slot = st.integers(0, SLOTS - 1).map(lambda k: ("runtime", k))
int_spec = st.one_of(small.map(lambda v: ("static", v)), runtime_slot)
bound_spec = st.one_of(st.none(), small.map(lambda v: ("static", v)), huge.map(lambda v: ("static", v)), runtime_slot)
step = st.one_of(st.none(), st.integers(1, 4), st.just(7))
item = st.one_of(
    int_spec.map(lambda s: ("int", s)),
    st.tuples(st.just("slice"), bound_spec, bound_spec, step),
    st.just(("none",)),
)


@st.composite
def templates(draw):
    items = draw(st.lists(item, max_size=4))
    if sum(1 for i in items if i[0] == "none") > 3:
        items = [i for i in items if i[0] != "none"]
    if draw(st.booleans()):
        items.insert(draw(st.integers(0, len(items))), ("ellipsis",))
    single = len(items) == 1 and draw(st.booleans())
    return single, tuple(items)


@st.composite
def bases(draw, rank: int):
    """A CPU tensor of this rank: any sizes (0 included), a permutation of a contiguous
    layout (so a unit-stride axis remains) and sometimes a storage offset."""
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=rank, max_size=rank)))
    order = draw(st.permutations(range(rank)))
    lead = draw(st.integers(0, 2))
    parent = torch.arange(float(lead * max(1, int(np.prod(shape))) + int(np.prod(shape)) + 1))
    flat = parent[lead * max(1, int(np.prod(shape))) :][: int(np.prod(shape))]
    permuted_shape = tuple(shape[axis] for axis in order)
    tensor = flat.reshape(permuted_shape) if rank else flat[:1].reshape(())
    inverse = [order.index(axis) for axis in range(rank)]
    return tensor.permute(*inverse) if rank else tensor


def wrap(tensor: torch.Tensor, mode: str) -> object:
    if mode == "raw":
        return tensor
    adaptor = jc.from_dlpack(tensor)
    if mode == "shape_dynamic" and tensor.ndim:
        adaptor.mark_shape_dynamic(range(tensor.ndim))
    return adaptor


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    template=templates(),
    rank=st.integers(0, 3),
    mode=st.sampled_from(["raw", "static", "shape_dynamic"]),
)
def test_fuzz_views_match_torch(data, template, rank, mode):
    backend, view_kernel, _ = fresh_backend()
    with use_backend(backend):
        launch = make_launcher(template, view_kernel)
        for _ in range(3):  # later calls hit the call state the first one built
            base = data.draw(bases(rank))
            if mode == "raw" and base.ndim and 1 not in base.stride():
                continue  # no unit-stride axis (all sizes 1 or 0): raw tensors need one
            runtime = tuple(data.draw(st.lists(small, min_size=SLOTS, max_size=SLOTS)))
            check_instance(backend, launch, template, base, wrap(base, mode), runtime)


# --- the filed cases and what the fuzzer cannot show -------------------------------------
@pytest.fixture
def backend():
    fake, _, _ = fresh_backend()
    with use_backend(fake):
        yield fake


def last_view(backend, base):
    pointer, shape, strides = decode(backend.calls[-1][7])
    return (pointer - base.data_ptr()) // 4, shape, strides


def test_negative_bound_past_the_start_clamps_like_torch(backend):
    launch = make_launcher((True, (("slice", ("static", -4), None, None),)), backend.view_kernel)
    x = torch.zeros(2)
    launch(x, 0, 0, 0, 0, 0, 0)
    assert last_view(backend, x) == (0, (2,), (1,))  # was offset -2, length 4
    y = torch.zeros(10)  # the same call state, a dynamic size
    launch(y, 0, 0, 0, 0, 0, 0)
    assert last_view(backend, y) == (6, (4,), (1,))


def test_runtime_negative_bound_counts_from_the_end(backend):
    launch = make_launcher((True, (("slice", ("runtime", 0), None, None),)), backend.view_kernel)
    x = torch.zeros(10)
    launch(x, -2, 0, 0, 0, 0, 0)
    assert last_view(backend, x) == (8, (2,), (1,))  # was offset -2, length 12
    for n, expected in ((3, (3, (7,), (1,))), (-20, (0, (10,), (1,))), (20, (10, (0,), (1,)))):
        launch(x, n, 0, 0, 0, 0, 0)
        assert last_view(backend, x) == expected
    assert launch.cache_info().compiles == 1


def test_static_out_of_range_index_raises_torchs_error(backend):
    launch = make_launcher((True, (("int", ("static", 1000)),)), backend.view_kernel)
    with pytest.raises(IndexError, match=r"^index 1000 is out of bounds for dimension 0 with size 64$"):
        launch(jc.from_dlpack(torch.zeros(64)), 0, 0, 0, 0, 0, 0)
    with pytest.raises(IndexError, match=r"^index -65 is out of bounds for dimension 1 with size 64$"):
        make_launcher((False, (("int", ("static", 0)), ("int", ("static", -65)))), backend.view_kernel)(
            jc.from_dlpack(torch.zeros(2, 64)), 0, 0, 0, 0, 0, 0
        )
    assert backend.calls == []


def test_symbolic_int_indexes_record_a_runtime_check(backend):
    @jc.jit
    def launch(x, i):
        row = x[i]
        backend.plain_kernel[1, 1](row, row.shape[0])

    x = torch.zeros(4, 3)
    state = launch.jit.state_for((x, -1))
    (check,) = state.trace.runtime_checks
    assert isinstance(check, IndexCheck) and check.dim == 0
    assert [leaf.describe() for leaf in check.expressions()] == ["i", "x.shape[0]"]
    for value, bad in ((3, False), (-4, False), (4, True), (-5, True)):
        values = leaf_values(state.trace, (x, value))
        assert check.violated(values) is bad
    assert str(check.error(leaf_values(state.trace, (x, 4)))) == str(torch_view(x, 4)[1])
    launch(x, -1)
    pointer, (n,) = struct.unpack("<Q", backend.calls[-1][7][0]), struct.unpack("<q", backend.calls[-1][7][1])
    assert pointer[0] - x.data_ptr() == 3 * 3 * 4 and n == 3  # -1 wrapped to row 3


def test_static_index_against_a_dynamic_size_is_checked_at_call_time(backend):
    launch = make_launcher((True, (("int", ("static", 5)),)), backend.view_kernel)
    state = launch.jit.state_for((torch.zeros(8), 0, 0, 0, 0, 0, 0))
    (check,) = state.trace.runtime_checks
    assert check.value == 5 and symbolic.is_static(check.value) and not symbolic.is_static(check.size)
    assert check.violated(leaf_values(state.trace, (torch.zeros(5), 0, 0, 0, 0, 0, 0)))
    assert not check.violated(leaf_values(state.trace, (torch.zeros(6), 0, 0, 0, 0, 0, 0)))


def test_out_of_range_indexes_raise_at_call_time(backend):
    """End to end: the call state raises torch's IndexError before any launch."""
    if not checks_run_at_call_time():
        pytest.skip("jitcore/codegen.py does not emit trace.runtime_checks yet (issue 11, item 1)")
    launch = make_launcher((False, (("int", ("runtime", 0)), ("int", ("static", 1)))), backend.view_kernel)
    x = torch.zeros(4, 3)
    launch(x, 2, 0, 0, 0, 0, 0)
    backend.calls.clear()
    with pytest.raises(IndexError, match=r"^index 7 is out of bounds for dimension 0 with size 4$"):
        launch(x, 7, 0, 0, 0, 0, 0)
    with pytest.raises(IndexError, match=r"^index 1 is out of bounds for dimension 1 with size 1$"):
        launch(torch.zeros(4, 1), 0, 0, 0, 0, 0, 0)
    assert backend.calls == []


def test_none_inserts_a_dimension_with_torchs_stride(backend):
    for template in (
        (True, (("none",),)),
        (False, (("slice", ("static", 1), None, None), ("none",), ("int", ("static", 2)))),
        (False, (("none",), ("ellipsis",), ("none",))),
    ):
        launch = make_launcher(template, backend.view_kernel)
        for shape in ((3, 4), (1, 5), (0, 3)):
            x = torch.zeros(shape)
            launch(x, 0, 0, 0, 0, 0, 0)
            expected, error = torch_view(x, build_index(template, (0,) * SLOTS))
            assert error is None
            assert last_view(backend, x) == (expected.storage_offset(), tuple(expected.shape), expected.stride())


@pytest.mark.parametrize(
    "index, error, message",
    [
        (slice(None, None, -1), ValueError, "step must be greater than zero"),
        (slice(None, None, 0), ValueError, "slice step cannot be zero"),
        (slice(1.5, None), TypeError, "slice indices must be integers"),
        (1.5, IndexError, "only integers, slices"),
        (True, ArgumentError, "advanced indexing"),
        ([0, 1], ArgumentError, "advanced indexing"),
        (torch.tensor(1), ArgumentError, "advanced indexing"),
        ((Ellipsis, 0, Ellipsis), IndexError, "single ellipsis"),
        ((0, 0, 0), IndexError, "too many indices for tensor of dimension 2"),
    ],
)
def test_refused_indexes_say_what_a_launcher_takes(backend, index, error, message):
    @jc.jit
    def launch(x):
        view = x[index]
        backend.plain_kernel[1, 1](view, 1)

    with pytest.raises(error, match=message):
        launch(torch.zeros(3, 4))


def test_runtime_steps_and_float_bounds_are_refused(backend):
    @jc.jit
    def stepped(x, n):
        backend.plain_kernel[1, 1](x[::n], 1)

    with pytest.raises(ArgumentError, match="slice step n is a runtime value"):
        stepped(torch.zeros(8), 2)

    @jc.jit
    def floating(x, f):
        backend.plain_kernel[1, 1](x[f:], 1)

    with pytest.raises(TypeError, match="slice indices must be integers"):
        floating(torch.zeros(8), 1.0)


def test_numpy_integers_index_like_ints(backend):
    launch = make_launcher((False, (("slice", ("static", np.int64(-3)), None, None),)), backend.view_kernel)
    x = torch.zeros(10)
    launch(x, 0, 0, 0, 0, 0, 0)
    assert last_view(backend, x) == (7, (3,), (1,))


def test_symbolic_bounds_render_to_readable_source():
    n, size = symbolic.Sym.leaf("n", "n"), symbolic.Sym.leaf("x_size0", "x.shape[0]")
    bound = symbolic.slice_index(n, size)
    assert bound.describe() == "slice_index(n, x.shape[0])"
    assert [bound.evaluate({"n": v, "x_size0": 10}) for v in (-20, -2, 0, 3, 20)] == [0, 8, 0, 3, 10]
    wrapped = symbolic.wrap_index(n, size)
    assert [wrapped.evaluate({"n": v, "x_size0": 10}) for v in (-1, 0, 9)] == [9, 0, 9]
    assert symbolic.slice_index(-3, size).describe() == "max((x.shape[0] - 3), 0)"
    assert symbolic.slice_index(-3, 10) == 7 and symbolic.wrap_index(-1, 4) == 3


# --- numpy integers and bools as runtime indexes ------------------------------------------
RUNTIME_TYPES = [np.int64, np.int32, np.int16, np.int8, np.longlong, np.intc]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    template=templates(),
    rank=st.integers(0, 3),
    kind=st.sampled_from(RUNTIME_TYPES),
)
def test_fuzz_views_with_numpy_runtime_indexes_match_torch(data, template, rank, kind):
    """Runtime indexes and bounds of a numpy integer type address exactly what a Python int of
    their value addresses (torch takes them alike): the call state converts them with
    operator.index before any pointer arithmetic, so ``data_ptr + i * stride`` never computes
    in the index's own width."""
    backend, view_kernel, _ = fresh_backend()
    with use_backend(backend):
        launch = make_launcher(template, view_kernel)
        for _ in range(3):
            base = data.draw(bases(rank))
            if base.ndim and 1 not in base.stride():
                continue
            runtime = tuple(kind(v) for v in data.draw(st.lists(small, min_size=SLOTS, max_size=SLOTS)))
            check_instance(backend, launch, template, base, base, runtime)


@pytest.mark.parametrize("kind", [np.int32, np.int16, np.uint8, np.longlong])
def test_a_narrow_numpy_index_moves_the_pointer_like_an_int(backend, kind):
    @jc.jit
    def row(x, i):
        backend.plain_kernel[1, 1](x[i], x.shape[1])

    @jc.jit
    def tail(x, i):
        backend.plain_kernel[1, 1](x[i:], x.shape[1])

    x = torch.zeros(4, 8)
    for launch in (row, tail, row):
        launch(x, kind(1))
        (pointer,) = struct.unpack("<Q", backend.calls[-1][7][0])
        assert pointer - x.data_ptr() == x[1].data_ptr() - x.data_ptr() == 32


def test_a_runtime_bool_index_is_refused_like_a_static_one(backend):
    @jc.jit
    def pick(x, flag):
        backend.plain_kernel[1, 1](x[flag], 1)

    for flag in (True, np.True_):
        with pytest.raises(ArgumentError, match="the bool argument flag as an index.*advanced indexing"):
            pick(torch.zeros(3, 4), flag)
    assert pick.cache_info().states == 0


def test_runtime_bool_slice_bounds_follow_python(backend):
    @jc.jit
    def tail(x, flag):
        backend.plain_kernel[1, 1](x[flag:], 1)

    x = torch.zeros(4)
    tail(x, True)  # Python and torch read True as 1 in a slice
    (pointer,) = struct.unpack("<Q", backend.calls[-1][7][0])
    assert pointer - x.data_ptr() == x[True:].data_ptr() - x.data_ptr() == 4
    with pytest.raises(TypeError, match="slice indices must be integers.*numpy bool flag"):
        tail(x, np.True_)  # numpy bools have no __index__: torch refuses x[np.True_:] too


def test_numpy_integers_in_launch_sizes_reach_the_driver_as_ints(backend):
    @jc.jit
    def sized(x, n):
        backend.plain_kernel[jc.cdiv(n, 2), n, n * 4](x, 1)

    for n in (np.int16(5), np.int16(5), np.uint8(3)):
        sized(torch.zeros(4), n)
        grid, block, shared = backend.calls[-1][1:4]
        assert all(type(v) is int for v in (*grid, *block, shared))
        assert (grid[0], block[0], shared) == (-(-int(n) // 2), int(n), int(n) * 4)

    @jc.jit
    def flagged(x, flag):
        backend.plain_kernel[flag, 1](x, 1)

    with pytest.raises(jc.LaunchConfigError, match="grid sizes must be ints, got the bool argument flag"):
        flagged(torch.zeros(4), True)
