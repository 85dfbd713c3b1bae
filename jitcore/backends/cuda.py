"""NVIDIA backend: the CUDA driver API and NVRTC through ``cuda-bindings``.

The only module (with :mod:`jitcore.backends.hip`) that imports a vendor binding.
Compilation needs no GPU (NVRTC runs on the CPU); everything else needs the driver.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections.abc import Callable, Mapping, Sequence

from jitcore.backends import native_module
from jitcore.backends.abi import CUDA_TYPE_NAMES, PackedParams, ParamLayout, prelude
from jitcore.backends.base import GraphNode, LoadedFunction, NodeUpdater
from jitcore.backends.vendor import DriverBackend, RuntimeCompiler, StatusCheck
from jitcore.dtypes import DType
from jitcore.errors import BackendUnavailableError, DriverError

try:
    from cuda.bindings import driver, nvrtc
except ImportError as exc:  # pragma: no cover - exercised by the backend-selection tests
    raise BackendUnavailableError(
        f"the CUDA backend needs cuda-bindings and NVRTC: pip install 'jitreplay[cuda]' ({exc})"
    ) from exc


def _error_string(status: object) -> str:
    err, text = driver.cuGetErrorString(driver.CUresult(int(status)))
    if int(err) or not text:
        return ""
    return text.decode() if isinstance(text, bytes) else str(text)


#: Unpacks a driver call's result tuple, raising DriverError on a non-success status.
_check = StatusCheck(driver.CUresult, _error_string)
#: CU_STREAM_CAPTURE_STATUS_ACTIVE as the int the C helper's capture query returns.
_CAPTURE_ACTIVE = int(driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE)
#: Node types as the ints the C helper's node-type query returns.
_NODE_KERNEL = int(driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL)
_NODE_MEMCPY = int(driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMCPY)
_NODE_MEMSET = int(driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_MEMSET)


#: What each native call binds to in libcuda: (prototype kind, symbol, per-thread-stream symbol).
#: The node setter is the v2 entry point, whose node-params struct is the one cuda-bindings'
#: CUDA_KERNEL_NODE_PARAMS wraps (it has the kern and ctx fields).
_NATIVE_SYMBOLS = {
    "launch": ("kernel_launch", "cuLaunchKernel", "cuLaunchKernel_ptsz"),
    "graph_launch": ("graph_launch", "cuGraphLaunch", "cuGraphLaunch_ptsz"),
    "node_set": ("kernel_node_set", "cuGraphExecKernelNodeSetParams_v2", "cuGraphExecKernelNodeSetParams_v2"),
}
#: Calls bound where the driver has them, each group whole or not at all (else those calls
#: stay on the binding): {role: (kind, symbol, per-thread-stream symbol)} per group.
#: - the capture query replay makes after each launch of a recording (capture_tail); the _v2
#:   entry point, whose prototype (no edge data) is the one the C helper declares, whatever
#:   the toolkit's unversioned name means today;
#: - the node reads of a recording's analysis (graph_nodes); the parameters' getter is the _v2
#:   entry point, whose struct the C helper reads the head of;
#: - the copy nodes a recording adds for its outputs' own memory (append_copies), whose
#:   CUDA_MEMCPY3D the binding makes.
_NATIVE_OPTIONAL = (
    {"capture_info": ("capture_info", "cuStreamGetCaptureInfo_v2", "cuStreamGetCaptureInfo_v2_ptsz")},
    {
        "graph_get_nodes": ("graph_get_nodes", "cuGraphGetNodes", "cuGraphGetNodes"),
        "node_get_type": ("node_get_type", "cuGraphNodeGetType", "cuGraphNodeGetType"),
        "kernel_node_get_params": (
            "kernel_node_get_params",
            "cuGraphKernelNodeGetParams_v2",
            "cuGraphKernelNodeGetParams_v2",
        ),
    },
    {"graph_add_memcpy": ("graph_add_memcpy", "cuGraphAddMemcpyNode", "cuGraphAddMemcpyNode")},
)
#: The roles of the node reads, in the order _native.NodeReads takes their addresses.
_NATIVE_NODE_READS = tuple(_NATIVE_OPTIONAL[1])
#: GraphNode.kind of each node type the C helper's node reads answer (any other: "other").
_NODE_KINDS = {_NODE_KERNEL: "kernel", _NODE_MEMCPY: "memcpy", _NODE_MEMSET: "memset"}


def native_calls() -> dict[str, Callable[..., tuple]] | None:
    """The hot driver calls made from C (:mod:`jitcore.backends._native`), or None where that
    helper was not built, libcuda cannot be loaded (a machine without a driver) or
    ``JITCORE_NATIVE=0`` turns it off. Each takes the arguments of the cuda-bindings call it
    replaces and returns the same ``(status,)`` tuple, so generated code is the same on both
    paths; the default stream is the one cuda-bindings uses (legacy, or per-thread where
    ``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM`` asks for it)."""
    _native = native_module()
    if _native is None:
        return None
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    per_thread = os.environ.get("CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM", "0").strip() not in ("", "0")
    calls = {}
    for role, (kind, legacy, ptsz) in _NATIVE_SYMBOLS.items():
        symbol = ptsz if per_thread else legacy
        try:
            address = ctypes.cast(getattr(libcuda, symbol), ctypes.c_void_p).value
        except AttributeError:  # a driver without the symbol: every call stays on the binding
            return None
        calls[role] = _native.bind(kind, _display_name(symbol), address)
        if role == "launch":
            calls["packed_launch"] = functools.partial(_native.PackedLaunch, address)
    calls["read_params"] = _native.read_params  # (no driver call: it reads host memory)
    addresses = {}
    for group in _NATIVE_OPTIONAL:
        symbols = {role: ptsz if per_thread else legacy for role, (_, legacy, ptsz) in group.items()}
        functions = {role: getattr(libcuda, symbol, None) for role, symbol in symbols.items()}
        if all(function is not None for function in functions.values()):
            for role, (kind, _, _) in group.items():
                addresses[role] = ctypes.cast(functions[role], ctypes.c_void_p).value
                calls[role] = _native.bind(kind, _display_name(symbols[role]), addresses[role])
    if "capture_info" in addresses:
        calls["capture_tail"] = _native.CaptureTail(addresses["capture_info"], _CAPTURE_ACTIVE)
    if "graph_get_nodes" in addresses:
        calls["node_reads"] = _native.NodeReads(*(addresses[role] for role in _NATIVE_NODE_READS), _NODE_KERNEL)
    return calls


def _display_name(symbol: str) -> str:
    """A driver symbol without its version and per-thread-stream suffixes (the bound call's name)."""
    return symbol.removesuffix("_ptsz").removesuffix("_v2")


def _other_node(index: int, handle: int, kind: int) -> GraphNode:
    """A graph node that is not a kernel (``kind``: its type as an int, which a driver newer
    than the binding may answer with a value the binding's enum lacks: "other"): a copy's or
    a memset's device addresses, through the binding on both paths of ``graph_nodes``
    (replay reads few of them)."""
    if kind == _NODE_MEMCPY:
        p = _check(driver.cuGraphMemcpyNodeGetParams(driver.CUgraphNode(handle)), "cuGraphMemcpyNodeGetParams")
        return GraphNode(index, handle, "memcpy", pointers=(int(p.srcDevice), int(p.dstDevice)))
    if kind == _NODE_MEMSET:
        p = _check(driver.cuGraphMemsetNodeGetParams(driver.CUgraphNode(handle)), "cuGraphMemsetNodeGetParams")
        return GraphNode(index, handle, "memset", pointers=(int(p.dst),))
    return GraphNode(index, handle, "other")


def _flat_copy(destination: int, source: int, nbytes: int) -> driver.CUDA_MEMCPY3D:
    """The copy parameters of ``nbytes`` from one device address to another (what a captured
    device-to-device cudaMemcpyAsync holds)."""
    params = driver.CUDA_MEMCPY3D()
    params.srcMemoryType = params.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    params.srcDevice, params.dstDevice = source, destination
    params.WidthInBytes, params.Height, params.Depth = nbytes, 1, 1
    return params


def _remember_stream(cache: dict[int, int], raw_stream: int) -> int:
    cache[raw_stream] = raw_stream
    return raw_stream


class _Nvrtc(RuntimeCompiler):
    def code_kind(self, arch: str) -> str:
        return "CUBIN" if arch.startswith("sm_") else "PTX"  # compute_XX: PTX for the driver to JIT


def _device_attribute(device: object, name: str) -> int:
    attribute = getattr(driver.CUdevice_attribute, f"CU_DEVICE_ATTRIBUTE_{name}")
    return int(_check(driver.cuDeviceGetAttribute(attribute, device), f"cuDeviceGetAttribute({name})"))


def _function_attribute(function: object, name: str) -> int:
    attribute = getattr(driver.CUfunction_attribute, f"CU_FUNC_ATTRIBUTE_{name}")
    return int(_check(driver.cuFuncGetAttribute(attribute, function), f"cuFuncGetAttribute({name})"))


def _header_include_dir() -> str | None:
    """Where cuda_fp16.h and friends are (the nvidia-cuda-runtime wheel or CUDA_HOME)."""
    try:
        from cuda import pathfinder

        located = pathfinder.find_nvidia_header_directory("cudart")
        if located:
            return str(located)
    except Exception:  # pathfinder missing or too old: fall back to the environment
        pass
    import os

    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root and os.path.exists(os.path.join(root, "include", "cuda_fp16.h")):
            return os.path.join(root, "include")
    if os.path.exists("/usr/local/cuda/include/cuda_fp16.h"):
        return "/usr/local/cuda/include"
    return None


# The headers of the reduced-precision types, each where its marker is in a kernel or its
# template arguments ("half" also matches __half).
_HEADERS = (
    ("half", "#include <cuda_fp16.h>"),
    ("bfloat16", "#include <cuda_bf16.h>"),
    ("__nv_fp8", "#include <cuda_fp8.h>"),
    ("__nv_fp4", "#include <cuda_fp4.h>"),
)

_DIMENSION_FIELDS = {
    "grid_x": "gridDimX",
    "grid_y": "gridDimY",
    "grid_z": "gridDimZ",
    "block_x": "blockDimX",
    "block_y": "blockDimY",
    "block_z": "blockDimZ",
    "shared": "sharedMemBytes",
}


class _CudaNodeUpdater(NodeUpdater):
    __slots__ = ("params", "set_call", "set_args", "node_params", "enable_call", "enable_args")

    def __init__(
        self, graph_exec: object, node: GraphNode, layout: ParamLayout, initial: bytes, native_set: Callable | None
    ):
        self.params = PackedParams(layout, initial)
        handle = driver.CUgraphNode(int(node.handle))  # (nodes come with raw handles)
        node_params = driver.CUDA_KERNEL_NODE_PARAMS()
        node_params.func = driver.CUfunction(node.function)
        node_params.gridDimX, node_params.gridDimY, node_params.gridDimZ = node.grid
        node_params.blockDimX, node_params.blockDimY, node_params.blockDimZ = node.block
        node_params.sharedMemBytes = node.shared_bytes
        node_params.kernelParams = self.params.address
        node_params.extra = 0
        self.node_params = node_params
        if native_set is None:
            self.set_call = driver.cuGraphExecKernelNodeSetParams
            self.set_args = (graph_exec, handle, node_params)
        else:  # the same call from C, on raw handles and the struct's address (node_params owns it)
            self.set_call = native_set
            self.set_args = (int(graph_exec), int(node.handle), node_params.getPtr())
        self.enable_call = driver.cuGraphNodeSetEnabled
        self.enable_args = (graph_exec, handle)

    def apply(self) -> None:
        _check(self.set_call(*self.set_args), "cuGraphExecKernelNodeSetParams")

    def set_dimension(self, field: str, value: int) -> None:
        setattr(self.node_params, _DIMENSION_FIELDS[field], value)

    def dimensions(self) -> tuple[int, ...]:
        return tuple(getattr(self.node_params, _DIMENSION_FIELDS[f]) for f in self.DIMENSIONS)


class CudaBackend(DriverBackend):
    name = "cuda"
    limit_attributes = (
        "MAX_BLOCK_DIM_X",
        "MAX_BLOCK_DIM_Y",
        "MAX_BLOCK_DIM_Z",
        "MAX_THREADS_PER_BLOCK",
        "MAX_GRID_DIM_X",
        "MAX_GRID_DIM_Y",
        "MAX_GRID_DIM_Z",
        "MAX_SHARED_MEMORY_PER_BLOCK",
        "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN",
    )

    def __init__(self) -> None:
        compiler = _Nvrtc(nvrtc, "nvrtc", "NVRTC", "--gpu-architecture", _header_include_dir())
        native = native_calls()
        #: Whether launches, graph launches and node updates go through the C helper.
        self.native = native is not None
        launch = native["launch"] if native else driver.cuLaunchKernel
        graph_launch = native["graph_launch"] if native else driver.cuGraphLaunch
        super().__init__(compiler, launch, graph_launch, 0, _check, {}, launch_detail=False)
        self._native_node_set = native["node_set"] if native else None
        self._packed_launch = native["packed_launch"] if native else None
        #: the C helper's CaptureTail (capture_tail's answer made in C), where bound
        self._native_capture_info = native.get("capture_tail") if native else None
        #: the C helper's NodeReads (every node of a graph in one call), where bound
        self._native_node_reads = native.get("node_reads") if native else None
        self._native_get_nodes = native.get("graph_get_nodes") if native else None
        self._native_add_memcpy = native.get("graph_add_memcpy") if native else None
        self._native_read_params = native["read_params"] if native else None
        self.raw_stream_handles = self.native
        if native:
            # the C calls take raw handles: the stream cache (for code built from the templates
            # elsewhere, like the benchmarks) maps a handle to itself
            raw_streams: dict[int, int] = {}
            self.hot_namespace["_STREAMS"] = raw_streams
            self.hot_namespace["_stream_object"] = functools.partial(_remember_stream, raw_streams)
        #: cuda-bindings' own cuLaunchKernel: the floor the benchmarks measure against.
        self.binding_launch = driver.cuLaunchKernel
        self._contexts: dict[int, object] = {}

    # --- driver state --------------------------------------------------------------------
    def _start_driver(self) -> None:
        try:
            _check(driver.cuInit(0), "cuInit")
        except DriverError:
            raise
        except Exception as exc:  # the driver library itself is missing
            raise BackendUnavailableError(
                f"the NVIDIA driver could not be loaded ({exc}); a GPU is needed to launch kernels"
            ) from exc

    def _device_attributes(self, device: int) -> Callable[[str], int]:
        return functools.partial(_device_attribute, _check(driver.cuDeviceGet(device), "cuDeviceGet"))

    def _context(self, device: int) -> object:
        """The device's primary context (the one torch uses), retained once."""
        context = self._contexts.get(device)
        if context is None:
            self._ensure_init()
            handle = _check(driver.cuDeviceGet(device), "cuDeviceGet")
            context = _check(driver.cuDevicePrimaryCtxRetain(handle), "cuDevicePrimaryCtxRetain")
            self._contexts[device] = context
        return context

    def _on_device(self, device: int) -> contextlib.AbstractContextManager:
        backend = self

        class _Scope:
            def __enter__(self_inner):
                _check(driver.cuCtxPushCurrent(backend._context(device)), "cuCtxPushCurrent")

            def __exit__(self_inner, *exc):
                _check(driver.cuCtxPopCurrent(), "cuCtxPopCurrent")

        return _Scope()

    def _load_function(self, image: bytes, lowered: str) -> tuple[object, object]:
        module = _check(driver.cuModuleLoadData(image), "cuModuleLoadData")
        return _check(driver.cuModuleGetFunction(module, lowered.encode()), "cuModuleGetFunction"), module

    def _function_attribute(self, function: object, name: str) -> int:
        return _function_attribute(function, name)

    def packed_launcher(
        self,
        function: object,
        template: bytes,
        offsets: tuple[int, ...],
        runs: tuple[tuple[int, str], ...],
        failed: Callable[[int], object] | None = None,
    ) -> Callable[..., tuple] | None:
        """The C helper's PackedLaunch over cuLaunchKernel (csrc/jitcore_native.c), where
        the helper is in use."""
        if self._packed_launch is None:
            return None
        return self._packed_launch(function, template, offsets, runs, failed)

    def stream_object(self, raw_stream: int) -> object:
        stream = self._streams.get(raw_stream)
        if stream is None:
            stream = self._streams[raw_stream] = driver.CUstream(raw_stream)
        return stream

    # --- compilation ---------------------------------------------------------------------
    def device_arch(self, device: int) -> str:
        self._ensure_init()
        handle = _check(driver.cuDeviceGet(device), "cuDeviceGet")
        major = _device_attribute(handle, "COMPUTE_CAPABILITY_MAJOR")
        minor = _device_attribute(handle, "COMPUTE_CAPABILITY_MINOR")
        return f"sm_{major}{minor}"

    def type_name(self, dtype: DType) -> str:
        try:
            return CUDA_TYPE_NAMES[dtype.name]
        except KeyError:
            raise TypeError(f"dtype {dtype.name} has no CUDA C type for a template argument") from None

    def prelude(self, source: str, type_names: Sequence[str]) -> str:
        return prelude(source, type_names, _HEADERS)

    # --- modules and launches ------------------------------------------------------------
    def set_dynamic_shared_limit(self, function: LoadedFunction, nbytes: int) -> None:
        with self._on_device(function.device):
            _check(
                driver.cuFuncSetAttribute(
                    function.handle,
                    driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    int(nbytes),
                ),
                "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)",
            )
        function.dynamic_shared_limit = int(nbytes)

    def synchronize(self, device: int) -> None:
        with self._on_device(device):
            _check(driver.cuCtxSynchronize(), "cuCtxSynchronize")

    # --- graphs --------------------------------------------------------------------------
    def graph_nodes(self, raw_graph: int) -> list[GraphNode]:
        if self._native_node_reads is not None:
            return self._graph_nodes_from_c(raw_graph, None)
        graph = driver.CUgraph(raw_graph)
        _, count = _check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        if not count:
            return []
        handles, count = _check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")
        nodes = []
        for index, handle in enumerate(handles[:count]):
            kind = _check(driver.cuGraphNodeGetType(handle), "cuGraphNodeGetType")
            if kind == driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL:
                p = _check(driver.cuGraphKernelNodeGetParams(handle), "cuGraphKernelNodeGetParams")
                nodes.append(
                    GraphNode(
                        index=index,
                        handle=int(handle),
                        kind="kernel",
                        function=int(p.func),
                        grid=(p.gridDimX, p.gridDimY, p.gridDimZ),
                        block=(p.blockDimX, p.blockDimY, p.blockDimZ),
                        shared_bytes=p.sharedMemBytes,
                        params_address=int(p.kernelParams),
                    )
                )
            else:
                nodes.append(_other_node(index, int(handle), int(kind)))
        return nodes

    def graph_nodes_with_params(self, raw_graph: int, sizes: Mapping[int, tuple[int, ...]]) -> list[GraphNode]:
        if self._native_node_reads is not None:
            return self._graph_nodes_from_c(raw_graph, sizes if isinstance(sizes, dict) else dict(sizes))
        return self.graph_nodes(raw_graph)

    #: Which read a failed NodeReads call names (its second item).
    _NODE_READ_NAMES = ("cuGraphGetNodes", "cuGraphNodeGetType", "cuGraphKernelNodeGetParams")

    def _graph_nodes_from_c(self, raw_graph: int, sizes: dict | None) -> list[GraphNode]:
        """:meth:`graph_nodes` through the C helper's NodeReads: every node's fields in one
        call, with the parameters of kernel nodes whose function ``sizes`` names. Handles are
        raw ints on both paths (the binding's node objects are made for the nodes a graph
        patches only: node_updater, memcpy_retargeter)."""
        status, which, rows = self._native_node_reads(raw_graph, sizes)
        _check((status,), self._NODE_READ_NAMES[which])
        new, kinds = tuple.__new__, _NODE_KINDS
        nodes = []
        for index, (handle, kind, function, gx, gy, gz, bx, by, bz, shared, address, params) in enumerate(rows):
            if kind == _NODE_KERNEL:
                fields = (index, handle, "kernel", function, (gx, gy, gz), (bx, by, bz), shared, address, (), params)
                nodes.append(new(GraphNode, fields))
            elif kind in kinds:
                nodes.append(_other_node(index, handle, kind))
            else:
                nodes.append(new(GraphNode, (index, handle, "other", 0, (0, 0, 0), (0, 0, 0), 0, 0, (), None)))
        return nodes

    def kernel_param_sizes(self, function: int) -> list[int] | None:
        sizes = []
        handle = driver.CUfunction(function)
        for index in range(4096):
            result = driver.cuFuncGetParamInfo(handle, index)
            if int(result[0]):
                break
            sizes.append(int(result[2]))
        return sizes if sizes else None

    def read_kernel_params(self, node: GraphNode, sizes: Sequence[int]) -> list[bytes]:
        if self._native_read_params is not None:
            return list(self._native_read_params(node.params_address, sizes))
        if not node.params_address:
            return [b""] * len(sizes)
        pointers = (ctypes.c_void_p * len(sizes)).from_address(node.params_address)
        return [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]

    def node_updater(self, raw_exec, node, layout, initial) -> NodeUpdater:
        return _CudaNodeUpdater(driver.CUgraphExec(raw_exec), node, layout, initial, self._native_node_set)

    def append_copies(self, raw_graph: int, copies: Sequence[tuple[int, int, int]], device: int) -> None:
        """Each copy a memcpy node depending on every node the graph held before (as a
        capture into it would make it), added through the C helper where it was built."""
        if not copies:
            return
        context = self._context(device)
        params = [_flat_copy(*copy) for copy in copies]  # kept alive until the nodes are added
        if self._native_add_memcpy is not None and self._native_get_nodes is not None:
            dependencies = _check(self._native_get_nodes(raw_graph), "cuGraphGetNodes")
            for p in params:
                added = self._native_add_memcpy(raw_graph, dependencies, p.getPtr(), int(context))
                _check(added, "cuGraphAddMemcpyNode")
            return
        graph = driver.CUgraph(raw_graph)
        _, count = _check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        nodes = list(_check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")[0][:count]) if count else []
        for p in params:
            _check(driver.cuGraphAddMemcpyNode(graph, nodes or None, len(nodes), p, context), "cuGraphAddMemcpyNode")

    @contextlib.contextmanager
    def capture_into(self, raw_graph: int, raw_stream: int):
        graph = driver.CUgraph(raw_graph)
        _, count = _check(driver.cuGraphGetNodes(graph, 0), "cuGraphGetNodes")
        nodes = list(_check(driver.cuGraphGetNodes(graph, count), "cuGraphGetNodes")[0][:count]) if count else []
        stream = self.stream_object(raw_stream)
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        _check(
            driver.cuStreamBeginCaptureToGraph(stream, graph, nodes or None, None, len(nodes), mode),
            "cuStreamBeginCaptureToGraph",
        )
        try:
            yield
        finally:
            _check(driver.cuStreamEndCapture(stream), "cuStreamEndCapture")

    def memcpy_retargeter(self, raw_exec: int, node: GraphNode, device: int) -> Callable[[int], None] | None:
        handle = driver.CUgraphNode(int(node.handle))  # (nodes come with raw handles)
        params = _check(driver.cuGraphMemcpyNodeGetParams(handle), "cuGraphMemcpyNodeGetParams")
        kinds = (driver.CUmemorytype.CU_MEMORYTYPE_DEVICE, driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED)
        try:
            if params.dstMemoryType not in kinds or params.Depth > 1 or params.Height > 1:
                return None  # not a flat copy into device memory (the only kind replay retargets)
        except ValueError:  # a memory type these bindings do not know
            return None
        graph_exec, context = driver.CUgraphExec(raw_exec), self._context(device)
        setter = driver.cuGraphExecMemcpyNodeSetParams

        def set_destination(address: int) -> None:
            params.dstDevice = address
            _check(setter(graph_exec, handle, params, context), "cuGraphExecMemcpyNodeSetParams")

        return set_destination

    def capture_tail(self, raw_stream: int) -> tuple[int, ...] | None:
        if self._native_capture_info is not None:
            return self._native_capture_info(raw_stream)
        result = driver.cuStreamGetCaptureInfo(self.stream_object(raw_stream))
        if int(result[0]) or result[1] != driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE:
            return None
        # (status, capture status, id, graph, dependencies, [edge data,] count)
        dependencies, count = result[4], int(result[-1])
        return tuple(int(node) for node in list(dependencies)[:count])

    def capture_tail_function(self) -> Callable[[int], tuple[int, ...] | None]:
        return self._native_capture_info if self._native_capture_info is not None else self.capture_tail

    def launch_function(self, function: LoadedFunction) -> object:
        return function.address if self.native else function.handle

    def graph_exec_object(self, raw_exec: int) -> object:
        return int(raw_exec) if self.native else driver.CUgraphExec(raw_exec)
