"""The driver interface: what jitcore and replay need from a GPU vendor, and nothing more.

One implementation per vendor (:mod:`jitcore.backends.cuda`, :mod:`jitcore.backends.hip`);
they are the only modules that import a vendor binding. Everything else talks to a
:class:`Backend`. Hot paths (call states, graph replays) do not call methods on it: they are
generated Python that calls the vendor function directly, through the source templates and
namespaces a backend publishes (``launch_template``, ``hot_namespace``), so a launch costs what
the binding costs.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import attrs

from jitcore.backends.abi import PackedParams, ParamLayout
from jitcore.dtypes import DType


@attrs.frozen
class DeviceLimits:
    max_block: tuple[int, int, int]
    max_threads_per_block: int
    max_grid: tuple[int, int, int]
    max_shared_per_block: int  # without opting in
    max_shared_per_block_optin: int


@attrs.frozen
class CompiledBinary:
    """A compiled module image and the lowered (mangled) name of each name expression."""

    image: bytes
    lowered_names: dict[str, str]
    log: str
    arch: str
    compiler: str


@attrs.define
class LoadedFunction:
    """A kernel loaded on one device."""

    handle: object  # vendor function object, passed straight to the vendor launch call
    address: int  # the raw handle value, as graph nodes report it
    device: int
    name: str
    max_threads_per_block: int
    static_shared_bytes: int
    dynamic_shared_limit: int = 0  # the max-dynamic-shared-memory attribute as last set
    owner: object = None  # the vendor module object, kept alive with its function


class GraphNode(NamedTuple):
    """One node of a captured graph, as far as replay needs to know it (a named tuple: a graph
    has one per node, read on every key's second call)."""

    index: int
    handle: object  # the vendor's node handle: a raw int (the CUDA backend) or a binding object
    kind: str  # "kernel", "memcpy", "memset", "other"
    function: int = 0  # kernel nodes: the function's raw handle
    grid: tuple[int, int, int] = (0, 0, 0)
    block: tuple[int, int, int] = (0, 0, 0)
    shared_bytes: int = 0
    params_address: int = 0  # kernel nodes: the node's own void* array (owned by the node)
    pointers: tuple[int, ...] = ()  # memcpy/memset nodes: the device addresses they touch
    #: kernel nodes read by ``graph_nodes_with_params`` with sizes for their function: the bytes
    #: of each parameter (what ``read_kernel_params`` gives); None where not read with the node
    params: tuple[bytes, ...] | None = None


class NodeUpdater:
    """Rewrites one kernel node's parameters in an instantiated graph.

    ``params`` is a persistent buffer holding the node's current parameter values; a caller
    writes changed slots into ``params.buffer`` and then calls :meth:`apply` (or the
    generated-code equivalent ``set_call``/``set_args``).
    """

    params: PackedParams
    set_call: object  # the vendor function, for generated code
    set_args: tuple  # its arguments (exec, node, node-params struct)
    #: The vendor's enable/disable call for this node, ``enable_call(*enable_args, 0 or 1)``
    #: -> status tuple, or None where the backend cannot disable a node (a launch whose grid
    #: becomes 0 then runs eagerly instead).
    enable_call: object = None
    enable_args: tuple = ()

    #: The launch dimensions ``set_dimension`` accepts.
    DIMENSIONS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared")

    def apply(self) -> None:
        raise NotImplementedError

    def set_dimension(self, field: str, value: int) -> None:
        """Write one launch dimension (``DIMENSIONS``) into the node parameters the next
        ``set_call`` sends."""
        raise NotImplementedError

    def dimensions(self) -> tuple[int, ...]:
        """The node parameters' launch dimensions, in ``DIMENSIONS`` order."""
        raise NotImplementedError


class Backend(abc.ABC):
    """One vendor's driver, compiler and graph API behind the same small surface.

    Devices and streams are torch's (both vendors use ``torch.cuda``), so the defaults here
    read them through torch's cheapest entry points; ``hot_namespace`` must publish the same
    two callables as ``_current_device`` and ``_current_stream`` for generated code.
    """

    name: str
    device_type = "cuda"
    #: Python source of one checked launch, with fields {function} {gx} {gy} {gz} {bx} {by} {bz}
    #: {shared} {stream} {params} {label}; it runs with ``hot_namespace`` as globals. {stream}
    #: is a vendor stream object, which generated code gets from a raw handle with
    #: ``_STREAMS.get(raw)`` (a cache dict) falling back to ``_stream_object(raw)``.
    launch_template: str
    #: Python source of one graph launch with fields {exec} {stream} (both vendor objects).
    graph_launch_template: str
    #: Whether the launch templates take raw stream handles as {stream} (the C helper's
    #: calls do): generated code then skips the ``_STREAMS`` lookup.
    raw_stream_handles: bool = False
    #: Globals for generated code: the vendor calls, ``_STREAMS``, ``_stream_object``,
    #: ``_current_device`` and ``_current_stream``.
    hot_namespace: dict[str, object]
    #: The launch function generated code calls, (function, gx, gy, gz, bx, by, bz, shared,
    #: stream, params address, extra) -> status tuple: the binding's, or the C helper's
    #: (:mod:`jitcore.backends._native`) where the backend uses it.
    raw_launch: object

    # --- devices and streams (torch's) ------------------------------------------------------
    def current_device(self) -> int:
        import torch

        return torch.cuda.current_device()

    def device_name(self, device: int) -> str:
        return f"{self.device_type}:{device}"

    def current_stream(self, device: int) -> int:
        import torch

        return torch._C._cuda_getCurrentRawStream(device)

    def is_capturing(self) -> bool:
        import torch

        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @staticmethod
    def torch_hot_namespace() -> dict[str, object]:
        import torch

        def no_cuda(*_args):
            raise RuntimeError("this torch build has no CUDA/HIP support; a GPU build is needed to launch")

        return {
            "_current_device": getattr(torch._C, "_cuda_getDevice", no_cuda),
            "_current_stream": getattr(torch._C, "_cuda_getCurrentRawStream", no_cuda),
        }

    # --- compilation -------------------------------------------------------------------
    @abc.abstractmethod
    def compiler_version(self) -> str: ...

    @abc.abstractmethod
    def device_arch(self, device: int) -> str: ...

    @abc.abstractmethod
    def type_name(self, dtype: DType) -> str:
        """The C type a template argument of this dtype becomes."""

    @abc.abstractmethod
    def prelude(self, source: str, type_names: Sequence[str]) -> str:
        """Source prepended to a kernel: fixed-width integer typedefs and the vendor headers
        for the half, bfloat16 and fp8 types the kernel or its template arguments use."""

    @abc.abstractmethod
    def compile(
        self, source: str, name_expressions: Sequence[str], options: Sequence[str], arch: str
    ) -> CompiledBinary: ...

    # --- modules and launches ------------------------------------------------------------
    @abc.abstractmethod
    def load(self, binary: CompiledBinary, name_expression: str, device: int) -> LoadedFunction: ...

    @abc.abstractmethod
    def device_limits(self, device: int) -> DeviceLimits: ...

    @abc.abstractmethod
    def set_dynamic_shared_limit(self, function: LoadedFunction, nbytes: int) -> None: ...

    @abc.abstractmethod
    def launch(
        self,
        function: LoadedFunction,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        shared_bytes: int,
        stream: int,
        params: PackedParams,
    ) -> None:
        """A checked launch for slow paths and tests; call states use ``launch_template``."""

    @abc.abstractmethod
    def synchronize(self, device: int) -> None: ...

    # --- graphs --------------------------------------------------------------------------
    @abc.abstractmethod
    def graph_nodes(self, raw_graph: int) -> list[GraphNode]:
        """All nodes of a captured graph in the order the graph reports them (capture order
        for stream-captured graphs), with kernel launch parameters filled in."""

    def graph_nodes_with_params(self, raw_graph: int, sizes: Mapping[int, tuple[int, ...]]) -> list[GraphNode]:
        """:meth:`graph_nodes`, where the backend can, with each kernel node whose function
        ``sizes`` names read with its parameters of those sizes (``GraphNode.params``: what
        :meth:`read_kernel_params` gives); other nodes' ``params`` None (the caller reads them)."""
        return self.graph_nodes(raw_graph)

    @abc.abstractmethod
    def kernel_param_sizes(self, function: int) -> list[int] | None:
        """Sizes of a foreign kernel's parameters, or None where the driver cannot say."""

    @abc.abstractmethod
    def read_kernel_params(self, node: GraphNode, sizes: Sequence[int]) -> list[bytes]:
        """The bytes of each parameter of a kernel node (the caller knows the sizes)."""

    @abc.abstractmethod
    def node_updater(self, raw_exec: int, node: GraphNode, layout: ParamLayout, initial: bytes) -> NodeUpdater: ...

    @abc.abstractmethod
    def graph_launch(self, raw_exec: int, stream: int) -> None: ...

    def capture_into(self, raw_graph: int, raw_stream: int):
        """A context manager: work issued on ``raw_stream`` inside it is captured into the
        existing graph ``raw_graph``, after every node already there (the graph is not
        instantiated yet). Replay uses it to append copies of a graph's outputs into memory
        the graph owns. Raises NotImplementedError where the driver cannot."""
        raise NotImplementedError(f"the {self.name} backend cannot capture into an existing graph")

    def append_copies(self, raw_graph: int, copies: Sequence[tuple[int, int, int]], device: int) -> None:
        """Add to the graph ``raw_graph`` (not instantiated yet) one node per flat copy
        ``(destination, source, bytes)`` between device addresses of ``device``, each after
        every node already there: what :meth:`capture_into` captures of ``destination.copy_(source)``
        into the graph, without a capture. Raises NotImplementedError where the backend cannot
        (replay then captures the copies with :meth:`capture_into`)."""
        raise NotImplementedError(f"the {self.name} backend cannot add copy nodes to a graph")

    def memcpy_retargeter(self, raw_exec: int, node: GraphNode, device: int) -> Callable[[int], None] | None:
        """For a memcpy node of an instantiated graph on ``device``: a ``set_destination(address)`` that
        makes the node copy to another device address (same context, same size) from the
        graph's next launch on; None where the backend cannot (replay then keeps each graph's
        outputs in memory of its own). Raises DriverError when the driver refuses."""
        return None

    def capture_tail(self, raw_stream: int) -> tuple[int, ...] | None:
        """While ``raw_stream`` is capturing: the raw handles of the nodes its next node will
        depend on (right after a kernel launch, that launch's own node). This is how replay
        knows which graph node a launch became, instead of guessing from equal parameter
        bytes. None where the backend cannot say (replay then matches by bytes and refuses
        launches it cannot tell apart)."""
        return None

    def capture_tail_function(self) -> Callable[[int], tuple[int, ...] | None]:
        """What answers :meth:`capture_tail`: the method itself, or an object of the C helper
        (``jitcore.backends._native.CaptureTail``) that a packed launch's recording calls without
        Python (a recorder's ``launch_sink``)."""
        return self.capture_tail

    def packed_launcher(
        self,
        function: object,
        template: bytes,
        offsets: tuple[int, ...],
        runs: tuple[tuple[int, str], ...],
        failed: Callable[[int], object] | None = None,
    ) -> Callable[..., tuple] | None:
        """A launch of ``function`` (what ``launch_function`` gives) that packs its own
        parameters, or None where the backend has none (then call states pack with struct and
        launch through ``launch_template``). ``template`` holds the launch's parameters with
        the constants written, ``offsets`` each parameter's offset in it, ``runs`` the struct
        formats of the changing ones and where each starts (``P``: a ``Q`` taken from the
        value's ``data_ptr()``). Called as ``launcher(gx, gy, gz, bx, by, bz, shared, stream,
        *values)``, it returns the launch's ``(status,)``, after calling ``failed(status)``
        (which raises) for a launch the driver refused; it packs exactly as ``struct`` would
        (raising ``struct.error`` or ``OverflowError`` where ``struct`` does) and launches
        nothing when a grid dimension is 0. ``launcher.reporting(...)``, with the same
        arguments, is the same launch returning the parameter bytes it packed (the recording
        path of a call state reports them), a refused launch raising."""
        return None

    def launch_function(self, function: LoadedFunction) -> object:
        """What ``launch_template``'s {function} takes for a loaded function: its vendor
        handle, or its raw address where the backend calls the driver from C."""
        return function.handle

    def graph_launch_parts(self) -> tuple[Callable, Callable] | None:
        """What ``graph_launch_template`` calls, for replay's C step (csrc/replay_step.c), which
        runs the same launch without the template's text: ``(launch, failed)``, where
        ``launch(exec, stream)`` returns a status tuple and ``failed(status)`` raises for a
        nonzero status. None where the template is anything else (then replay runs its
        generated Python)."""
        return None

    @abc.abstractmethod
    def graph_exec_object(self, raw_exec: int) -> object:
        """What ``graph_launch_template``'s {exec} takes for a raw graph-exec handle: the
        vendor object, or the raw handle itself where the backend calls the driver from C."""

    @abc.abstractmethod
    def stream_object(self, raw_stream: int) -> object:
        """The vendor object for a raw stream handle, for calls into the binding. Generated
        code converts handles through ``hot_namespace``'s ``_STREAMS`` and ``_stream_object``
        instead, which give what the launch templates take (the raw handle itself where the
        backend calls the driver from C)."""
