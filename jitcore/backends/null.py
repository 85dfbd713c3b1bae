"""A stand-in backend that compiles and launches nothing, for CPU tests and benchmarks.

It answers the driver interface with fixed device limits, takes CPU tensors as if the CPU
were the device, and makes each launch one call of a Python function with the same arity as
the vendor launch (so the Python-side cost of a call state is measured with the driver call
replaced by a no-op). Never selected automatically: install it with
``jitcore.backends.use_backend(NullBackend())``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from jitcore.backends.abi import CUDA_TYPE_NAMES, ParamLayout
from jitcore.backends.base import (
    Backend,
    CompiledBinary,
    DeviceLimits,
    GraphNode,
    LoadedFunction,
    NodeUpdater,
)
from jitcore.dtypes import DType

_SUCCESS = (0,)
_HANDLES = itertools.count(0x1000)


def _null_launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
    return _SUCCESS


def _launch_failed(status: int, label: str) -> None:
    raise RuntimeError(f"null launch of {label} failed ({status})")


def _native_helper():
    """jitcore.backends._native, where it was built and ``JITCORE_NATIVE`` does not turn it off."""
    from jitcore.backends import native_module

    helper = native_module()
    if helper is None:
        raise ValueError("NullBackend(packed=True) needs jitcore.backends._native, built and not turned off")
    return helper


class NullBackend(Backend):
    name = "null"
    device_type = "cpu"

    def __init__(self, *, packed: bool = False) -> None:
        """``packed``: call states launch through the C helper's PackedLaunch over a launch that
        runs nothing (its ``NULL_LAUNCH``), and a recording asks the capture tail of a C
        CaptureTail over a query that answers "not capturing" (``NULL_CAPTURE_INFO``), as they
        do on the CUDA backend where the helper is built; a ValueError where the helper was not
        built."""
        self.launches = 0
        self._packed = _native_helper() if packed else None
        self._handles = _HANDLES  # process-wide: kernels keep loaded functions across backends
        self.raw_launch = _null_launch
        self.hot_namespace = {
            "_null_launch": _null_launch,
            "_STREAMS": {},
            "_stream_object": lambda raw: raw,
            "_current_device": lambda: -1,
            "_current_stream": lambda device: 0,
            "_launch_failed": _launch_failed,
        }
        self.launch_template = (
            "_r = _null_launch({function}, {gx}, {gy}, {gz}, {bx}, {by}, {bz}, {shared}, {stream}, {params}, 0)\n"
            "if _r[0]: raise RuntimeError('null launch failed')"
        )
        self.graph_launch_template = "pass"

    def current_device(self) -> int:
        return -1

    def device_name(self, device: int) -> str:
        return "cpu"

    def current_stream(self, device: int) -> int:
        return 0

    def is_capturing(self) -> bool:
        return False

    def compiler_version(self) -> str:
        return "null"

    def device_arch(self, device: int) -> str:
        return "null"

    def type_name(self, dtype: DType) -> str:
        return CUDA_TYPE_NAMES[dtype.name]

    def prelude(self, source: str, type_names: Sequence[str]) -> str:
        return ""

    def compile(self, source, name_expressions, options, arch) -> CompiledBinary:
        return CompiledBinary(b"", {e: e for e in name_expressions}, "", arch, "null")

    def load(self, binary, name_expression, device) -> LoadedFunction:
        return LoadedFunction(
            handle=next(self._handles),
            address=0,
            device=device,
            name=name_expression,
            max_threads_per_block=1024,
            static_shared_bytes=0,
            dynamic_shared_limit=48 * 1024,
        )

    def capture_tail_function(self):
        if self._packed is None:
            return self.capture_tail
        return self._packed.CaptureTail(self._packed.NULL_CAPTURE_INFO, 1)

    def packed_launcher(self, function, template, offsets, runs, failed=None):
        if self._packed is None:
            return None
        return self._packed.PackedLaunch(self._packed.NULL_LAUNCH, function, template, offsets, runs, failed)

    def device_limits(self, device: int) -> DeviceLimits:
        return DeviceLimits((1024, 1024, 64), 1024, (2**31 - 1, 65535, 65535), 48 * 1024, 227 * 1024)

    def set_dynamic_shared_limit(self, function: LoadedFunction, nbytes: int) -> None:
        function.dynamic_shared_limit = nbytes

    def launch(self, function, grid, block, shared_bytes, stream, params) -> None:
        self.launches += 1

    def synchronize(self, device: int) -> None:
        pass

    def graph_nodes(self, raw_graph: int) -> list[GraphNode]:
        raise NotImplementedError("the null backend has no graphs")

    def kernel_param_sizes(self, function: int) -> list[int] | None:
        return None

    def read_kernel_params(self, node: GraphNode, sizes: Sequence[int]) -> list[bytes]:
        raise NotImplementedError("the null backend has no graphs")

    def node_updater(self, raw_exec: int, node: GraphNode, layout: ParamLayout, initial: bytes) -> NodeUpdater:
        raise NotImplementedError("the null backend has no graphs")

    def graph_launch(self, raw_exec: int, stream: int) -> None:
        raise NotImplementedError("the null backend has no graphs")

    def graph_exec_object(self, raw_exec: int) -> object:
        raise NotImplementedError("the null backend has no graphs")

    def stream_object(self, raw_stream: int) -> object:
        return raw_stream
