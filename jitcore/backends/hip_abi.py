"""HIP data and pure logic for :mod:`jitcore.backends.hip`, importable without any vendor binding.

Everything here runs (and is tested) on a machine without ROCm: the C type names of template
arguments, the prelude, the parsing of ``gcnArchName``, the ctypes mirrors of the HIP structs
the graph calls fill in, the parsing of a kernel node's ``extra`` array, and the prototypes of
the few ``libamdhip64`` functions that are called through ctypes.

The struct layouts and enum values are copied from HIP's ``include/hip/hip_runtime_api.h``
(ROCm/HIP, identical in hip-python's generated ``chip.pxd`` for ROCm 6.2 and in the header of
ROCm 7.x); the test suite recomputes every offset from the C layout rules on its own.
"""

from __future__ import annotations

import ctypes
import os
import re
from collections.abc import Sequence

from jitcore.backends import abi
from jitcore.backends.abi import HIP_TYPE_NAMES, INTEGER_TYPEDEFS

#: The HIP runtime hip-python opens (``DLL = b"libamdhip64.so"`` in its generated chip.pyx).
HIP_LIBRARY = "libamdhip64.so"

# hipGraphNodeType (hip_runtime_api.h): only the three kinds replay looks inside.
GRAPH_NODE_KERNEL = 0
GRAPH_NODE_MEMCPY = 1
GRAPH_NODE_MEMSET = 2

# Markers of a kernel launch's ``extra`` array (hip_runtime_api.h, the same values as CUDA's).
HIP_LAUNCH_PARAM_END = 0
HIP_LAUNCH_PARAM_BUFFER_POINTER = 1
HIP_LAUNCH_PARAM_BUFFER_SIZE = 2


def type_name(dtype_name: str) -> str:
    """The HIP C type a template argument of this dtype becomes."""
    try:
        return HIP_TYPE_NAMES[dtype_name]
    except KeyError:
        raise TypeError(f"dtype {dtype_name} has no HIP C type for a template argument") from None


_HEADERS = (
    # hiprtc's builtins already declare __half (amd_hip_fp16.h is part of them): the header is
    # only included where the ROCm include directory is on the search path.
    ("half", "#if __has_include(<hip/hip_fp16.h>)\n#include <hip/hip_fp16.h>\n#endif"),
    ("bfloat16", "#include <hip/hip_bf16.h>"),
    ("__hip_fp8", "#include <hip/hip_fp8.h>"),
)


def prelude(source: str, type_names: Sequence[str]) -> str:
    """Integer typedefs (:data:`jitcore.backends.abi.INTEGER_TYPEDEFS`, which hiprtc's builtins
    accept), and the vendor headers for the reduced-precision types in use.

    No ``#include <hip/hip_runtime.h>``: hiprtc force-includes its builtin runtime header
    (hiprtc_runtime.h) and compiles with -nogpuinc, so every other header must be found
    through the -I the backend adds. ``__hip_bfloat16`` is declared in
    ``amd_detail/amd_hip_bf16.h``, which ``<hip/hip_bf16.h>`` includes (``<hip/hip_bfloat16.h>``
    is the older ``hip_bfloat16`` class, already part of hiprtc's builtins); the fp8 types
    (``__hip_fp8_e4m3``, ``__hip_fp8_e5m2`` and the ``_fnuz`` pair) come from ``<hip/hip_fp8.h>``.
    """
    return abi.prelude(source, type_names, _HEADERS)


_ARCH = re.compile(r"^gfx[0-9a-z]+(?:-[0-9a-z]+)*$")


def parse_arch(gcn_arch_name: str | bytes) -> str:
    """``"gfx942:sramecc+:xnack-"`` -> ``"gfx942"``: the processor without its target features.

    Code compiled for the bare processor has the features set to "any", so it loads whether
    the device runs with XNACK or SRAMECC on or off. hip-python up to 7.x returns the
    ``char[256]`` field as bytes, 10.x as str; both are accepted.
    """
    if isinstance(gcn_arch_name, (bytes, bytearray)):
        gcn_arch_name = bytes(gcn_arch_name).split(b"\0", 1)[0].decode("ascii", errors="replace")
    name = gcn_arch_name.split("\0", 1)[0].strip().split(":", 1)[0].strip()
    if not _ARCH.match(name):
        raise ValueError(f"not an AMD GPU architecture name: {gcn_arch_name!r}")
    return name


class Dim3(ctypes.Structure):
    """``dim3``: three ``uint32_t``."""

    _fields_ = [("x", ctypes.c_uint32), ("y", ctypes.c_uint32), ("z", ctypes.c_uint32)]


class HipKernelNodeParams(ctypes.Structure):
    """``hipKernelNodeParams``, in HIP's field order (not CUDA's: blockDim comes first)."""

    _fields_ = [
        ("blockDim", Dim3),
        ("extra", ctypes.c_void_p),  # void**
        ("func", ctypes.c_void_p),
        ("gridDim", Dim3),
        ("kernelParams", ctypes.c_void_p),  # void**
        ("sharedMemBytes", ctypes.c_uint),
    ]


class HipMemsetParams(ctypes.Structure):
    """``hipMemsetParams``."""

    _fields_ = [
        ("dst", ctypes.c_void_p),
        ("elementSize", ctypes.c_uint),
        ("height", ctypes.c_size_t),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("width", ctypes.c_size_t),
    ]


def _status_tuple(result: int, func: object, arguments: tuple) -> tuple[int]:
    """ctypes ``errcheck``: return ``(status,)`` as hip-python does, so one check serves both."""
    return (result,)


_VP = ctypes.c_void_p
_GRAPH_PROTOTYPES: dict[str, list] = {
    # hipError_t hipGraphGetNodes(hipGraph_t graph, hipGraphNode_t* nodes, size_t* numNodes)
    "hipGraphGetNodes": [_VP, ctypes.POINTER(_VP), ctypes.POINTER(ctypes.c_size_t)],
    # hipError_t hipGraphNodeGetType(hipGraphNode_t node, hipGraphNodeType* pType)
    "hipGraphNodeGetType": [_VP, ctypes.POINTER(ctypes.c_int)],
    # hipError_t hipGraphKernelNodeGetParams(hipGraphNode_t node, hipKernelNodeParams* pNodeParams)
    "hipGraphKernelNodeGetParams": [_VP, ctypes.POINTER(HipKernelNodeParams)],
    # hipError_t hipGraphMemsetNodeGetParams(hipGraphNode_t node, hipMemsetParams* pNodeParams)
    "hipGraphMemsetNodeGetParams": [_VP, ctypes.POINTER(HipMemsetParams)],
    # hipError_t hipGraphExecKernelNodeSetParams(hipGraphExec_t, hipGraphNode_t, const hipKernelNodeParams*)
    "hipGraphExecKernelNodeSetParams": [_VP, _VP, ctypes.POINTER(HipKernelNodeParams)],
}


def declare_graph_api(library: object) -> object:
    """Give the graph functions of a ``ctypes.CDLL`` of libamdhip64 their C prototypes.

    Each returns a one-tuple ``(status,)`` like every hip-python call, so generated code and
    the backend's result check (:class:`jitcore.backends.vendor.StatusCheck`) treat both the
    same way.
    """
    for name, argtypes in _GRAPH_PROTOTYPES.items():
        function = getattr(library, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int  # hipError_t
        function.errcheck = _status_tuple
    return library


def graph_function_names() -> tuple[str, ...]:
    return tuple(_GRAPH_PROTOTYPES)


def kernarg_offsets(sizes: Sequence[int]) -> list[int]:
    """Offsets of parameters of these sizes in one packed kernel-argument buffer.

    Each parameter sits at its natural alignment, taken as the largest power of two dividing
    its size (at most 16): exact for the scalars and pointers jitcore passes by value, the
    same rule :class:`jitcore.backends.abi.ParamLayout` applies.
    """
    offsets, offset = [], 0
    for size in sizes:
        align = min(size & -size, 16) if size > 0 else 1
        offset = (offset + align - 1) // align * align
        offsets.append(offset)
        offset += size
    return offsets


def extra_kernarg_buffer(extra_address: int, max_entries: int = 16) -> tuple[int, int] | None:
    """Read a launch's ``extra`` array (``{BUFFER_POINTER, buf, BUFFER_SIZE, &size, END}``).

    Returns ``(buffer address, buffer size)``, or None when the array names no buffer. HIP
    graph kernel nodes keep their own copy of such an array (``GraphKernelNode::copyParams``
    in ROCm's clr), so a node whose ``kernelParams`` is NULL can still be read through it.
    """
    if not extra_address:
        return None
    entries = (ctypes.c_void_p * (2 * max_entries)).from_address(extra_address)
    buffer = size = None
    for index in range(0, 2 * max_entries, 2):
        key = entries[index] or 0
        if key == HIP_LAUNCH_PARAM_END:
            break
        value = entries[index + 1] or 0
        if key == HIP_LAUNCH_PARAM_BUFFER_POINTER:
            buffer = value
        elif key == HIP_LAUNCH_PARAM_BUFFER_SIZE and value:
            size = ctypes.c_size_t.from_address(value).value
    if not buffer or size is None:
        return None
    return buffer, size


def loaded_hip_runtimes(maps_text: str) -> list[str]:
    """The distinct ``libamdhip64`` files mapped into a process (from ``/proc/<pid>/maps``).

    The kernel records resolved paths, so two entries are two runtimes, not two symlinks.
    """
    paths: list[str] = []
    for line in maps_text.splitlines():
        fields = line.split(None, 5)
        if len(fields) < 6:
            continue
        path = fields[5].strip()
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        if os.path.basename(path).startswith("libamdhip64.so") and path not in paths:
            paths.append(path)
    return paths


__all__ = [
    "GRAPH_NODE_KERNEL",
    "GRAPH_NODE_MEMCPY",
    "GRAPH_NODE_MEMSET",
    "HIP_LIBRARY",
    "INTEGER_TYPEDEFS",
    "Dim3",
    "HipKernelNodeParams",
    "HipMemsetParams",
    "declare_graph_api",
    "extra_kernarg_buffer",
    "graph_function_names",
    "kernarg_offsets",
    "loaded_hip_runtimes",
    "parse_arch",
    "prelude",
    "type_name",
]
