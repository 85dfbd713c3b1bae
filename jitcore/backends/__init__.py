"""Backend selection: one driver interface, one implementation per vendor.

The backend follows torch (a ROCm build, where ``torch.version.hip`` is set, means HIP);
``JITCORE_BACKEND=cuda|hip`` overrides it. The vendor module is imported on first use, so
``import jitcore`` works without any vendor binding installed.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import types
from collections.abc import Iterator

from jitcore.backends.base import Backend
from jitcore.errors import BackendUnavailableError

BACKENDS = {
    "cuda": ("jitcore.backends.cuda", "CudaBackend", "cuda"),
    "hip": ("jitcore.backends.hip", "HipBackend", "rocm"),
}

_lock = threading.Lock()


def compiled_helpers_enabled() -> bool:
    """Whether the optional C helpers (csrc/jitcore_native.c, csrc/jitcore_exclusion.c,
    csrc/replay_eager.c) may be used where they were built: ``JITCORE_NATIVE=0`` turns them all
    off, and their Python equivalents run."""
    return os.environ.get("JITCORE_NATIVE", "1").strip() != "0"


def native_module() -> types.ModuleType | None:
    """jitcore's C helper (csrc/jitcore_native.c, ``jitcore.backends._native``) where it was
    built and :func:`compiled_helpers_enabled` allows it, else None: the one place that decides
    whether the helper is used."""
    if not compiled_helpers_enabled():
        return None
    try:
        from jitcore.backends import _native  # type: ignore[attr-defined]  # a C extension, built by setup.py
    except ImportError:
        return None
    return _native


_instances: dict[str, Backend] = {}


def selected_name() -> str:
    """The backend this process uses: JITCORE_BACKEND, else what torch was built for."""
    override = os.environ.get("JITCORE_BACKEND", "").strip().lower()
    if override:
        if override not in BACKENDS:
            raise ValueError(f"JITCORE_BACKEND={override!r}: expected one of {', '.join(BACKENDS)}")
        return override
    import torch

    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def get_backend(name: str | None = None) -> Backend:
    name = name or selected_name()
    backend = _instances.get(name)
    if backend is not None:
        return backend
    with _lock:
        backend = _instances.get(name)
        if backend is None:
            module_name, class_name, extra = BACKENDS[name]
            try:
                module = importlib.import_module(module_name)
            except BackendUnavailableError:
                raise
            except ImportError as exc:
                raise BackendUnavailableError(
                    f"the {name} backend cannot be imported ({exc}); install it with pip install 'jitreplay[{extra}]'"
                ) from exc
            backend = _instances[name] = getattr(module, class_name)()
    return backend


@contextlib.contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Make ``backend`` the selected one for the block (tests and benchmarks use it to put a
    test double in place of the driver)."""
    name = selected_name()
    previous = _instances.get(name)
    _instances[name] = backend
    try:
        yield backend
    finally:
        if previous is None:
            _instances.pop(name, None)
        else:
            _instances[name] = previous


__all__ = [
    "Backend",
    "BACKENDS",
    "compiled_helpers_enabled",
    "get_backend",
    "native_module",
    "selected_name",
    "use_backend",
]
