"""Lean and full tensor signatures: equal bytes on everything both accept, the same refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jitcore as jc
from jitcore import dtypes, generated, keys, tensors
from jitcore.errors import LayoutError, UnsupportedTensorError
from jitcore.keys import KeyPlan, Parameter
from jitcore.tensors import TensorAdaptor, lean_cache_signature, lean_static_signature


def canonical_bytes(key):
    """A key's bytes: its repr, which spells every type (1, True, 1.0 and '1' all differ) and,
    unlike a pickle, does not depend on which equal objects happen to be shared."""
    return repr(key).encode()


def outcome(fn, tensor):
    try:
        return ("ok", canonical_bytes(fn(tensor)))
    except Exception as exc:  # the type and message are what parity is about
        return ("error", type(exc), str(exc))


def assert_parity(tensor):
    lean = outcome(lean_cache_signature, tensor)
    full = outcome(lambda t: TensorAdaptor(t).__cache_signature__(), tensor)
    assert lean == full
    static_lean = outcome(lean_static_signature, tensor)
    static_full = outcome(lambda t: jc.from_dlpack(t).__cache_signature__(), tensor)
    assert static_lean == static_full
    return lean


# --- the named layouts -------------------------------------------------------------------
def named_layouts():
    base = torch.arange(4 * 5 * 6, dtype=torch.float32).reshape(4, 5, 6)
    fp8 = torch.randn(8, 16).to(torch.float8_e4m3fn)
    return {
        "contiguous": base,
        "broadcast_2d": torch.randn(1, 7).expand(5, 7),
        "broadcast_3d": torch.randn(4, 1, 6).expand(4, 5, 6),
        "broadcast_row_3d": torch.randn(6).expand(4, 5, 6),
        "leading_size1": torch.randn(1, 5, 6),
        "mid_size1": torch.randn(4, 1, 6),
        "trailing_size1": torch.randn(4, 6, 1),
        "all_size1": torch.randn(1, 1, 1),
        "permuted": base.permute(2, 0, 1),
        "transposed": base.transpose(0, 2),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "strided_rows": torch.randn(8, 32)[:, :16],
        "every_other_row": torch.randn(8, 16)[::2],
        "storage_offset": torch.randn(10, 10)[3:, 2:],
        "zero_size_leading": torch.randn(0, 4),
        "zero_size_trailing": torch.randn(4, 0),
        "zero_size_mid": torch.randn(3, 0, 2),
        "fp8": fp8,
        "fp8_transposed": fp8.t(),
        "fp8_e5m2": torch.randn(4, 4).to(torch.float8_e5m2),
        "scalar_0d": torch.tensor(3.0),
        "bool": torch.rand(4, 4) > 0.5,
        "requires_grad": torch.randn(3, 3, requires_grad=True),
        "parameter": torch.nn.Parameter(torch.randn(3, 4)),
        "no_unit_stride": torch.randn(8, 8)[::2, ::2],
        "no_unit_stride_1d": torch.randn(10)[::3],
        "broadcast_1d": torch.randn(1).expand(5),
    }


@pytest.mark.parametrize("name", list(named_layouts()))
def test_named_layouts_lean_equals_full(name):
    assert_parity(named_layouts()[name])


def test_layout_dynamic_signature_contents():
    x = torch.randn(4, 6)
    dtype, shape, strides, unit, align, device = lean_cache_signature(x)
    assert (dtype, shape, strides, unit, align, device) == ("float32", ("?", "?"), ("?", 1), 1, 4, "cpu")
    # a transposed tensor is another key: its unit-stride axis is 0
    assert lean_cache_signature(x.t())[3] == 0
    assert lean_cache_signature(x.t())[2] == (1, "?")


def test_unit_axis_comes_from_torch_strides_last_one_wins():
    column = torch.randn(5, 1)  # strides (1, 1): both axes have stride 1
    assert column.stride() == (1, 1)
    assert lean_cache_signature(column)[3] == 1
    assert TensorAdaptor(column).unit_axis == 1


def test_fp8_variants_are_distinct_keys():
    a = torch.empty(4, dtype=torch.float8_e4m3fn)
    b = torch.empty(4, dtype=torch.float8_e5m2)
    assert lean_cache_signature(a) != lean_cache_signature(b)


@pytest.mark.parametrize("name", ["no_unit_stride", "no_unit_stride_1d", "broadcast_1d"])
def test_no_unit_stride_axis_is_refused_by_both_with_advice(name):
    tensor = named_layouts()[name]
    lean = outcome(lean_cache_signature, tensor)
    assert lean[0] == "error" and lean[1] is LayoutError and "from_dlpack" in lean[2]
    assert lean == outcome(lambda t: TensorAdaptor(t).__cache_signature__(), tensor)
    # and from_dlpack describes it statically
    assert jc.from_dlpack(tensor).__cache_signature__()[2] == tuple(tensor.stride())


# --- what DLPack export refuses (and what it should) -----------------------------------------
def refused_tensors():
    complex_tensor = torch.randn(3, dtype=torch.complex64)
    dense = torch.randn(3, 4)
    cases = {
        "conjugate": complex_tensor.conj(),
        "negative_bit_from_conj_imag": complex_tensor.conj().imag,
        "negative_view": torch._neg_view(dense),
        "sparse_coo": dense.to_sparse(),
        "sparse_coo_1d": torch.randn(5).to_sparse(),
        "sparse_csr": dense.to_sparse_csr(),
        "meta": torch.empty(3, 4, device="meta"),
        "meta_0d": torch.empty((), device="meta"),
        "quantized": torch.quantize_per_tensor(dense, 0.1, 0, torch.quint8),
        "nested_strided": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)]),
        "nested_jagged": torch.nested.nested_tensor([torch.randn(2, 3), torch.randn(4, 3)], layout=torch.jagged),
        "sparse_0d": torch.tensor(1.0).to_sparse(),
        # no memory of their own: a null data pointer (or none at all) for values they show
        "efficient_zero": torch._efficientzerotensor((3, 4)),
        "efficient_zero_1d": torch._efficientzerotensor(5, dtype=torch.int32),
        "functional_wrapper": torch._to_functional_tensor(dense),
    }
    if torch.backends.mkldnn.is_available():
        cases["mkldnn"] = dense.to_mkldnn()
        cases["mkldnn_1d"] = torch.randn(8).to_mkldnn()
    return cases


@pytest.mark.parametrize("name", list(refused_tensors()))
def test_refused_by_both_paths_with_the_same_error(name):
    tensor = refused_tensors()[name]
    lean = outcome(lean_cache_signature, tensor)
    assert lean[0] == "error", f"{name} was accepted: {lean}"
    assert issubclass(lean[1], UnsupportedTensorError)
    assert lean == outcome(lambda t: TensorAdaptor(t).__cache_signature__(), tensor)
    assert outcome(lean_static_signature, tensor) == outcome(lambda t: jc.from_dlpack(t).__cache_signature__(), tensor)


def test_refused_tensors_stay_refused_after_the_fast_path_has_seen_valid_twins():
    # The lean fast path caches per (dtype, ndim, unit axis, device); make sure a valid twin
    # cached first does not let an invalid tensor through.
    dense = torch.randn(3, 4)
    lean_cache_signature(dense)
    lean_cache_signature(torch.randn(4))
    for name, tensor in refused_tensors().items():
        assert outcome(lean_cache_signature, tensor)[0] == "error", name


def _inside(transform: str, body):
    """Run ``body`` on the tensor a torch.func transform passes its function, return its result."""
    seen = []

    def function(t):
        seen.append(body(t))
        return t.sum()

    base = torch.randn(3, 4)
    if transform == "vmap":
        torch.func.vmap(function)(base)
    elif transform == "grad":
        torch.func.grad(function)(base)
    elif transform == "jvp":
        torch.func.jvp(function, (base,), (torch.ones_like(base),))
    else:
        torch.func.functionalize(function)(base)
    return seen[0]


@pytest.mark.parametrize("transform", ["vmap", "grad", "jvp", "functionalize"])
def test_torch_func_wrappers_are_refused_by_both_paths_with_the_same_error(transform):
    """Inside a transform the function sees a wrapper (a BatchedTensor has no data pointer, a
    functionalized one a null one): every path refuses it the same way, after a valid twin
    filled the fast path too."""
    lean_cache_signature(torch.randn(4))
    lean_cache_signature(torch.randn(3, 4))
    results = _inside(
        transform,
        lambda t: [
            outcome(f, t)
            for f in (
                lean_cache_signature,
                _INLINE,
                lambda t: TensorAdaptor(t).__cache_signature__(),
                lean_static_signature,
                lambda t: jc.from_dlpack(t).__cache_signature__(),
            )
        ],
    )
    for result in results:
        assert result[0] == "error" and result[1] is UnsupportedTensorError, result
        assert "torch.func transform" in result[2]
    assert len({repr(result) for result in results}) == 1


def test_requires_grad_is_accepted_by_both_and_described_like_its_data():
    x = torch.randn(3, 4, requires_grad=True)
    assert assert_parity(x) == outcome(lean_cache_signature, x.detach())


def test_tensor_subclass_with_its_own_dispatch_is_refused():
    class Wrapper(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    tensor = torch.Tensor._make_subclass(Wrapper, torch.randn(3))
    lean = outcome(lean_cache_signature, tensor)
    assert lean[0] == "error" and issubclass(lean[1], UnsupportedTensorError)
    assert lean == outcome(lambda t: TensorAdaptor(t).__cache_signature__(), tensor)


# --- other DLPack producers ---------------------------------------------------------------
@pytest.mark.parametrize(
    "array",
    [np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float16)[:, ::2].copy().T, np.zeros(5, np.int64)[1:]],
    ids=["f32", "f16-transposed", "i64-offset"],
)
def test_numpy_arrays_are_described_like_the_same_memory_in_torch(array):
    assert TensorAdaptor(array).__cache_signature__() == lean_cache_signature(torch.from_numpy(array))
    assert jc.from_dlpack(array).__cache_signature__() == lean_static_signature(torch.from_numpy(array))


def test_objects_without_dlpack_are_a_type_error():
    with pytest.raises(TypeError, match="__dlpack__"):
        TensorAdaptor([1, 2, 3])


# --- from_dlpack and its marks ------------------------------------------------------------
def test_from_dlpack_is_static_until_marked():
    x = torch.randn(4, 8)
    adaptor = jc.from_dlpack(x)
    assert adaptor.__cache_signature__() == ("float32", (4, 8), (8, 1), 1, 4, "cpu")
    assert adaptor.mark_layout_dynamic().__cache_signature__() == lean_cache_signature(x)


def test_marks():
    x = torch.randn(16, 32)
    sig = jc.from_dlpack(x).mark_shape_dynamic(0).__cache_signature__()
    assert sig[1:3] == (("?", 32), (32, 1))
    sig = jc.from_dlpack(x).mark_shape_dynamic([-1], divisibility=16).__cache_signature__()
    assert sig[1] == (16, "?16")
    sig = jc.from_dlpack(x).mark_stride_dynamic(0, divisibility=8).__cache_signature__()
    assert sig[2] == ("?8", 1)
    sig = jc.from_dlpack(x).mark_layout_dynamic(leading_dim=1, divisibility=16).__cache_signature__()
    assert sig[1:4] == (("?", "?16"), ("?16", 1), 1)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda a: a.mark_shape_dynamic(2), "out of range"),
        (lambda a: a.mark_shape_dynamic(-3), "out of range"),
        (lambda a: a.mark_shape_dynamic(0, divisibility=3), "power of two"),
        (lambda a: a.mark_shape_dynamic(0, divisibility=0), "power of two"),
        (lambda a: a.mark_stride_dynamic(0, divisibility=-2), "power of two"),
        (lambda a: a.mark_shape_dynamic(0, divisibility=32), "not divisible"),
        (lambda a: a.mark_layout_dynamic(leading_dim=0), "expected 1"),
        (lambda a: a.mark_layout_dynamic(leading_dim=5), "out of range"),
        (lambda a: a.mark_shape_dynamic("0"), "ints"),
        (lambda a: a.mark_shape_dynamic(True), "dims"),
        (lambda a: a.mark_layout_dynamic(divisibility=1.0), "power of two"),
    ],
)
def test_bad_marks_raise_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call(jc.from_dlpack(torch.randn(16, 8)))


def test_assumed_align():
    x = torch.randn(64)
    assert jc.from_dlpack(x, assumed_align=16).__cache_signature__()[4] == 16
    with pytest.raises(ValueError, match="aligned"):
        jc.from_dlpack(x[1:], assumed_align=16)
    with pytest.raises(ValueError, match="power of two"):
        jc.from_dlpack(x, assumed_align=12)


# --- property tests -------------------------------------------------------------------------
_DTYPES = [d.torch_dtype for d in dtypes.ALL if d.kind != "fp4"]


@st.composite
def strided_tensors(draw):
    """Any layout: random shape, strides (zero, unit, permuted, gapped) and storage offset."""
    dtype = draw(st.sampled_from(_DTYPES))
    ndim = draw(st.integers(0, 4))
    shape = draw(st.lists(st.integers(0, 5), min_size=ndim, max_size=ndim))
    strides = draw(st.lists(st.integers(0, 12), min_size=ndim, max_size=ndim))
    offset = draw(st.integers(0, 7))
    extent = offset + sum((s - 1) * stride for s, stride in zip(shape, strides) if s > 0) + 1
    return torch.empty(extent, dtype=dtype).as_strided(shape, strides, offset)


@st.composite
def viewed_tensors(draw):
    """Layouts reached the way users reach them: permute, slice with steps, expand, offset."""
    dtype = draw(st.sampled_from(_DTYPES))
    shape = draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
    tensor = torch.empty(shape, dtype=dtype)
    if draw(st.booleans()):
        tensor = tensor.permute(*draw(st.permutations(range(len(shape)))))
    slices = []
    for size in tensor.shape:
        start = draw(st.integers(0, max(size - 1, 0)))
        step = draw(st.integers(1, 3))
        slices.append(slice(start, None, step))
    tensor = tensor[tuple(slices)]
    if draw(st.booleans()) and tensor.ndim:
        dim = draw(st.integers(0, tensor.ndim - 1))
        tensor = tensor.unsqueeze(dim)
        sizes = list(tensor.shape)
        sizes[dim] = draw(st.integers(0, 4))
        tensor = tensor.expand(sizes)
    if draw(st.booleans()):
        tensor = tensor.unsqueeze(draw(st.integers(0, tensor.ndim)))
    return tensor


_SETTINGS = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_SETTINGS
@given(strided_tensors())
def test_property_any_strided_layout(tensor):
    assert_parity(tensor)


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(viewed_tensors())
def test_property_user_views(tensor):
    assert_parity(tensor)


# --- the dispatcher's inline key and the Python lean token: one definition, one answer --------
def _inline_token():
    """The key element the @jit dispatcher computes inline for a tensor parameter: the
    hit-path lines of a one-parameter key plan, compiled as the dispatcher compiles them."""
    plan = KeyPlan([Parameter("t")])
    body = "".join(f"    {line}\n" for line in plan.key_lines(hit_path=True))
    source = f"def inline(_a0):\n{body}    return _key[0]\n"
    return generated.define(source, generated.source_filename("test inline key"), dict(plan.namespace))["inline"]


_INLINE = _inline_token()


class _Plain(torch.Tensor):
    """A subclass without its own dispatch: keyed like its data, through the generic path."""


def _unusual(tensor, how):
    if how == "negative bit":
        return torch._neg_view(tensor)
    if how == "conjugate bit":
        return tensor.to(torch.complex64).conj()
    if how == "imag of a conjugate":  # a negative-bit real view
        return tensor.to(torch.complex64).conj().imag
    if how == "meta":
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
    if how == "sparse":
        return tensor.to_sparse() if tensor.dtype in (torch.float32, torch.int32, torch.bool) else tensor
    if how in ("requires grad", "parameter"):
        tensor = torch.empty_strided(tensor.shape, tensor.stride(), dtype=torch.float32)
        return tensor.requires_grad_() if how == "requires grad" else torch.nn.Parameter(tensor)
    if how == "subclass":
        return tensor.as_subclass(_Plain)
    if how == "efficient zero":
        return torch._efficientzerotensor(tensor.shape, dtype=tensor.dtype)
    return tensor


_UNUSUAL = [
    "none",
    "negative bit",
    "conjugate bit",
    "imag of a conjugate",
    "meta",
    "sparse",
    "requires grad",
    "parameter",
    "subclass",
    "efficient zero",
]


def assert_one_lean_key(tensor):
    """The inline key, the Python lean token and the full (DLPack) path agree, before and
    after a valid twin (same dtype, rank, unit axis, device) has filled the fast path."""
    full = outcome(lambda t: keys.argument_signature(t, "t", full=True), tensor)
    for _ in range(2):
        assert outcome(_INLINE, tensor) == outcome(tensors.lean_token, tensor) == full
        twin_strides = tensor.stride() if tensor.layout is torch.strided and not tensor.is_nested else None
        if twin_strides and tensor.dtype in dtypes.BY_TORCH and 1 in twin_strides:
            twin = torch.empty_strided(tensor.shape, twin_strides, dtype=tensor.dtype)
            if tensors.last_unit_axis(twin.stride()) == tensors.last_unit_axis(twin_strides):
                tensors.lean_token(twin)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(strided_tensors(), viewed_tensors()), st.sampled_from(_UNUSUAL))
def test_property_inline_key_equals_python_lean_token(tensor, how):
    assert_one_lean_key(_unusual(tensor, how))


@pytest.mark.parametrize("name", [*named_layouts(), *refused_tensors()])
def test_inline_key_equals_python_lean_token_on_named_tensors(name):
    tensor = {**named_layouts(), **refused_tensors()}[name]
    assert_one_lean_key(tensor)


def test_lean_token_is_generated_from_the_inlined_lines():
    inlined = [line.strip() for line in KeyPlan([Parameter("t")]).key_lines()]
    generated = [line.strip() for line in tensors.lean_token.source.splitlines()]
    for line in tensors.lean_token_lines("_a0", "_k0"):
        assert line.strip() in inlined
    for line in tensors.lean_token_lines("tensor", "_token"):
        assert line.strip() in generated
