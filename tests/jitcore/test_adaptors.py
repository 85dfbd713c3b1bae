"""Arguments that change or surprise after a first call: stale adaptors, unusual tensors.

- A ``jc.from_dlpack(t)`` adaptor is a snapshot; after ``t.resize_(...)`` (or ``set_``,
  ``.data =``) it must be refused, never launched with the freed storage's pointer, nor with
  a dtype or conjugate/negative bit the tensor no longer has (``t.data = t.view(torch.int32)``
  keeps pointer, shape and strides); a numpy array's adaptor likewise after ``a.resize``,
  ``a.shape =`` or ``a.dtype =``.
- Nested, sparse, meta, efficient-zero and subclass tensors must be refused cleanly on every call, including
  once a call state's C++ tensor guard is on the fast path (a strided nested tensor used to
  abort the process there). Those checks run in a subprocess, so an abort fails the test
  instead of killing pytest.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore.backends import use_backend
from jitcore.errors import ArgumentError

from .fakes import CountingBackend, track_layouts

ROOT = Path(__file__).resolve().parents[2]
GUARDS = jc.tensor_guard([torch.zeros(1)], [[1]], [[1]]) is not None  # None where torch lacks the evaluator
SOURCE = "__global__ void touch(float* p, long long n) {}"


def _tracked_launcher(source: str, name: str):
    """(backend, launcher of ``name``(x, x.numel())), the launches' layouts tracked."""
    backend = CountingBackend()
    kernel = jc.Kernel(source, name)  # loaded by this backend only (handles are per backend)
    with use_backend(backend):
        track_layouts(backend, kernel.instantiate())

        @jc.jit
        def launch(x):
            kernel[1, 32](x, x.numel())

        yield backend, launch


@pytest.fixture
def setup():
    yield from _tracked_launcher(SOURCE, "touch")


def launched(backend) -> tuple[int, int]:
    pointer, count = backend.calls[-1][7]
    return struct.unpack("<Q", pointer)[0], struct.unpack("<q", count)[0]


# --- item 6: stale adaptors --------------------------------------------------------------
@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda t: t.resize_(4096), id="resize_-grow"),  # new storage, old one freed
        pytest.param(lambda t: t.resize_(3), id="resize_-shrink"),  # same pointer, new shape
        pytest.param(lambda t: t.set_(torch.zeros(16)), id="set_"),
        pytest.param(lambda t: setattr(t, "data", torch.zeros(16)), id="data="),
        pytest.param(lambda t: t.unsqueeze_(0), id="unsqueeze_"),
    ],
)
def test_a_changed_tensor_makes_its_adaptor_refuse(setup, change):
    backend, launch = setup
    t = torch.zeros(16)
    adaptor = jc.from_dlpack(t)
    launch(adaptor)
    launch(adaptor)
    assert launched(backend) == (t.data_ptr(), 16)
    change(t)
    calls = len(backend.calls)
    with pytest.raises(
        ArgumentError, match=r"stale jitcore\.from_dlpack adaptor .*Call jitcore\.from_dlpack\(t\) again"
    ):
        launch(adaptor)
    assert len(backend.calls) == calls  # nothing launched
    launch(jc.from_dlpack(t))  # rewrapping describes the tensor as it is now
    assert launched(backend) == (t.data_ptr(), t.numel())


def test_marked_adaptors_and_pinned_handles_refuse_too(setup):
    _backend, launch = setup
    t = torch.zeros(16)
    adaptor = jc.from_dlpack(t).mark_shape_dynamic(0)
    handle = jc.compile(launch, adaptor)
    handle(adaptor)
    t.resize_(1 << 16)  # reallocates: the recorded pointer is freed memory now
    with pytest.raises(ArgumentError, match="stale"):
        launch(adaptor)
    with pytest.raises(ArgumentError, match="stale"):
        handle(adaptor)  # no key on this path: the pointer read itself checks
    assert "TensorAdaptor(" in repr(adaptor)  # describing a stale adaptor never raises


def test_in_place_value_changes_keep_the_adaptor_valid(setup):
    backend, launch = setup
    t = torch.zeros(8)
    adaptor = jc.from_dlpack(t)
    t.add_(1)
    t.resize_(8)  # same size: nothing moves
    launch(adaptor)
    assert launched(backend) == (t.data_ptr(), 8)


RAW = "__global__ void raw(const void* p, long long n) {}"  # an opaque pointee: any dtype reaches it


@pytest.fixture
def raw_setup():
    yield from _tracked_launcher(RAW, "raw")


@pytest.mark.parametrize(
    "make, change, what",
    [
        pytest.param(
            lambda: torch.arange(16.0), lambda t: setattr(t, "data", t.view(torch.int32)), "dtype", id="dtype"
        ),
        pytest.param(
            lambda: torch.randn(16, dtype=torch.complex64),
            lambda t: setattr(t, "data", t.conj()),
            "conjugate bit",
            id="conjugate-bit",
        ),
        pytest.param(
            lambda: torch.randn(16),
            lambda t: setattr(t, "data", torch._neg_view(t)),
            "negative bit",
            id="negative-bit",
        ),
        pytest.param(
            lambda: torch.randn(16),
            lambda t: setattr(t, "data", torch._efficientzerotensor(16)),
            "data pointer",
            id="efficient-zero",
        ),
    ],
)
def test_a_change_that_keeps_pointer_shape_and_strides_still_makes_the_adaptor_refuse(raw_setup, make, change, what):
    """``t.data = t.view(torch.int32)`` or ``t.data = t.conj()`` keeps the data pointer, shape
    and strides: the adaptor's dtype, or what its memory means, changed all the same."""
    backend, launch = raw_setup
    t = make()
    adaptor = jc.from_dlpack(t)
    launch(adaptor)
    launch(adaptor)
    change(t)
    calls = len(backend.calls)
    for _ in range(2):
        with pytest.raises(ArgumentError, match=rf"stale jitcore\.from_dlpack adaptor .*: {what} "):
            launch(adaptor)
    assert len(backend.calls) == calls  # nothing launched


_SAME_SIZE = [
    (torch.float32, torch.int32),
    (torch.int32, torch.float32),
    (torch.float32, torch.uint32),
    (torch.float16, torch.bfloat16),
    (torch.int16, torch.float16),
    (torch.int64, torch.float64),
    (torch.uint8, torch.int8),
    (torch.int8, torch.float8_e4m3fn),
    (torch.float8_e4m3fn, torch.float8_e5m2),
    (torch.float32, torch.float32),
    (torch.int64, torch.int64),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(_SAME_SIZE), st.integers(1, 4), st.integers(1, 5), st.booleans())
def test_property_an_adaptor_is_stale_exactly_when_its_dtype_changed(dtypes, rows, cols, transposed):
    """``t.data = t.view(other)`` between dtypes of one element size: same pointer, shape and
    strides; the adaptor refuses exactly when the dtype differs, and otherwise keeps its
    signature."""
    before, after = dtypes
    t = torch.zeros(rows, cols).to(before)
    if transposed:
        t = t.t()
    adaptor = jc.from_dlpack(t)
    signature = adaptor.__cache_signature__()
    t.data = t.view(after)
    if before == after:
        assert adaptor.__cache_signature__() == signature
    else:
        with pytest.raises(ArgumentError, match=rf"stale .*dtype {before} -> {after}"):
            adaptor.__cache_signature__()


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda a: setattr(a, "shape", (4, 4)), id="shape="),
        pytest.param(lambda a: a.resize(4096, refcheck=False), id="resize"),
        pytest.param(lambda a: setattr(a, "dtype", np.int32), id="dtype="),
    ],
)
def test_a_changed_numpy_array_makes_its_adaptor_refuse(raw_setup, change):
    backend, launch = raw_setup
    array = np.zeros(16, dtype=np.float32)
    adaptor = jc.from_dlpack(array)
    launch(adaptor)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # numpy deprecates setting a dtype in place
        change(array)
    calls = len(backend.calls)
    with pytest.raises(
        ArgumentError, match=r"stale jitcore\.from_dlpack adaptor .*its array \(resize, shape or dtype\)"
    ):
        launch(adaptor)
    assert len(backend.calls) == calls
    launch(jc.from_dlpack(array))  # rewrapping describes the array as it is now
    assert launched(backend) == (array.__array_interface__["data"][0], array.size)


# --- item 7: unusual tensors after a first call --------------------------------------------
_UNUSUAL = textwrap.dedent(
    """
    import warnings
    warnings.simplefilter("ignore")
    import torch
    import jitcore as jc
    from jitcore.backends import use_backend
    from tests.jitcore.fakes import CountingBackend

    class Dispatching(torch.Tensor):
        @staticmethod
        def __new__(cls, elem):
            return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

        def __init__(self, elem):
            self.elem = elem

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            unwrap = lambda a: a.elem if isinstance(a, Dispatching) else a
            return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})

    class Plain(torch.Tensor):
        pass

    dense = torch.randn(4, 4)
    UNUSUAL = {
        "nested": lambda: torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
        "nested_1d": lambda: torch.nested.nested_tensor([torch.randn(2), torch.randn(3)]),
        "nested_jagged": lambda: torch.nested.nested_tensor([torch.randn(2, 3)], layout=torch.jagged),
        "sparse_coo": lambda: dense.to_sparse(),
        "sparse_csr": lambda: dense.to_sparse_csr(),
        "meta": lambda: torch.empty(4, 4, device="meta"),
        "efficient_zero": lambda: torch._efficientzerotensor((4, 4)),
        "dispatch_subclass": lambda: Dispatching(torch.randn(4, 4)),
        "plain_subclass": lambda: torch.randn(4, 4).as_subclass(Plain),
    }
    """
)

JIT_SCRIPT = _UNUSUAL + textwrap.dedent(
    """
    kernel = jc.Kernel("__global__ void touch(float* p, long long n) {}", "touch")

    @jc.jit
    def launch(x):
        kernel[1, 32](x, x.numel())

    with use_backend(CountingBackend()):
        for name, make in UNUSUAL.items():
            launch(torch.randn(4, 4))
            launch(torch.randn(4, 4))  # the second call puts the guarded state on the fast path
            outcomes = []
            for _ in range(3):
                try:
                    launch(make())
                    outcomes.append("ok")
                except Exception as error:
                    outcomes.append(type(error).__name__)
            print(name, *outcomes, flush=True)
    """
)

GUARD_SCRIPT = _UNUSUAL + textwrap.dedent(
    """
    example = torch.randn(4, 4)
    for sizes, strides in (([None, None], [None, None]), ([4, 4], [4, 1])):
        check = jc.tensor_guard([example], [sizes], [strides])
        assert check is not None and check(example) and check(torch.randn(4, 4))
        for name, make in UNUSUAL.items():
            print(name, check(make()), flush=True)
        print("int", check(3), "None", check(None), flush=True)
    print("built_from_nested", jc.tensor_guard([UNUSUAL["nested"]()], [[None, None]], [[None, None]]), flush=True)
    """
)


def run_isolated(script: str) -> list[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, (
        f"exit code {result.returncode} (-6 is SIGABRT)\n{result.stdout}\n{result.stderr[-3000:]}"
    )
    return result.stdout.splitlines()


@pytest.mark.skipif(not GUARDS, reason="torch has no C++ tensor guard evaluator")
def test_unusual_tensors_are_refused_on_every_call_after_a_normal_one():
    outcomes = dict((line.split()[0], line.split()[1:]) for line in run_isolated(JIT_SCRIPT))
    refused = ("nested", "nested_1d", "nested_jagged", "sparse_coo", "sparse_csr", "meta", "efficient_zero")
    for name in (*refused, "dispatch_subclass"):
        assert outcomes[name] == ["UnsupportedTensorError"] * 3, name
    assert outcomes["plain_subclass"] == ["ok"] * 3  # a subclass without its own dispatch is plain memory


@pytest.mark.skipif(not GUARDS, reason="torch has no C++ tensor guard evaluator")
def test_tensor_guard_says_no_to_unusual_tensors_instead_of_aborting():
    """``jitcore.tensor_guard`` is also replay's region fast path (replay/session.py)."""
    lines = run_isolated(GUARD_SCRIPT)
    for line in lines[:-1]:
        name, *answers = line.split()
        if name == "int":
            assert answers == ["False", "None", "False"]
        else:
            assert answers == ["False"], line
    assert lines[-1] == "built_from_nested None"
