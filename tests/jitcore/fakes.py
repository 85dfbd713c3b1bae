"""Test doubles for the GPU driver (pure-logic CPU tests only; the GPU tests run the real one)."""

from __future__ import annotations

import ctypes
import threading

from jitcore.backends.null import NullBackend
from jitcore.errors import CaptureMissError

try:
    from jitcore.backends import _native
except ImportError:  # a build without a C compiler
    _native = None

#: How call states pack a launch's parameters in the tests that run both: struct into this
#: thread's buffers, and the C helper's PackedLaunch where it was built.
PACKINGS = ["struct", "packed"] if _native is not None else ["struct"]

_KERNEL_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3)


class CountingBackend(NullBackend):
    """The null backend, but every launch records the parameter bytes it was given.

    ``packed=True``: call states launch through the C helper's PackedLaunch (the CUDA
    backend's hot path where the helper is built), with this backend's recording launch as
    the "driver" behind it (a ctypes callback), so the C packing is checked byte for byte."""

    def __init__(self, device_name: str = "cpu", device: int = -1, *, packed: bool = False):
        super().__init__()
        if packed and _native is None:
            raise RuntimeError("packed=True needs jitcore.backends._native (not built here)")
        self._packed = packed
        self._callbacks: list = []  # the ctypes callbacks PackedLaunch calls, kept alive
        self._device_name = device_name
        self._device = device
        self.calls: list[tuple] = []
        self.lock = threading.Lock()
        self.layout_of: dict[object, object] = {}

        def launch(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            with self.lock:
                self.calls.append(
                    (
                        function,
                        (gx, gy, gz),
                        (bx, by, bz),
                        shared,
                        stream,
                        params,
                        threading.get_ident(),
                        self._read(function, params),
                    )
                )
            return (0,)

        self.hot_namespace = dict(self.hot_namespace, _null_launch=launch, _current_device=lambda: self._device)

    def packed_launcher(self, function, template, offsets, runs, failed=None):
        if not self._packed:
            return None
        launch = self.hot_namespace["_null_launch"]

        def driver(function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
            return launch(function, gx, gy, gz, bx, by, bz, shared, stream or 0, params, extra or 0)[0]

        callback = _KERNEL_LAUNCH(driver)
        self._callbacks.append(callback)
        address = ctypes.cast(callback, ctypes.c_void_p).value
        return _native.PackedLaunch(address, function, template, offsets, runs, failed)

    def _read(self, function, params_address):
        layout = self.layout_of.get(function)
        if layout is None or not layout.offsets:
            return ()
        pointers = (ctypes.c_void_p * len(layout.offsets)).from_address(params_address)
        return tuple(ctypes.string_at(pointers[i], t.size) for i, t in enumerate(layout.types))

    def load(self, binary, name_expression, device):
        return super().load(binary, name_expression, device)

    def launch(self, function, grid, block, shared_bytes, stream, params) -> None:
        with self.lock:
            self.calls.append(
                (
                    function.handle,
                    grid,
                    block,
                    shared_bytes,
                    stream,
                    params.address,
                    threading.get_ident(),
                    tuple(params.param_bytes(i) for i in range(len(params.layout.types))),
                )
            )

    def current_device(self) -> int:
        return self._device

    def device_name(self, device: int) -> str:
        return self._device_name


def track_layouts(backend: CountingBackend, *specializations) -> None:
    """Tell the backend how to read each kernel's packed parameters at launch."""
    for spec in specializations:
        function = spec.function(backend.current_device())
        backend.layout_of[function.handle] = spec.layout


class ListRecorder:
    """A jit recorder hook (``jitcore.recorder``) that keeps every launch record and every
    miss; with ``refuse_miss`` a miss raises, as a capture's recorder does."""

    def __init__(self, refuse_miss: bool = False):
        self.records = []
        self.misses = []
        self.refuse_miss = refuse_miss

    def launch(self, record):
        self.records.append(record)

    def miss(self, description):
        self.misses.append(description)
        if self.refuse_miss:
            raise CaptureMissError(description)
