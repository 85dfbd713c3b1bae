"""Kernels written as C++ source, their template specializations and launch syntax.

    axpy = jc.Kernel(SRC, "axpy")                 # template <typename T> __global__ void axpy(...)
    axpy.instantiate(torch.float32)[grid, block](x, y, out, alpha, n)

Inside a ``@jit`` launcher a launch is recorded into the call state being traced; outside one
it launches directly (a convenience path: no call state, every argument re-checked and packed).
"""

from __future__ import annotations

import re
import struct
import threading
from collections.abc import Sequence

import numpy as np
import torch

from jitcore import compiler, dtypes, tracing
from jitcore.backends import abi, get_backend
from jitcore.backends.abi import PackedParams, ParamLayout
from jitcore.backends.base import LoadedFunction
from jitcore.errors import ArgumentError, DeviceError, LaunchConfigError

_IDENTIFIER = re.compile(r"^[A-Za-z_]\w*$")


def template_argument(value: object, backend=None) -> str:
    """The C++ spelling of one template argument: what identifies a specialization (two
    arguments with one spelling are one kernel; ``True`` and ``1`` are not, since
    ``template <auto V>`` makes them a bool and an int)."""
    if isinstance(value, (bool, np.bool_)):
        return "true" if value else "false"
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, torch.dtype):
        return (backend or get_backend()).type_name(dtypes.from_torch(value))
    if isinstance(value, dtypes.DType):
        return (backend or get_backend()).type_name(value)
    if isinstance(value, str):
        return value
    raise TypeError(
        f"template argument {value!r} ({type(value).__qualname__}): expected a torch dtype, an "
        "int, a bool or a C++ spelling as str"
    )


def _resolved_default(
    kernel: str, name: str, default: str, earlier: dict[str, str], params: Sequence[tuple[str, str, str | None]]
) -> str:
    """The text a defaulted template parameter stands for in this specialization: its default
    with the earlier parameters' arguments substituted, as C++ reads it
    (``template <typename T, typename Out = T>`` makes ``Out`` the type given for ``T``).

    Left as written, ``Out* out`` would read as a pointer to the unknown type ``T``: an opaque
    pointee, which takes a tensor of any dtype. A default that still names a template parameter
    after the substitution (a later one, or itself: not valid C++) cannot be resolved, and is
    refused with an ``ArgumentError`` saying to pass the argument explicitly."""
    resolved = abi.substitute(default, earlier)
    later = [other for _kind, other, _default in params if other not in earlier]  # name itself included
    unresolved = [other for other in later if re.search(rf"\b{re.escape(other)}\b", resolved)]
    if unresolved:
        raise ArgumentError(
            f"{kernel}: the default of template parameter {name!r} ({default!r}) names "
            f"{', '.join(repr(n) for n in unresolved)}, which has no argument before it, so jitcore "
            f"cannot tell what {name!r} is; pass it explicitly to instantiate()"
        )
    return resolved


class Kernel:
    """A ``__global__`` function in C++ source (the common CUDA/HIP subset).

    ``signature`` gives the parameter list explicitly ("const float* x, int n") instead of
    reading it from the declaration; ``options`` pass through to the runtime compiler
    (include paths, ``-D`` defines, ``-lineinfo``).
    """

    def __init__(self, source: str, name: str, *, signature: str | None = None, options: Sequence[str] = ()):
        if not isinstance(source, str):
            raise TypeError(f"Kernel source must be a str, got {type(source).__qualname__}")
        if not isinstance(name, str) or not _IDENTIFIER.match(name):
            raise ValueError(f"Kernel name must be a C identifier, got {name!r}")
        if isinstance(options, str) or not all(isinstance(o, str) for o in options):
            raise TypeError(f"Kernel options must be a sequence of str, got {options!r}")
        self.source = source
        self.name = name
        self.options = tuple(options)
        self.signature = signature
        if signature is None:
            self.declaration = abi.find_kernel(source, name)
        else:
            if not isinstance(signature, str):
                raise TypeError(f"signature must be a str, got {type(signature).__qualname__}")
            abi.parse_signature(signature)  # fail early on a bad signature
            self.declaration = None
        self._specializations: dict[tuple[str, ...], KernelSpecialization] = {}  # by spelled arguments
        self._lock = threading.Lock()

    #: What its compiled binaries and parameter types are made of: fixed once set, since a
    #: specialization compiles once per device (a later ``kernel.options = [...]`` would keep
    #: running the binary of the old options).
    _FIXED = frozenset({"source", "name", "options", "signature", "declaration"})

    def __setattr__(self, name: str, value: object) -> None:
        if name in Kernel._FIXED and name in self.__dict__:
            raise AttributeError(
                f"Kernel.{name} is fixed when the kernel is made (its compiled binaries depend on it): make another "
                "jc.Kernel instead"
            )
        object.__setattr__(self, name, value)

    def instantiate(self, *template_args: object) -> KernelSpecialization:
        """The specialization for these template arguments (torch dtypes, ints, bools, str).

        Cached by the arguments' C++ spellings (:func:`template_argument`, for the current
        backend), not by Python equality: ``True == 1 == 1.0`` in Python, but ``s<true>`` and
        ``s<1>`` are different kernels and ``1.0`` is no template argument at all, so each is
        spelled (or refused) on every call, whatever was instantiated before."""
        backend = get_backend()
        key = tuple(template_argument(a, backend) for a in template_args)
        specialization = self._specializations.get(key)
        if specialization is None:
            specialization = KernelSpecialization(self, key)
            with self._lock:
                specialization = self._specializations.setdefault(key, specialization)
        return specialization

    def __getitem__(self, config: tuple) -> LaunchConfig:
        return self.instantiate()[config]

    def __repr__(self) -> str:
        return f"Kernel({self.name!r})"


class KernelSpecialization:
    """One name expression (``axpy<float>``): its parameter types and, per device, its
    loaded function."""

    def __init__(self, kernel: Kernel, template_args: tuple[str, ...]):
        self.kernel = kernel
        self.template_args = template_args
        declaration = kernel.declaration
        if declaration is not None:
            params = declaration.template_params
            if len(template_args) > len(params):
                raise ArgumentError(f"{kernel.name} takes {len(params)} template arguments, got {len(template_args)}")
            missing = [name for kind, name, default in params[len(template_args) :] if default is None]
            if missing:
                raise ArgumentError(f"{kernel.name}: missing template arguments for {', '.join(missing)}")
            mapping = {name: arg for (kind, name, _), arg in zip(params, template_args)}
            for _kind, name, default in params[len(template_args) :]:
                mapping[name] = _resolved_default(kernel.name, name, default, mapping, params)
            self.param_types = tuple(
                abi.parse_param(abi.substitute(text, mapping), i) for i, text in enumerate(declaration.params_text)
            )
            templated = bool(params)
        else:
            self.param_types = abi.parse_signature(kernel.signature)
            templated = bool(template_args)
        self.name_expression = f"{kernel.name}<{', '.join(template_args)}>" if templated else kernel.name
        self.layout = ParamLayout.of(self.param_types)
        self._functions: dict[int, LoadedFunction] = {}
        self._lock = threading.Lock()

    def function(self, device: int) -> LoadedFunction:
        """Compile (through the disk cache) and load on ``device``, once per device."""
        function = self._functions.get(device)
        if function is None:
            with self._lock:
                function = self._functions.get(device)
                if function is None:
                    backend = get_backend()
                    arch = backend.device_arch(device)
                    binary = compiler.compile_cached(
                        backend,
                        self.kernel.source,
                        [self.name_expression],
                        self.kernel.options,
                        arch,
                        self.template_args,
                    )
                    function = self._functions[device] = backend.load(binary, self.name_expression, device)
        return function

    def compile_for(self, arch: str):
        """Compile without loading (no GPU needed); returns the compiled binary."""
        backend = get_backend()
        return compiler.compile_cached(
            backend, self.kernel.source, [self.name_expression], self.kernel.options, arch, self.template_args
        )

    def __getitem__(self, config: tuple) -> LaunchConfig:
        if not isinstance(config, tuple) or len(config) not in (2, 3):
            raise LaunchConfigError(
                f"{self.name_expression}[...] takes [grid, block] or [grid, block, shared_bytes], got {config!r}"
            )
        return LaunchConfig(self, *config)

    def __repr__(self) -> str:
        return f"KernelSpecialization({self.name_expression!r})"


class LaunchConfig:
    """``kernel[grid, block, shared]``: call it with the kernel's arguments."""

    __slots__ = ("kernel", "grid", "block", "shared")

    def __init__(self, kernel: KernelSpecialization, grid: object, block: object, shared: object = 0):
        self.kernel = kernel
        self.grid = grid
        self.block = block
        self.shared = shared

    def __call__(self, *args: object) -> None:
        trace = tracing.current_trace()
        if trace is not None:
            trace.record_launch(self.kernel, self.grid, self.block, self.shared, args)
        else:
            launch_direct(self, args)


def launch_direct(config: LaunchConfig, args: Sequence[object]) -> None:
    """Launch outside any jit launcher: check everything (with the checks tracing makes),
    pack every slot, launch on the current torch stream of the current device (a grid
    dimension of 0 launches nothing)."""
    kernel = config.kernel
    backend = get_backend()
    device = backend.current_device()
    device_name = backend.device_name(device)
    label = kernel.name_expression
    params = kernel.param_types
    tracing.check_argument_count(kernel, args)
    values = []
    for index, (param, value) in enumerate(zip(params, args)):
        where = tracing.argument_place(index, param, label)
        if isinstance(value, torch.Tensor):
            from jitcore.tensors import describe_torch_tensor
            from jitcore.tensors import device_name as tensor_device

            tracing.check_tensor_argument(where, param, describe_torch_tensor(value).name, "tensor")
            if tensor_device(value.device) != device_name:
                raise DeviceError(
                    f"{where}: tensor is on {tensor_device(value.device)}, the current device is {device_name}"
                )
            values.append(value.data_ptr())
        else:
            values.append(tracing.plain_argument(where, param, value))
    grid, block, shared = tracing.launch_dims(config.grid, config.block, config.shared, label)
    function = kernel.function(device)
    tracing.check_static_config(label, grid, block, shared, backend.device_limits(device), function)
    if tracing.is_empty_grid(grid):
        return  # a grid dimension of 0: a launch over no work
    if shared > function.dynamic_shared_limit:
        backend.set_dynamic_shared_limit(function, shared)
    packed = PackedParams(kernel.layout)
    if params:
        offset, packer = kernel.layout.struct_for(tuple(range(len(params))))
        try:
            packer.pack_into(packed.buffer, offset, *values)
        except struct.error as exc:
            raise ArgumentError(f"{label}: an argument does not fit its C type ({exc})") from None
    backend.launch(function, grid, block, shared, backend.current_stream(device), packed)
