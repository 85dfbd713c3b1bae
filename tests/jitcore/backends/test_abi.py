"""Parameter types, declarations, layouts and packing (vendor-neutral ABI)."""

from __future__ import annotations

import ctypes
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jitcore import dtypes
from jitcore.backends import abi
from jitcore.errors import ArgumentError

_CTYPES = {
    "b": ctypes.c_int8,
    "B": ctypes.c_uint8,
    "h": ctypes.c_int16,
    "H": ctypes.c_uint16,
    "i": ctypes.c_int32,
    "I": ctypes.c_uint32,
    "q": ctypes.c_int64,
    "Q": ctypes.c_uint64,
    "f": ctypes.c_float,
    "d": ctypes.c_double,
    "?": ctypes.c_bool,
    "e": ctypes.c_uint16,
}

SCALAR_SPELLINGS = {
    "signed char": "b",
    "int8_t": "b",
    "char": "b",
    "unsigned char": "B",
    "uint8_t": "B",
    "short": "h",
    "int16_t": "h",
    "unsigned short": "H",
    "uint16_t": "H",
    "int": "i",
    "signed": "i",
    "int32_t": "i",
    "unsigned": "I",
    "unsigned int": "I",
    "uint32_t": "I",
    "long": "q",
    "long long": "q",
    "int64_t": "q",
    "ptrdiff_t": "q",
    "unsigned long": "Q",
    "unsigned long long": "Q",
    "uint64_t": "Q",
    "size_t": "Q",
    "bool": "?",
    "float": "f",
    "double": "d",
    "__half": "e",
    "half": "e",
    "__nv_bfloat16": "H",
    "__hip_bfloat16": "H",
}


@pytest.mark.parametrize("spelling, fmt", SCALAR_SPELLINGS.items())
def test_every_scalar_type(spelling, fmt):
    for declaration in (spelling, f"{spelling} value", f"const {spelling} value"):
        param = abi.parse_param(declaration)
        assert param.fmt == fmt and param.kind != "pointer"
        assert param.size == struct.calcsize("<" + fmt) == param.align


@pytest.mark.parametrize(
    "declaration, pointee, const, name",
    [
        ("float* x", "float", False, "x"),
        ("const float* __restrict__ x", "float", True, "x"),
        ("float const * y", "float", True, "y"),
        ("float * __restrict__ const out", "float", False, "out"),
        ("const __half *h", "__half", True, "h"),
        ("void* p", "void", False, "p"),
        ("const int64_t* __restrict idx", "int64_t", True, "idx"),
        ("double v[]", "double", False, "v"),
        ("float4* vec", "float4", False, "vec"),
        ("float** table", "void*", False, "table"),
        ("const float*", "float", True, None),
    ],
)
def test_pointers(declaration, pointee, const, name):
    param = abi.parse_param(declaration)
    assert (param.kind, param.pointee, param.const_pointee, param.name, param.size) == (
        "pointer",
        pointee,
        const,
        name,
        8,
    )


def test_pointer_dtype_acceptance():
    assert abi.parse_param("const float* x").accepts_dtype("float32")
    assert not abi.parse_param("const float* x").accepts_dtype("float16")
    assert abi.parse_param("uint8_t* x").accepts_dtype("float8_e4m3fn")
    assert abi.parse_param("void* x").accepts_dtype("int64")
    assert abi.parse_param("MyStruct* x").accepts_dtype("float32")  # opaque pointee: any dtype
    assert abi.parse_param("__nv_fp8_e4m3* x").accepts_dtype("float8_e4m3fn")
    assert not abi.parse_param("__nv_fp8_e4m3* x").accepts_dtype("float8_e5m2")


@pytest.mark.parametrize(
    "declaration, match",
    [
        ("float& x", "references"),
        ("Pair p", "not supported by value"),
        ("float4 v", "not supported by value"),
        ("void (*f)(int)", "function pointers"),
        ("", "empty"),
    ],
)
def test_unsupported_parameters_are_rejected_clearly(declaration, match):
    with pytest.raises(ArgumentError, match=match):
        abi.parse_param(declaration)


def test_find_kernel_with_templates_attributes_and_comments():
    source = """
    // __global__ void axpy(int decoy) {}
    template <typename T, int BLOCK = 128, bool FAST=false>
    __global__ void __launch_bounds__(BLOCK) axpy(const T* __restrict__ x, T* y, Pair<int, int> p, int n) {}
    extern "C" __global__ void other(float* a) {}
    """
    decl = abi.find_kernel(source, "axpy")
    assert decl.template_params == (("type", "T", None), ("value", "BLOCK", "128"), ("value", "FAST", "false"))
    assert decl.params_text == ("const T* __restrict__ x", "T* y", "Pair<int, int> p", "int n")
    assert abi.find_kernel(source, "other").params_text == ("float* a",)
    with pytest.raises(ArgumentError, match="no __global__ function named 'missing'"):
        abi.find_kernel(source, "missing")
    with pytest.raises(ArgumentError, match="2 __global__ functions named 'k'"):
        abi.find_kernel("__global__ void k(int a) {}\n__global__ void k(float a) {}", "k")


def test_substitution_is_token_wise():
    assert abi.substitute("const T* __restrict__ Tx, TT y", {"T": "__half"}) == "const __half* __restrict__ Tx, TT y"


def test_explicit_signature():
    params = abi.parse_signature("const float* x, float* y, int n, float alpha")
    assert [p.fmt for p in params] == ["Q", "Q", "i", "f"]
    assert abi.parse_signature("void") == () == abi.parse_signature("")


_TYPES = st.sampled_from(list(SCALAR_SPELLINGS) + ["float*", "const double*", "void*"])


@settings(max_examples=300, deadline=None)
@given(st.lists(_TYPES, min_size=1, max_size=12))
def test_layout_matches_ctypes_structure(spellings):
    types = [abi.parse_param(s) for s in spellings]
    layout = abi.ParamLayout.of(types)
    fields = [(f"f{i}", ctypes.c_void_p if t.is_pointer else _CTYPES[t.fmt]) for i, t in enumerate(types)]
    structure = type("Params", (ctypes.Structure,), {"_fields_": fields})
    assert layout.offsets == tuple(getattr(structure, name).offset for name, _ in fields)
    assert layout.size == ctypes.sizeof(structure)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["char", "short", "int", "long long", "float", "double", "bool", "float*"]),
        min_size=1,
        max_size=8,
    ),
    st.data(),
)
def test_packing_runs_write_exactly_their_slots(spellings, data):
    types = [abi.parse_param(s) for s in spellings]
    layout = abi.ParamLayout.of(types)
    packed = abi.PackedParams(layout)
    ctypes.memset(packed.buffer, 0xAB, layout.size)
    values = []
    for t in types:
        if t.kind in ("int", "pointer", "uint"):
            bits = t.size * 8
            lo, hi = (0, 2**bits - 1) if t.kind != "int" else (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1)
            values.append(data.draw(st.integers(lo, hi)))
        elif t.kind == "bool":
            values.append(data.draw(st.booleans()))
        else:
            values.append(float(data.draw(st.integers(-1000, 1000))))
    chosen = sorted(set(data.draw(st.lists(st.integers(0, len(types) - 1), min_size=1))))
    for run in layout.runs(chosen):
        offset, packer = layout.struct_for(run)
        packer.pack_into(packed.buffer, offset, *[values[i] for i in run])
    fields = [(f"f{i}", ctypes.c_void_p if t.is_pointer else _CTYPES[t.fmt]) for i, t in enumerate(types)]
    view = type("P", (ctypes.Structure,), {"_fields_": fields}).from_buffer(packed.buffer)
    for i, t in enumerate(types):
        raw = packed.param_bytes(i)
        if i in chosen:
            got = getattr(view, f"f{i}")
            assert (got or 0) == values[i] if t.is_pointer else got == values[i]
        else:
            assert raw == b"\xab" * t.size  # untouched
    # the void* array points at each slot
    for i, offset in enumerate(layout.offsets):
        assert packed.pointers[i] == packed.buffer_address + offset


def test_bfloat16_rounding():
    assert abi.float_to_bfloat16_bits(1.0) == 0x3F80
    assert abi.float_to_bfloat16_bits(-2.5) == 0xC020
    assert abi.float_to_bfloat16_bits(1.00390625) == 0x3F80  # ties to even
    assert abi.float_to_bfloat16_bits(float("nan")) == 0x7FC0


# --- every spelling of a scalar type, by value and behind a pointer -----------------------------
ALL_DTYPES = frozenset(d.name for d in dtypes.ALL)
BYTE_STORAGE = frozenset(
    ["uint8", "bool", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu"]
    + ["float4_e2m1fn_x2"]
)
# An oracle written apart from the ABI's tables: (struct format, dtypes a pointer to it takes)
# of each integer type, by its base keywords and signedness (None: not written).
INTEGER_ORACLE = {
    ("char", None): ("b", {"int8", "uint8", "bool"}),  # plain char: signed here, and any byte
    ("char", "signed"): ("b", {"int8"}),
    ("char", "unsigned"): ("B", BYTE_STORAGE),
    ("short", None): ("h", {"int16"}),
    ("short", "signed"): ("h", {"int16"}),
    ("short", "unsigned"): ("H", {"uint16"}),
    ("int", None): ("i", {"int32"}),
    ("int", "signed"): ("i", {"int32"}),
    ("int", "unsigned"): ("I", {"uint32"}),
    ("long", None): ("q", {"int64"}),
    ("long", "signed"): ("q", {"int64"}),
    ("long", "unsigned"): ("Q", {"uint64"}),
    ("long long", None): ("q", {"int64"}),
    ("long long", "signed"): ("q", {"int64"}),
    ("long long", "unsigned"): ("Q", {"uint64"}),
}


def accepted_dtypes(declaration: str) -> frozenset[str]:
    param = abi.parse_param(declaration)
    assert param.is_pointer
    return frozenset(name for name in ALL_DTYPES if param.accepts_dtype(name))


@st.composite
def integer_spellings(draw) -> tuple[str, tuple[str, str | None]]:
    """Any spelling C allows of one integer type: its keywords in any order, with or without
    a redundant ``int`` (and, for int itself, ``signed``/``unsigned`` alone)."""
    base, sign = draw(st.sampled_from(sorted(INTEGER_ORACLE, key=str)))
    words = base.split()
    if base != "char" and (draw(st.booleans()) or (base == "int" and sign is None)):
        words = [w for w in words if w != "int"] + ["int"]
    elif base == "int":
        words = []
    if sign is not None:
        words.append(sign)
    return " ".join(draw(st.permutations(words))), (base, sign)


@settings(max_examples=300, deadline=None)
@given(spelled=integer_spellings(), qualified=st.booleans(), restrict=st.booleans())
def test_property_every_word_order_of_an_integer_type_is_that_type(spelled, qualified, restrict):
    spelling, key = spelled
    fmt, pointee = INTEGER_ORACLE[key]
    for declaration, name in ((spelling, None), (f"{spelling} value", "value"), (f"const {spelling} n", "n")):
        param = abi.parse_param(declaration)
        assert (param.fmt, param.kind, param.name) == (fmt, "int" if fmt.islower() else "uint", name), declaration
    const = "const " if qualified else ""
    pointer = f"{const}{spelling}* {'__restrict__ ' if restrict else ''}p"
    assert accepted_dtypes(pointer) == pointee, pointer
    assert accepted_dtypes(f"{spelling} const* q") == pointee


STD_TYPEDEFS = ["int8_t", "uint8_t", "int16_t", "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t"]
STD_TYPEDEFS += ["size_t", "ptrdiff_t", "intptr_t", "uintptr_t"]


@pytest.mark.parametrize("spelling", sorted(abi._SCALARS))
def test_no_spelling_of_a_scalar_is_an_opaque_pointee(spelling):
    """A type the ABI takes by value has the dtypes of its own kind and size behind a pointer
    (never every dtype, as an opaque struct or typedef has), under every name it has."""
    fmt, size, _kind = abi._SCALARS[spelling]
    accepted = accepted_dtypes(f"const {spelling}* x")
    assert accepted != ALL_DTYPES and accepted
    assert all(dtypes.BY_NAME[name].itemsize == size for name in accepted if not name.startswith("float4"))
    names = [spelling] + (
        [f"std::{spelling}", f"::{spelling}", f"std :: {spelling}"] if spelling in STD_TYPEDEFS else []
    )
    for name in names:
        assert accepted_dtypes(f"{name}* y") == accepted, name
        assert abi.parse_param(f"{name} v").fmt == fmt, name


@pytest.mark.parametrize(
    "declaration, dtypes_taken",
    [
        ("const unsigned long long int* x", {"uint64"}),  # the spellings the review found opaque
        ("const signed long long* x", {"int64"}),
        ("const unsigned long int* x", {"uint64"}),
        ("const signed short* x", {"int16"}),
        ("const signed short int* x", {"int16"}),
        ("const signed long* x", {"int64"}),
        ("const ptrdiff_t* x", {"int64"}),
        ("const intptr_t* x", {"int64"}),
        ("const ssize_t* x", {"int64"}),
        ("const uintptr_t* x", {"uint64"}),
        ("const long unsigned int* x", {"uint64"}),
        ("const std::int64_t* x", {"int64"}),
        ("const std::uint8_t* x", BYTE_STORAGE),
        ("long double* x", set()),  # no torch dtype is a long double: none is taken
    ],
)
def test_pointees_the_review_found_opaque_take_their_dtypes(declaration, dtypes_taken):
    assert accepted_dtypes(declaration) == dtypes_taken


def test_canonical_type_resolves_spellings_and_leaves_unknown_types_alone():
    assert abi.canonical_type("int long unsigned") == "unsigned long"
    assert abi.canonical_type("char signed") == "signed char"
    assert abi.canonical_type("std::size_t") == abi.canonical_type("size_t") == "unsigned long"
    for unknown in ("scalar_t", "short long", "signed unsigned", "long long long", "std::scalar_t", "MyStruct"):
        assert abi.canonical_type(unknown) == unknown
        assert abi.parse_param(f"{unknown}* p").accepts_dtype("float32")  # opaque: any dtype


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.sampled_from(["char", "short", "int", "long long", "double", "float*"]), min_size=0, max_size=6),
    st.binary(max_size=80),
)
def test_packed_params_start_from_the_layouts_bytes_of_initial(spellings, initial):
    """The buffer holds the first ``layout.size`` bytes of ``initial`` and zeros after them, whatever
    its length (the recorded bytes of a node may be longer or shorter than the layout); the pointer
    array points at each parameter's offset in it."""
    layout = abi.ParamLayout.of([abi.parse_param(s) for s in spellings])
    packed = abi.PackedParams(layout, initial)
    size = max(layout.size, 8)
    expected = initial[: layout.size] + bytes(size - len(initial[: layout.size]))
    assert bytes(packed.buffer) == expected
    assert [packed.pointers[i] or 0 for i in range(len(layout.offsets))] == [
        packed.buffer_address + offset for offset in layout.offsets
    ]
