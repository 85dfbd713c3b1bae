"""The HIP backend's pure logic (jitcore.backends.hip_abi), which needs neither ROCm nor hip-python.

Layouts are checked against offsets recomputed here from the C rules (x86-64 / LP64), from the
field lists of HIP's include/hip/hip_runtime_api.h, not read back from the ctypes classes.
"""

from __future__ import annotations

import ast
import ctypes
import importlib
import importlib.util
import pathlib
import re
import struct
import sys

import pytest

from jitcore import backends, dtypes
from jitcore.backends import abi, hip_abi
from jitcore.errors import BackendUnavailableError

HIP_PYTHON = importlib.util.find_spec("hip") is not None

# Every torch dtype HIP kernels take as a template argument, spelled independently of abi.py.
EXPECTED_TYPE_NAMES = {
    "float32": "float",
    "float64": "double",
    "float16": "__half",
    "bfloat16": "__hip_bfloat16",
    "int8": "signed char",
    "int16": "short",
    "int32": "int",
    "int64": "long long",
    "uint8": "unsigned char",
    "uint16": "unsigned short",
    "uint32": "unsigned int",
    "uint64": "unsigned long long",
    "bool": "bool",
    "float8_e4m3fn": "__hip_fp8_e4m3",
    "float8_e5m2": "__hip_fp8_e5m2",
    "float8_e4m3fnuz": "__hip_fp8_e4m3_fnuz",
    "float8_e5m2fnuz": "__hip_fp8_e5m2_fnuz",
}
NO_HIP_TYPE = ["complex32", "complex64", "complex128", "float8_e8m0fnu", "float4_e2m1fn_x2"]


# --- type names --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [d for d in dtypes.ALL if d.name in EXPECTED_TYPE_NAMES], ids=lambda d: d.name)
def test_type_name_of_every_supported_dtype(dtype):
    name = hip_abi.type_name(dtype.name)
    assert name == EXPECTED_TYPE_NAMES[dtype.name]
    # a pointer to that type accepts a tensor of that dtype, so instantiated kernels type-check
    assert abi.parse_param(f"const {name}* x").accepts_dtype(dtype.name)


def test_every_dtype_is_named_or_refused():
    for dtype in dtypes.ALL:
        assert dtype.name in EXPECTED_TYPE_NAMES or dtype.name in NO_HIP_TYPE, dtype.name
    assert not any(name.startswith("__nv") for name in abi.HIP_TYPE_NAMES.values())


@pytest.mark.parametrize("name", NO_HIP_TYPE)
def test_type_name_refuses_dtypes_hip_cannot_spell(name):
    with pytest.raises(TypeError, match=f"dtype {name} has no HIP C type"):
        hip_abi.type_name(name)


# --- prelude -----------------------------------------------------------------------------------
def includes(text: str) -> list[str]:
    return re.findall(r"#include <([^>]+)>", text)


@pytest.mark.parametrize(
    "source, type_names, expected",
    [
        ("__global__ void k(float* x, int n) {}", [], []),
        ("__global__ void k(int* x) {}", ["long long", "unsigned char"], []),
        ("__global__ void k(__half* x) {}", [], ["hip/hip_fp16.h"]),
        ("template <typename T> __global__ void k(T* x) {}", ["__half"], ["hip/hip_fp16.h"]),
        ("__global__ void k(__hip_bfloat16* x) {}", [], ["hip/hip_bf16.h"]),
        ("template <typename T> __global__ void k(T* x) {}", ["__hip_bfloat16"], ["hip/hip_bf16.h"]),
        ("__global__ void k(__hip_fp8_e4m3* x) {}", [], ["hip/hip_fp8.h"]),
        ("template <typename T> __global__ void k(T* x) {}", ["__hip_fp8_e5m2_fnuz"], ["hip/hip_fp8.h"]),
        (
            "__global__ void k(__half* a, __hip_bfloat16* b, __hip_fp8_e5m2* c) {}",
            [],
            ["hip/hip_fp16.h", "hip/hip_bf16.h", "hip/hip_fp8.h"],
        ),
    ],
)
def test_prelude_includes_only_what_is_used(source, type_names, expected):
    text = hip_abi.prelude(source, type_names)
    assert includes(text) == expected
    assert text.startswith(hip_abi.INTEGER_TYPEDEFS)
    assert "hip_runtime" not in text  # hiprtc force-includes its own runtime header
    assert "cuda" not in text


def test_half_header_is_optional_because_hiprtc_builtins_declare_half():
    text = hip_abi.prelude("__global__ void k(__half* x) {}", [])
    assert "#if __has_include(<hip/hip_fp16.h>)\n#include <hip/hip_fp16.h>\n#endif" in text
    bf16 = hip_abi.prelude("__global__ void k(__hip_bfloat16* x) {}", [])
    assert "__has_include" not in bf16  # no builtin __hip_bfloat16: a missing header must fail loudly


def test_integer_typedefs_match_hiprtcs_builtins():
    """hiprtc's builtin header (hip_runtime.h under __HIPCC_RTC__) typedefs these four; a
    redeclaration compiles only if it names the same type."""
    typedefs = dict(
        (name, " ".join(spelling.split()))
        for spelling, name in re.findall(r"typedef ([a-z ]+?) (u?int\d+_t);", hip_abi.INTEGER_TYPEDEFS)
    )
    builtin = {"uint32_t": "unsigned int", "uint64_t": "unsigned long long", "int32_t": "int", "int64_t": "long long"}
    for name, spelling in builtin.items():
        assert typedefs[name] == spelling
    sizes = {name: struct.calcsize("<" + abi.parse_param(spelling).fmt) for name, spelling in typedefs.items()}
    assert sizes == {f"{sign}int{bits}_t": bits // 8 for sign in ("", "u") for bits in (8, 16, 32, 64)}


def test_integer_typedefs_are_the_cuda_backends():
    cuda = pytest.importorskip("jitcore.backends.cuda", exc_type=ImportError)
    assert hip_abi.INTEGER_TYPEDEFS is abi.INTEGER_TYPEDEFS
    assert cuda.CudaBackend().prelude("__global__ void k(int* x) {}", []).startswith(abi.INTEGER_TYPEDEFS)


# --- architecture names ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "reported, arch",
    [
        ("gfx942:sramecc+:xnack-", "gfx942"),
        ("gfx90a:sramecc+:xnack-", "gfx90a"),
        ("gfx908:sramecc-:xnack+", "gfx908"),
        ("gfx1100", "gfx1100"),
        ("gfx950:sramecc+:xnack-", "gfx950"),
        ("gfx1201", "gfx1201"),
        (b"gfx942:sramecc+:xnack-\0\0\0\0", "gfx942"),  # hip-python <= 7.x: the raw char[256]
        (bytearray(b"gfx90a\0garbage"), "gfx90a"),
        ("  gfx1030  ", "gfx1030"),
    ],
)
def test_parse_arch(reported, arch):
    assert hip_abi.parse_arch(reported) == arch


@pytest.mark.parametrize("reported", ["", ":xnack-", "sm_90", b"\0", "amdgcn-amd-amdhsa--gfx942"])
def test_parse_arch_refuses_non_amd_names(reported):
    with pytest.raises(ValueError, match="not an AMD GPU architecture"):
        hip_abi.parse_arch(reported)


# --- struct layouts ----------------------------------------------------------------------------
POINTER = (8, 8)
UINT = (4, 4)
SIZE_T = (8, 8)
DIM3 = (12, 4)  # three uint32_t


def c_layout(fields: list[tuple[int, int]]) -> tuple[list[int], int]:
    """Offsets and size of a C struct with these (size, alignment) members."""
    offsets, offset, align = [], 0, 1
    for size, alignment in fields:
        offset = -(-offset // alignment) * alignment
        offsets.append(offset)
        offset += size
        align = max(align, alignment)
    return offsets, -(-offset // align) * align


pytestmark_lp64 = pytest.mark.skipif(ctypes.sizeof(ctypes.c_void_p) != 8, reason="HIP is 64-bit only")


@pytestmark_lp64
def test_kernel_node_params_layout():
    # hip_runtime_api.h: { dim3 blockDim; void** extra; void* func; dim3 gridDim;
    #                      void** kernelParams; unsigned int sharedMemBytes; }
    names = ["blockDim", "extra", "func", "gridDim", "kernelParams", "sharedMemBytes"]
    offsets, size = c_layout([DIM3, POINTER, POINTER, DIM3, POINTER, UINT])
    assert (offsets, size) == ([0, 16, 24, 32, 48, 56], 64)
    cls = hip_abi.HipKernelNodeParams
    assert [name for name, _ in cls._fields_] == names
    assert [getattr(cls, name).offset for name in names] == offsets
    assert ctypes.sizeof(cls) == size and ctypes.alignment(cls) == 8


@pytestmark_lp64
def test_memset_params_layout():
    # hip_runtime_api.h: { void* dst; unsigned int elementSize; size_t height; size_t pitch;
    #                      unsigned int value; size_t width; }
    names = ["dst", "elementSize", "height", "pitch", "value", "width"]
    offsets, size = c_layout([POINTER, UINT, SIZE_T, SIZE_T, UINT, SIZE_T])
    assert (offsets, size) == ([0, 8, 16, 24, 32, 40], 48)
    cls = hip_abi.HipMemsetParams
    assert [name for name, _ in cls._fields_] == names
    assert [getattr(cls, name).offset for name in names] == offsets
    assert ctypes.sizeof(cls) == size


def test_dim3_layout():
    assert ctypes.sizeof(hip_abi.Dim3) == 12 and ctypes.alignment(hip_abi.Dim3) == 4
    assert [hip_abi.Dim3.x.offset, hip_abi.Dim3.y.offset, hip_abi.Dim3.z.offset] == [0, 4, 8]


@pytestmark_lp64
def test_kernel_node_params_round_trip_through_raw_bytes():
    """Fill the ctypes struct, read it back as the C layout says the bytes lie."""
    params = hip_abi.HipKernelNodeParams()
    params.blockDim = hip_abi.Dim3(128, 2, 1)
    params.extra = 0x1111
    params.func = 0x2222
    params.gridDim = hip_abi.Dim3(4096, 3, 7)
    params.kernelParams = 0x3333
    params.sharedMemBytes = 49152
    raw = bytes(params)
    assert struct.unpack_from("<3I", raw, 0) == (128, 2, 1)
    assert struct.unpack_from("<QQ", raw, 16) == (0x1111, 0x2222)
    assert struct.unpack_from("<3I", raw, 32) == (4096, 3, 7)
    assert struct.unpack_from("<QI", raw, 48) == (0x3333, 49152)


# --- kernel arguments passed through `extra` -----------------------------------------------------
def test_kernarg_offsets_follow_natural_alignment():
    assert hip_abi.kernarg_offsets([]) == []
    assert hip_abi.kernarg_offsets([4, 8]) == [0, 8]
    assert hip_abi.kernarg_offsets([1, 2, 4, 8, 1, 8]) == [0, 2, 4, 8, 16, 24]
    assert hip_abi.kernarg_offsets([2, 12, 16]) == [0, 4, 16]  # float3 aligns to 4, float4 to 16
    # the same offsets as the parameter buffer jitcore packs itself
    layout = abi.ParamLayout.of(abi.parse_signature("char a, double b, short c, const float* p, int n"))
    assert hip_abi.kernarg_offsets([t.size for t in layout.types]) == list(layout.offsets)


def test_extra_kernarg_buffer():
    kernargs = (ctypes.c_char * 16)()
    size = ctypes.c_size_t(16)
    extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(kernargs), 2, ctypes.addressof(size), 0)
    assert hip_abi.extra_kernarg_buffer(ctypes.addressof(extra)) == (ctypes.addressof(kernargs), 16)
    assert hip_abi.extra_kernarg_buffer(0) is None
    only_end = (ctypes.c_void_p * 2)(0, 0)
    assert hip_abi.extra_kernarg_buffer(ctypes.addressof(only_end)) is None
    no_size = (ctypes.c_void_p * 3)(1, ctypes.addressof(kernargs), 0)
    assert hip_abi.extra_kernarg_buffer(ctypes.addressof(no_size)) is None


# --- the ctypes side of libamdhip64 ------------------------------------------------------------
def test_loaded_hip_runtimes_from_proc_maps():
    maps = "\n".join(
        [
            "7f0000000000-7f0000100000 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6",
            "7f1000000000-7f1000100000 r--p 00000000 08:01 2 /site/torch/lib/libamdhip64.so",
            "7f1000100000-7f1000200000 r-xp 00100000 08:01 2 /site/torch/lib/libamdhip64.so",
            "7f2000000000-7f2000100000 r-xp 00000000 08:01 3 /opt/rocm-6.2.0/lib/libamdhip64.so.6.2.41133 (deleted)",
            "7f3000000000-7f3000100000 rw-p 00000000 00:00 0 ",
            "7f4000000000-7f4000100000 r-xp 00000000 08:01 4 /opt/rocm/lib/libhiprtc.so.6",
            "7ffd00000000-7ffd00100000 rw-p 00000000 00:00 0                          [stack]",
        ]
    )
    assert hip_abi.loaded_hip_runtimes(maps) == [
        "/site/torch/lib/libamdhip64.so",
        "/opt/rocm-6.2.0/lib/libamdhip64.so.6.2.41133",
    ]
    assert hip_abi.loaded_hip_runtimes("") == []


def test_declare_graph_api_sets_prototypes():
    class Library:
        def __init__(self):
            for name in hip_abi.graph_function_names():
                setattr(self, name, type(name, (), {})())

    library = hip_abi.declare_graph_api(Library())
    assert set(hip_abi.graph_function_names()) == {
        "hipGraphGetNodes",
        "hipGraphNodeGetType",
        "hipGraphKernelNodeGetParams",
        "hipGraphMemsetNodeGetParams",
        "hipGraphExecKernelNodeSetParams",
    }
    for name in hip_abi.graph_function_names():
        function = getattr(library, name)
        assert function.restype is ctypes.c_int
        assert function.errcheck(3, function, ()) == (3,)  # hip-python's (status,) convention
    assert library.hipGraphGetNodes.argtypes[1] is ctypes.POINTER(ctypes.c_void_p)
    assert library.hipGraphKernelNodeGetParams.argtypes[1] is ctypes.POINTER(hip_abi.HipKernelNodeParams)
    assert len(library.hipGraphExecKernelNodeSetParams.argtypes) == 3


def test_declared_prototypes_marshal_as_c_expects():
    """Call a libc function through a prototype built the same way, to see the tuple come back."""
    libc = ctypes.CDLL(None)
    strlen = libc.strlen
    strlen.argtypes, strlen.restype, strlen.errcheck = [ctypes.c_char_p], ctypes.c_int, hip_abi._status_tuple
    assert strlen(b"gfx942") == (6,)


# --- no vendor binding here; the backend names the extra when hip-python is missing -------------
def test_hip_abi_imports_no_vendor_binding():
    tree = ast.parse(pathlib.Path(hip_abi.__file__).read_text())
    modules = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    } | {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert modules <= {"__future__", "ctypes", "os", "re", "collections", "jitcore"}


@pytest.mark.skipif(HIP_PYTHON, reason="hip-python is installed here")
def test_backend_without_hip_python_names_the_extra(monkeypatch):
    monkeypatch.delitem(sys.modules, "jitcore.backends.hip", raising=False)
    monkeypatch.setattr(backends, "_instances", {})
    with pytest.raises(BackendUnavailableError, match=r"pip install 'jitreplay\[rocm\]'") as raised:
        backends.get_backend("hip")
    assert "hip-python" in str(raised.value)  # raised by hip.py itself, not the generic fallback
    with pytest.raises(BackendUnavailableError, match=r"jitreplay\[rocm\]"):
        importlib.import_module("jitcore.backends.hip")
    assert "jitcore.backends.hip" not in sys.modules


def test_backend_with_hip_python_hidden_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "hip", None)
    monkeypatch.delitem(sys.modules, "jitcore.backends.hip", raising=False)
    monkeypatch.setattr(backends, "_instances", {})
    with pytest.raises(BackendUnavailableError, match=r"pip install 'jitreplay\[rocm\]'"):
        backends.get_backend("hip")
