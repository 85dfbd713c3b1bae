"""Test doubles for the GPU driver (pure-logic CPU tests only; the GPU tests run the real one)."""

from __future__ import annotations

import ctypes
import threading

from jitcore.backends.null import NullBackend
from jitcore.errors import CaptureMissError


class CountingBackend(NullBackend):
    """The null backend, but every launch records the parameter bytes it was given."""

    def __init__(self, device_name: str = "cpu", device: int = -1):
        super().__init__()
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
