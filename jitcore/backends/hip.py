"""AMD backend: the HIP runtime and hiprtc through ``hip-python``, graph nodes through ctypes.

The only module (with :mod:`jitcore.backends.cuda`) that imports a vendor binding. It mirrors
the CUDA backend call for call; the data and pure logic live in
:mod:`jitcore.backends.hip_abi`, which imports no binding and is tested on any machine.

Where it departs from the CUDA backend, and why:

* Graph nodes are enumerated and read through ctypes on libamdhip64: hip-python's
  ``hipGraphGetNodes`` hands the runtime a one-slot output array with an uninitialised count,
  and its ``hipGraphKernelNodeGetParams`` changed signature between hip-python 7.x and 10.x.
* HIP has no ``cuFuncGetParamInfo``: :meth:`HipBackend.kernel_param_sizes` answers None.
* ``hipFuncSetAttribute`` takes a host stub, not a module function (ROCm's clr looks it up
  with ``getStatFunc`` and fails with hipErrorInvalidSymbol), and AMD GPUs have no opt-in
  shared-memory limit: every kernel may already use all of the LDS not taken statically.
* ``hipGetDeviceProperties`` is ``(props, device) -> (status,)`` up to hip-python 7.x and
  ``(device) -> (status, props)`` from 10.x: both are handled.

None of this has run on AMD hardware; see docs/hip.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Iterator, Sequence

from jitcore.backends import hip_abi
from jitcore.backends.abi import PackedParams, ParamLayout
from jitcore.backends.base import GraphNode, LoadedFunction, NodeUpdater
from jitcore.backends.vendor import DriverBackend, RuntimeCompiler, StatusCheck
from jitcore.dtypes import DType
from jitcore.errors import BackendUnavailableError, DriverError

try:
    from hip import hip, hiprtc
except ImportError as exc:  # pragma: no cover - exercised by the backend-selection tests
    raise BackendUnavailableError(
        f"the HIP backend needs hip-python and a ROCm runtime: pip install 'jitreplay[rocm]' ({exc})"
    ) from exc


def _status_detail(code: object) -> str:
    try:
        _, text = hip.hipGetErrorString(hip.hipError_t(int(code)))
    except (ValueError, TypeError, RuntimeError):
        return ""
    return bytes(text).decode(errors="replace") if text is not None else ""


#: Unpacks a hip-python result tuple (or a ctypes ``(status,)``), raising DriverError on a
#: non-success status.
_check = StatusCheck(hip.hipError_t, _status_detail)


class _Hiprtc(RuntimeCompiler):
    def destroy(self, program: hiprtc.hiprtcProgram) -> None:
        # hiprtcDestroyProgram takes a hiprtcProgram*: hip-python wants a reference to the handle
        hiprtc.hiprtcDestroyProgram(program.createRef())

    def failure_hint(self, log: str) -> str:
        if "file not found" in log and not self.include_dir:
            return " (no ROCm include directory found for the vendor headers: set ROCM_PATH)"
        return ""

    def library_missing(self, exc: RuntimeError) -> Exception:
        return _library_missing(exc, "hiprtc (libhiprtc)")


def _device_attribute(device: int, name: str) -> int:
    attribute = getattr(hip.hipDeviceAttribute_t, f"hipDeviceAttribute{name}")
    return int(_check(hip.hipDeviceGetAttribute(attribute, device), f"hipDeviceGetAttribute({name})"))


def _function_attribute(function: object, name: str) -> int:
    attribute = getattr(hip.hipFunction_attribute, f"HIP_FUNC_ATTRIBUTE_{name}")
    return int(_check(hip.hipFuncGetAttribute(attribute, function), f"hipFuncGetAttribute({name})"))


def _library_missing(exc: Exception, what: str) -> BackendUnavailableError:
    """hip-python imports without ROCm and opens its libraries on the first call; a failure
    there (a RuntimeError naming dlopen) means ROCm is not installed or not found."""
    return BackendUnavailableError(f"the HIP backend could not load {what} ({exc}); a ROCm installation is needed")


def _header_include_dir() -> str | None:
    """Where hip/hip_bf16.h and friends are. hiprtc compiles with -nogpuinc (only its builtin
    header is visible), so the headers the prelude names must come through -I."""
    candidates = []
    for var in ("ROCM_PATH", "ROCM_HOME", "HIP_PATH"):
        root = os.environ.get(var)
        if root:
            candidates.append(os.path.join(root, "include"))
    try:  # ROCm from the rocm-sdk wheels (TheRock): headers in the rocm-sdk-devel tree
        from rocm_sdk._devel import get_devel_root

        candidates.append(os.path.join(str(get_devel_root()), "include"))
    except Exception:  # not installed, or a layout this code does not know
        pass
    candidates.append("/opt/rocm/include")
    for candidate in candidates:
        if os.path.exists(os.path.join(candidate, "hip", "hip_bf16.h")):
            return candidate
    return None


def _device_properties(device: int) -> hip.hipDeviceProp_t:
    try:
        result = hip.hipGetDeviceProperties(device)  # hip-python >= 10: (status, props)
    except TypeError:  # hip-python <= 7.x: fills a caller-allocated struct
        props = hip.hipDeviceProp_t()
        _check(hip.hipGetDeviceProperties(props, device), "hipGetDeviceProperties")
        return props
    return _check(result, "hipGetDeviceProperties")


class _StreamCache(dict):
    """Raw stream handle -> hip-python stream object, created on first use.

    Generated code reads it with ``_STREAMS.get(raw)`` and tests the result with ``is None``
    (hip-python's wrapper of the null stream is falsy, so a truth test would miss it).
    """

    def __missing__(self, raw_stream: int) -> object:
        stream = self[raw_stream] = hip.ihipStream_t.fromObj(raw_stream)
        return stream


class _HipNodeUpdater(NodeUpdater):
    __slots__ = ("params", "set_call", "set_args", "node_params")

    def __init__(self, set_call: object, raw_exec: int, node: GraphNode, layout: ParamLayout, initial: bytes):
        self.params = PackedParams(layout, initial)
        node_params = hip_abi.HipKernelNodeParams()
        node_params.func = node.function
        node_params.gridDim = hip_abi.Dim3(*node.grid)
        node_params.blockDim = hip_abi.Dim3(*node.block)
        node_params.sharedMemBytes = node.shared_bytes
        node_params.kernelParams = self.params.address
        node_params.extra = None
        self.node_params = node_params
        # ctypes hipGraphExecKernelNodeSetParams, returning (status,) like hip-python. The
        # runtime copies every parameter out of self.params on each call (clr's
        # GraphKernelNode::SetParams -> copyParams), so the buffer may be rewritten after it.
        self.set_call = set_call
        self.set_args = (ctypes.c_void_p(raw_exec), ctypes.c_void_p(node.handle), ctypes.byref(node_params))

    def apply(self) -> None:
        _check(self.set_call(*self.set_args), "hipGraphExecKernelNodeSetParams")

    def set_dimension(self, field: str, value: int) -> None:
        if field == "shared":
            self.node_params.sharedMemBytes = value
        else:
            kind, axis = field.split("_")
            setattr(self.node_params.gridDim if kind == "grid" else self.node_params.blockDim, axis, value)

    def dimensions(self) -> tuple[int, ...]:
        p = self.node_params
        return (p.gridDim.x, p.gridDim.y, p.gridDim.z, p.blockDim.x, p.blockDim.y, p.blockDim.z, p.sharedMemBytes)


class HipBackend(DriverBackend):
    name = "hip"
    limit_attributes = (
        "MaxBlockDimX",
        "MaxBlockDimY",
        "MaxBlockDimZ",
        "MaxThreadsPerBlock",
        "MaxGridDimX",
        "MaxGridDimY",
        "MaxGridDimZ",
        "MaxSharedMemoryPerBlock",
        "SharedMemPerBlockOptin",
    )

    def __init__(self) -> None:
        compiler = _Hiprtc(hiprtc, "hiprtc", "hiprtc", "--offload-arch", _header_include_dir())
        super().__init__(compiler, hip.hipModuleLaunchKernel, hip.hipGraphLaunch, None, _check, _StreamCache())
        self._runtime: ctypes.CDLL | None = None

    # --- runtime state -------------------------------------------------------------------
    def _start_driver(self) -> None:
        try:
            _check(hip.hipInit(0), "hipInit")
        except DriverError:
            raise
        except Exception as exc:  # libamdhip64 itself is missing
            raise _library_missing(exc, "the HIP runtime (libamdhip64)") from exc
        runtimes = _loaded_runtimes()
        if len(runtimes) > 1:
            raise BackendUnavailableError(
                f"two HIP runtimes are loaded in this process ({', '.join(runtimes)}), most likely "
                "torch's and the one hip-python opened; handles from one are invalid in the other. "
                "Make hip-python load torch's libamdhip64 (ROCM_PATH / LD_LIBRARY_PATH)."
            )

    def _device_attributes(self, device: int) -> Callable[[str], int]:
        return functools.partial(_device_attribute, device)

    def _graph_api(self) -> ctypes.CDLL:
        """libamdhip64 through ctypes: the copy already loaded (torch's and hip-python's)."""
        runtime = self._runtime
        if runtime is None:
            self._ensure_init()
            loaded = _loaded_runtimes()
            path = loaded[0] if loaded else hip_abi.HIP_LIBRARY
            try:
                runtime = self._runtime = hip_abi.declare_graph_api(ctypes.CDLL(path))
            except (OSError, AttributeError) as exc:
                raise _library_missing(exc, f"the HIP graph API from {path}") from exc
        return runtime

    @contextlib.contextmanager
    def _on_device(self, device: int) -> Iterator[None]:
        """Make ``device`` current for the block (HIP's stand-in for pushing a CUDA context)."""
        self._ensure_init()
        previous = _check(hip.hipGetDevice(), "hipGetDevice")
        if previous != device:
            _check(hip.hipSetDevice(device), "hipSetDevice")
        try:
            yield
        finally:
            if previous != device:
                _check(hip.hipSetDevice(previous), "hipSetDevice")

    def _load_function(self, image: bytes, lowered: str) -> tuple[object, object]:
        module = _check(hip.hipModuleLoadData(image), "hipModuleLoadData")
        function = _check(hip.hipModuleGetFunction(module, lowered.encode()), "hipModuleGetFunction")
        # clr's FatBinaryInfo keeps a pointer to the image (no copy) and may read it again
        # later, for another device: the image lives as long as the module.
        return function, (module, image)

    def _function_attribute(self, function: object, name: str) -> int:
        # MAX_DYNAMIC_SHARED_SIZE_BYTES is all the LDS the kernel does not use statically: AMD
        # GPUs have no opt-in limit
        return _function_attribute(function, name)

    def stream_object(self, raw_stream: int) -> object:
        return self._streams[raw_stream]

    # --- compilation ---------------------------------------------------------------------
    def device_arch(self, device: int) -> str:
        self._ensure_init()
        return hip_abi.parse_arch(_device_properties(device).gcnArchName)

    def type_name(self, dtype: DType) -> str:
        return hip_abi.type_name(dtype.name)

    def prelude(self, source: str, type_names: Sequence[str]) -> str:
        return hip_abi.prelude(source, type_names)

    # --- modules and launches ------------------------------------------------------------
    def set_dynamic_shared_limit(self, function: LoadedFunction, nbytes: int) -> None:
        # Nothing to opt into on AMD GPUs, and hipFuncSetAttribute does not accept a module
        # function: check the request against what the kernel can use and record it.
        with self._on_device(function.device):
            available = _function_attribute(function.handle, "MAX_DYNAMIC_SHARED_SIZE_BYTES")
        if int(nbytes) > available:
            code = hip.hipError_t.hipErrorInvalidValue
            raise DriverError(
                "hipFuncSetAttribute(hipFuncAttributeMaxDynamicSharedMemorySize)",
                int(code),
                code.name,
                f"{function.name} asks for {int(nbytes)} bytes of dynamic shared memory; it can use {available}",
            )
        function.dynamic_shared_limit = int(nbytes)

    def synchronize(self, device: int) -> None:
        with self._on_device(device):
            _check(hip.hipDeviceSynchronize(), "hipDeviceSynchronize")

    # --- graphs --------------------------------------------------------------------------
    def _kernel_node_params(self, node_handle: int) -> hip_abi.HipKernelNodeParams:
        params = hip_abi.HipKernelNodeParams()
        _check(
            self._graph_api().hipGraphKernelNodeGetParams(node_handle, ctypes.byref(params)),
            "hipGraphKernelNodeGetParams",
        )
        return params

    def graph_nodes(self, raw_graph: int) -> list[GraphNode]:
        # ROCm's clr answers in topological order (a breadth-first walk from the root nodes in
        # insertion order): capture order for a graph captured on one stream.
        api = self._graph_api()
        graph = ctypes.c_void_p(raw_graph)
        count = ctypes.c_size_t(0)
        _check(api.hipGraphGetNodes(graph, None, ctypes.byref(count)), "hipGraphGetNodes")
        if not count.value:
            return []
        handles = (ctypes.c_void_p * count.value)()
        _check(api.hipGraphGetNodes(graph, handles, ctypes.byref(count)), "hipGraphGetNodes")
        nodes = []
        for index, handle in enumerate(handles[: count.value]):
            handle = handle or 0
            kind = ctypes.c_int(-1)
            _check(api.hipGraphNodeGetType(handle, ctypes.byref(kind)), "hipGraphNodeGetType")
            if kind.value == hip_abi.GRAPH_NODE_KERNEL:
                p = self._kernel_node_params(handle)
                nodes.append(
                    GraphNode(
                        index=index,
                        handle=handle,
                        kind="kernel",
                        function=p.func or 0,
                        grid=(p.gridDim.x, p.gridDim.y, p.gridDim.z),
                        block=(p.blockDim.x, p.blockDim.y, p.blockDim.z),
                        shared_bytes=p.sharedMemBytes,
                        params_address=p.kernelParams or 0,
                    )
                )
            elif kind.value == hip_abi.GRAPH_NODE_MEMCPY:
                # Not read: a captured hipMemcpyAsync becomes clr's GraphMemcpyNode1D, whose
                # hipGraphMemcpyNodeGetParams returns a hipMemcpy3DParms that was never filled
                # in. The addresses it touches are unknown here.
                nodes.append(GraphNode(index=index, handle=handle, kind="memcpy"))
            elif kind.value == hip_abi.GRAPH_NODE_MEMSET:
                p = hip_abi.HipMemsetParams()
                _check(api.hipGraphMemsetNodeGetParams(handle, ctypes.byref(p)), "hipGraphMemsetNodeGetParams")
                nodes.append(GraphNode(index=index, handle=handle, kind="memset", pointers=(p.dst or 0,)))
            else:
                nodes.append(GraphNode(index=index, handle=handle, kind="other"))
        return nodes

    @contextlib.contextmanager
    def capture_into(self, raw_graph: int, raw_stream: int):
        # hipStreamBeginCaptureToGraph (ROCm 6.2+), through ctypes like the other graph calls.
        # Never run on AMD hardware (docs/hip.md).
        runtime = self._graph_api()
        begin = getattr(runtime, "hipStreamBeginCaptureToGraph", None)
        end = getattr(runtime, "hipStreamEndCapture", None)
        if begin is None or end is None:
            raise NotImplementedError("this HIP runtime has no hipStreamBeginCaptureToGraph")
        begin.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
        ]
        begin.restype = ctypes.c_int
        end.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        end.restype = ctypes.c_int
        graph = ctypes.c_void_p(raw_graph)
        count = ctypes.c_size_t(0)
        _check(runtime.hipGraphGetNodes(graph, None, ctypes.byref(count)), "hipGraphGetNodes")
        nodes = (ctypes.c_void_p * max(count.value, 1))()
        if count.value:
            _check(runtime.hipGraphGetNodes(graph, nodes, ctypes.byref(count)), "hipGraphGetNodes")
        thread_local = 1  # hipStreamCaptureModeThreadLocal
        status = begin(raw_stream, raw_graph, ctypes.cast(nodes, ctypes.c_void_p), None, count.value, thread_local)
        _check((status,), "hipStreamBeginCaptureToGraph")
        try:
            yield
        finally:
            captured = ctypes.c_void_p(0)
            _check((end(raw_stream, ctypes.byref(captured)),), "hipStreamEndCapture")

    def kernel_param_sizes(self, function: int) -> list[int] | None:
        # HIP has no hipFuncGetParamInfo (CUDA's cuFuncGetParamInfo): the caller must know them.
        return None

    def read_kernel_params(self, node: GraphNode, sizes: Sequence[int]) -> list[bytes]:
        if node.params_address:
            # the node's own void* array, one separately allocated copy per parameter
            pointers = (ctypes.c_void_p * len(sizes)).from_address(node.params_address)
            return [ctypes.string_at(pointers[i], size) if pointers[i] else b"" for i, size in enumerate(sizes)]
        # launched with `extra` (one packed kernel-argument buffer) instead of kernelParams
        located = None
        if node.handle:
            located = hip_abi.extra_kernarg_buffer(self._kernel_node_params(node.handle).extra or 0)
        if located is None:
            return [b""] * len(sizes)
        buffer, buffer_size = located
        values = []
        for offset, size in zip(hip_abi.kernarg_offsets(sizes), sizes):
            values.append(ctypes.string_at(buffer + offset, size) if offset + size <= buffer_size else b"")
        return values

    def node_updater(self, raw_exec, node, layout, initial) -> NodeUpdater:
        return _HipNodeUpdater(self._graph_api().hipGraphExecKernelNodeSetParams, raw_exec, node, layout, initial)

    def graph_exec_object(self, raw_exec: int) -> object:
        return hip.hipGraphExec.fromObj(raw_exec)


def _loaded_runtimes() -> list[str]:
    try:
        with open("/proc/self/maps") as maps:
            return hip_abi.loaded_hip_runtimes(maps.read())
    except OSError:  # not Linux
        return []
