"""Every error jitcore raises, so callers can catch by meaning, and the warnings it issues.

Each class also derives from the builtin exception a Python user would guess first
(TypeError for a wrong kind of argument, ValueError for a wrong value), so generic handlers
keep working.
"""

from __future__ import annotations


class JitError(Exception):
    """Base class of all jitcore errors."""


class UnsupportedTensorError(JitError, TypeError):
    """A tensor jitcore cannot describe: sparse, nested, meta, conjugate or negative views,
    tensor subclasses with their own dispatch, or an unsupported dtype or device."""


class LayoutError(JitError, ValueError):
    """A tensor layout that the requested signature cannot express."""


class ArgumentError(JitError, TypeError):
    """An argument that does not fit the launcher or the kernel parameter it reaches."""


class DeviceError(JitError, ValueError):
    """A tensor on a device the launch cannot use (CPU, or not the current device)."""


class SymbolicValueError(JitError, TypeError):
    """A symbolic (runtime) value used where tracing needs a concrete Python value."""


class LaunchConfigError(JitError, ValueError):
    """A grid, block or shared-memory size that the device cannot launch."""


class GlobalDriftError(JitError, RuntimeError):
    """A global or closure value the launcher read at trace time has changed since."""


class CompileError(JitError):
    """The runtime compiler rejected a kernel. Carries the log and the source excerpt."""

    def __init__(self, message: str, log: str = "", source_excerpt: str = "") -> None:
        super().__init__(message)
        self.log = log
        self.source_excerpt = source_excerpt


class BackendUnavailableError(JitError, ImportError):
    """The vendor binding for the selected backend is not installed or cannot be used."""


class DriverError(JitError, RuntimeError):
    """A driver or runtime-compiler call failed."""

    def __init__(self, call: str, code: int, name: str, detail: str = "") -> None:
        text = f"{call} failed with {name} ({code})"
        super().__init__(f"{text}: {detail}" if detail else text)
        self.call = call
        self.code = code
        self.name = name


class CaptureMissError(JitError, RuntimeError):
    """A jit cache miss while a graph capture is under way: compiling would have to happen
    inside the capture, which jitcore refuses."""


class CacheWarning(RuntimeWarning):
    """The disk cache of compiled kernels is not used: its directory is owned by another user
    or writable by others (or cannot be created). Issued once per directory and process;
    kernels still compile, uncached."""
