"""What the replay layer uses of jitcore beyond its public API, in one place.

replay (the graph recorder) sits on jitcore's inner parts in a few places: it installs the
launch recorder, reads the current device and stream the way generated launch code does,
builds argument guards, generates Python through jitcore's one codegen helper, and hands the
backend graph and node operations. It imports those from here and everything else from
``jitcore``'s top level (``jitcore.Kernel``, ``jitcore.jit``, the errors, ``GlobalsSnapshot``,
``TensorsByName``, ``lean_static_signature``); tests/replay/test_jitcore_surface.py holds it to
that. Why a module of its own rather than more names on the top level: these are contracts
between the two packages (the recorder's records, the backend's readers, the guard builder),
not what a user of the jit calls; listed here, a change to one of them shows which side it
touches.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from jitcore import generated
from jitcore.backends import compiled_helpers_enabled, get_backend, native_module
from jitcore.backends.abi import ParamLayout, ParamType
from jitcore.backends.base import Backend, GraphNode, NodeUpdater
from jitcore.codegen import never
from jitcore.drift import SKIP_PACKAGES, freeze
from jitcore.guards import ArgumentCheck, make_guard
from jitcore.keys import NUMBERS, exact
from jitcore.recorder import (
    CAPTURES,
    CaptureBusy,
    CheckRecord,
    ConfigRecord,
    LaunchRecord,
    ParamRecord,
    recording,
)
from jitcore.symbolic import DeferredScalar


def current_device_reader(backend: Backend | None = None) -> Callable[[], int]:
    """The current device as generated launch code reads it: ``reader() -> device`` (torch's
    cheapest entry point; the backend publishes it for its generated code), of ``backend``
    or the current one. Called on every guarded call, so it is handed out, not wrapped."""
    return (backend or get_backend()).hot_namespace["_current_device"]


def current_stream_reader(backend: Backend | None = None) -> Callable[[int], int]:
    """The current stream as generated launch code reads it: ``reader(device) -> raw handle``,
    of ``backend`` or the current one (see :func:`current_device_reader`)."""
    return (backend or get_backend()).hot_namespace["_current_stream"]


def native_helper() -> ModuleType | None:
    """jitcore's C helper (csrc/jitcore_native.c, ``jitcore.backends._native``) where it was
    built and ``JITCORE_NATIVE`` allows it, else None: replay's recording hands it the launch
    records to copy without their tensors."""
    return native_module()


def torch_native_module() -> ModuleType | None:
    """The torch-side native helper (csrc/jitcore_torch_native.cpp) where it is built and
    loadable, else None. Imported on first use, as ``jitcore.torch_native`` is."""
    from jitcore import torch_native

    return torch_native.module()


__all__ = [
    "CAPTURES",
    "NUMBERS",
    "SKIP_PACKAGES",
    "ArgumentCheck",
    "Backend",
    "CaptureBusy",
    "CheckRecord",
    "ConfigRecord",
    "DeferredScalar",
    "GraphNode",
    "LaunchRecord",
    "NodeUpdater",
    "ParamLayout",
    "ParamRecord",
    "ParamType",
    "compiled_helpers_enabled",
    "current_device_reader",
    "current_stream_reader",
    "exact",
    "freeze",
    "generated",
    "get_backend",
    "make_guard",
    "native_helper",
    "never",
    "recording",
    "torch_native_module",
]
