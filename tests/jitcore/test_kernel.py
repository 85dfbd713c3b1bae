"""Kernels and their specializations: template arguments, defaults and the specialization cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore.backends import use_backend
from jitcore.errors import ArgumentError

from .fakes import PACKINGS, CountingBackend, track_layouts


@pytest.fixture(params=PACKINGS)
def backend(request):
    fake = CountingBackend(packed=request.param == "packed")
    with use_backend(fake):
        yield fake


# --- template parameters defaulting to earlier ones ---------------------------------------------
COPY = r"""
template <typename T, typename Out = T>
__global__ void copy(const T* x, Out* out, Out scale, long long n) {}
"""


def test_a_default_naming_an_earlier_parameter_is_that_parameters_argument(backend):
    kernel = jc.Kernel(COPY, "copy")
    spec = kernel.instantiate(torch.float16)
    assert spec.name_expression == "copy<__half>"  # the compiler applies the default itself
    assert [p.spelling for p in spec.param_types] == ["const __half* x", "__half* out", "__half scale", "long long n"]
    track_layouts(backend, spec)

    @jc.jit
    def launch(x, out):
        kernel.instantiate(x.dtype)[1, 32](x, out, 1.0, x.numel())

    x = torch.zeros(4, dtype=torch.float16)
    launch(x, torch.zeros(4, dtype=torch.float16))
    for dtype in (torch.float32, torch.int64, torch.int16):
        with pytest.raises(ArgumentError, match=rf"argument 1 \(__half\* out\).*dtype {str(dtype)[6:]}"):
            launch(x, torch.zeros(4, dtype=dtype))
    assert launch.cache_info().states == 1  # the refused calls left nothing behind


def test_defaults_resolve_in_a_chain_and_explicit_arguments_win():
    source = "template <typename T, typename U = T, typename V = U, int N = 4> __global__ void k(V* v, U u) {}"
    kernel = jc.Kernel(source, "k")
    assert [p.spelling for p in kernel.instantiate("double").param_types] == ["double* v", "double u"]
    assert [p.spelling for p in kernel.instantiate("double", "float").param_types] == ["float* v", "float u"]
    assert [p.spelling for p in kernel.instantiate("int", "float", "char").param_types] == ["char* v", "float u"]


@pytest.mark.parametrize(
    "source, unresolved",
    [
        ("template <typename Out = T, typename T = float> __global__ void k(Out* o) {}", "'T'"),
        ("template <typename T = T> __global__ void k(T* o) {}", "'T'"),
    ],
)
def test_a_default_that_cannot_be_resolved_is_refused(source, unresolved):
    kernel = jc.Kernel(source, "k")
    with pytest.raises(ArgumentError, match=rf"default of template parameter .* names {unresolved}.*explicitly"):
        kernel.instantiate()


# --- the specialization cache ---------------------------------------------------------------------
AUTO = "template <auto V> __global__ void s(int* out) {}"
POOL = [1, True, 1.0, np.True_, np.int64(1), np.int32(1), 0, False, np.False_, "1", "true", 2, torch.float32]


def spelled_alone(value: object) -> str | type:
    """What a kernel that never instantiated anything else makes of ``value``."""
    try:
        return jc.Kernel(AUTO, "s").instantiate(value).name_expression
    except TypeError as error:
        return type(error)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.sampled_from(POOL), min_size=1, max_size=6))
def test_property_a_specialization_never_depends_on_earlier_instantiations(values):
    """``True == 1 == 1.0`` in Python, but ``s<true>`` and ``s<1>`` are different kernels and
    1.0 is no template argument: each call gets what it would get first."""
    with use_backend(CountingBackend()):
        kernel = jc.Kernel(AUTO, "s")
        for value in values:
            try:
                got = kernel.instantiate(value).name_expression
            except TypeError as error:
                got = type(error)
            assert got == spelled_alone(value), value


def test_one_spelling_is_one_specialization():
    with use_backend(CountingBackend()):
        kernel = jc.Kernel(AUTO, "s")
        assert kernel.instantiate(1) is kernel.instantiate(np.int64(1)) is kernel.instantiate("1")
        assert kernel.instantiate(True) is kernel.instantiate(np.True_) is kernel.instantiate("true")
        assert kernel.instantiate(True) is not kernel.instantiate(1)
        assert kernel.instantiate(True).name_expression == "s<true>"


@pytest.mark.parametrize("name", ["source", "name", "options", "signature", "declaration"])
def test_what_a_kernels_binaries_are_made_of_cannot_be_changed_after_it_is_made(name):
    """A specialization compiles once per device: a kernel whose options (or source) were set
    anew would keep running the old binary, so the change is refused, naming the attribute."""
    kernel = jc.Kernel(COPY, "copy", options=["-DA=1"])
    before = getattr(kernel, name)
    with pytest.raises(AttributeError, match=rf"Kernel\.{name} is fixed when the kernel is made"):
        setattr(kernel, name, ("-DA=2",) if name == "options" else "other")
    assert getattr(kernel, name) == before and kernel.instantiate(torch.float32).kernel is kernel
