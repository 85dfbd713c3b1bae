"""jitcore: a jit for C++ GPU kernels whose cache-hit launch costs little more than the driver.

    import jitcore as jc

    axpy = jc.Kernel(SRC, "axpy")

    @jc.jit
    def launch_axpy(x, y, out, alpha: float):
        n = x.numel()
        axpy.instantiate(x.dtype)[jc.cdiv(n, 256), 256](x, y, out, alpha, n)

See docs/ for the guide; ``jitcore.recorder`` is the hook through which launches are recorded,
``jitcore.for_replay`` what the replay layer uses beyond this API (the recorder's part among it),
and ``hit_path_parts`` the benchmarks' hook (the steps of a cache hit, each callable alone).
"""

from jitcore import recorder
from jitcore._version import __version__ as __version__
from jitcore.drift import GlobalsSnapshot, TensorsByName
from jitcore.errors import (
    ArgumentError,
    BackendUnavailableError,
    CaptureMissError,
    CompileError,
    DeviceError,
    DriverError,
    GlobalDriftError,
    JitError,
    LaunchConfigError,
    LayoutError,
    SymbolicValueError,
    UnsupportedTensorError,
)
from jitcore.guards import tensor_guard
from jitcore.jit import compile, hit_path_parts, jit
from jitcore.kernel import Kernel, KernelSpecialization
from jitcore.keys import Constexpr, KeyPlan
from jitcore.symbolic import cdiv
from jitcore.symbolic import maximum as max
from jitcore.symbolic import minimum as min
from jitcore.tensors import (
    TensorAdaptor,
    from_dlpack,
    lean_cache_signature,
    lean_static_signature,
)


def __getattr__(name: str) -> object:
    """``jitcore.torch_native`` on first use: importing jitcore does not import it, so that
    ``python -m jitcore.torch_native`` runs it once, as ``__main__``."""
    if name == "torch_native":
        import importlib

        return importlib.import_module("jitcore.torch_native")
    raise AttributeError(f"module 'jitcore' has no attribute {name!r}")


__all__ = [
    "ArgumentError",
    "BackendUnavailableError",
    "CaptureMissError",
    "CompileError",
    "Constexpr",
    "DeviceError",
    "DriverError",
    "GlobalDriftError",
    "GlobalsSnapshot",
    "TensorsByName",
    "JitError",
    "Kernel",
    "KernelSpecialization",
    "KeyPlan",
    "LaunchConfigError",
    "LayoutError",
    "SymbolicValueError",
    "TensorAdaptor",
    "UnsupportedTensorError",
    "cdiv",
    "compile",
    "from_dlpack",
    "hit_path_parts",
    "jit",
    "lean_cache_signature",
    "lean_static_signature",
    "max",
    "min",
    "recorder",
    "tensor_guard",
    "torch_native",
]
