"""What the CUDA and HIP backends do alike around their bindings, written once.

cuda-bindings and hip-python wrap their C APIs the same way: every call returns a tuple
``(status, *values)`` whose status is an enum member, and hiprtc is NVRTC's twin under another
prefix (``hiprtcCompileProgram`` for ``nvrtcCompileProgram``, ...). So checking a result and
driving a runtime compiler from source to code object are the same steps for both vendors;
only the calls differ. Those steps live here and take the vendor calls as arguments (the
status enum, the error-string call, the compiler's binding module) or as overridden methods.
This module imports no binding: :mod:`jitcore.backends.cuda` and :mod:`jitcore.backends.hip`
stay the only modules that do. Nothing here is on a hot path (generated code tests a launch's
status itself and only calls a backend's error builder when it failed).
"""

from __future__ import annotations

import abc
import contextlib
import threading
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, NoReturn

from jitcore.backends.base import Backend, CompiledBinary, DeviceLimits, LoadedFunction
from jitcore.errors import CompileError, DriverError


def status_name(enum: type, status: object) -> str:
    """The name of a status code (``CUDA_ERROR_INVALID_VALUE``), or ``"<enum> <code>"`` for a
    code the binding's enum does not know (a driver newer than its binding)."""
    try:
        return enum(int(status)).name
    except ValueError:
        return f"{enum.__name__} {int(status)}"


def unpack(result: tuple) -> object:
    """The values a binding call returned after its status: None, the one value, or a tuple."""
    if len(result) == 1:
        return None
    return result[1] if len(result) == 2 else result[1:]


def _no_detail(status: object) -> str:
    return ""


class StatusCheck:
    """Checks one vendor API's result tuples: calling it returns the values after the status
    (see :func:`unpack`) or raises :class:`~jitcore.errors.DriverError` naming the call.

    ``enum`` is the binding's status enum (``CUresult``, ``hipError_t``, ``nvrtcResult``,
    ...), ``detail(status)`` the driver's sentence for a status ("" where it has none).
    :meth:`error` builds the same error for a status tested elsewhere (a failed launch, which
    generated code tests itself).
    """

    __slots__ = ("enum", "detail")

    def __init__(self, enum: type, detail: Callable[[object], str] = _no_detail):
        self.enum = enum
        self.detail = detail

    def error(self, call: str, status: object, *, with_detail: bool = True) -> DriverError:
        """The DriverError for ``call`` having returned the non-success ``status``."""
        detail = self.detail(status) if with_detail else ""
        return DriverError(call, int(status), status_name(self.enum, status), detail)

    def __call__(self, result: tuple, call: str) -> Any:  # the binding's own (untyped) values
        status = result[0]
        if int(status):
            raise self.error(call, status)
        return unpack(result)


def _text(value: object, default: str) -> str:
    """A string a binding returned: bytes (cuda-bindings), a runtime-owned C string that
    ``bytes()`` copies (hip-python), or already a str; ``default`` for a NULL."""
    if value is None:
        return default
    return value if isinstance(value, str) else bytes(value).decode()


class RuntimeCompiler:
    """NVRTC or hiprtc, driven from C++ source to a code object and its lowered names.

    Both compilers have one C API under two prefixes, bound alike, so each step is written
    once and each call and the status enum (``nvrtcCompileProgram``, ``nvrtcResult``) are
    looked up as ``prefix + name`` on ``binding`` (the ``nvrtc`` or ``hiprtc`` module). A
    backend subclasses it where its compiler differs: :meth:`code_kind`, :meth:`destroy`,
    :meth:`failure_hint` and :meth:`library_missing`.
    """

    def __init__(self, binding: ModuleType, prefix: str, title: str, arch_option: str, include_dir: str | None):
        self.binding = binding
        self.prefix = prefix  # of every call, of the status enum and of the version ("nvrtc", "hiprtc")
        self.title = title  # the compiler's name in messages ("NVRTC", "hiprtc")
        self.arch_option = arch_option  # names the target ("--gpu-architecture", "--offload-arch")
        self.include_dir = include_dir  # where the vendor headers the prelude includes are
        self.check = StatusCheck(getattr(binding, prefix + "Result"))

    # --- what a vendor overrides ---------------------------------------------------------
    def code_kind(self, arch: str) -> str:
        """Which code object to read: the ``X`` of ``GetXSize``/``GetX`` ("Code", "CUBIN", ...)."""
        return "Code"

    def destroy(self, program: object) -> None:
        """Free the program (its result is not checked: this runs on the way out of errors)."""
        self._function("DestroyProgram")(program)

    def failure_hint(self, log: str) -> str:
        """Text appended to a compile error's message (a likely cause the log shows)."""
        return ""

    def library_missing(self, exc: RuntimeError) -> Exception | None:
        """The error to raise where the binding could not open the compiler's library (its
        first call raised ``exc``), or None to let ``exc`` through."""
        return None

    # --- the steps -----------------------------------------------------------------------
    def _function(self, name: str) -> Callable:
        return getattr(self.binding, self.prefix + name)

    def _call(self, name: str, *args: object) -> object:
        return self.check(self._function(name)(*args), self.prefix + name)

    def _first_call(self, name: str, *args: object) -> object:
        """A call that opens the library: a failure to open it becomes :meth:`library_missing`'s
        error (a failed call is a DriverError, itself a RuntimeError, and passes through)."""
        try:
            return self._call(name, *args)
        except DriverError:
            raise
        except RuntimeError as exc:
            error = self.library_missing(exc)
            if error is None:
                raise
            raise error from exc

    def version(self) -> str:
        major, minor = self._first_call("Version")
        return f"{self.prefix}-{major}.{minor}"

    def compile(
        self, source: str, name_expressions: Sequence[str], options: Sequence[str], arch: str
    ) -> CompiledBinary:
        program = self._first_call("CreateProgram", source.encode(), b"kernel.cu", 0, [], [])
        try:
            for expression in name_expressions:
                self._call("AddNameExpression", program, expression.encode())
            flags = [f"{self.arch_option}={arch}", "-std=c++17"]
            if self.include_dir:
                flags.append(f"-I{self.include_dir}")
            flags += list(options)
            encoded = [flag.encode() for flag in flags]
            status = self._function("CompileProgram")(program, len(encoded), encoded)[0]
            log = self._log(program)
            if int(status):
                message = f"{self.title} could not compile {', '.join(name_expressions)} for {arch}"
                raise CompileError(message + self.failure_hint(log), log=log)
            lowered = {}
            for expression in name_expressions:
                # the compiler owns the string until the program is destroyed: copy it now
                name = self._call("GetLoweredName", program, expression.encode())
                lowered[expression] = _text(name, expression)
            kind = self.code_kind(arch)
            # the compiler writes into the log and image buffers: they must be writable objects
            # of our own, never bytes (``b" " * 1`` is CPython's shared one-byte ``b" "``, which
            # an empty log's terminator would overwrite for the whole process)
            image = bytearray(self._call(f"Get{kind}Size", program))
            self._call(f"Get{kind}", program, image)
            return CompiledBinary(
                image=bytes(image), lowered_names=lowered, log=log, arch=arch, compiler=self.version()
            )
        finally:
            self.destroy(program)

    def _log(self, program: object) -> str:
        size = self._call("GetProgramLogSize", program)
        if size <= 1:  # the terminating NUL alone
            return ""
        buffer = bytearray(size)
        self._call("GetProgramLog", program, buffer)
        return bytes(buffer).rstrip(b"\0 ").decode(errors="replace")


class DriverBackend(Backend):
    """A vendor backend's driver side, where CUDA's and HIP's take the same steps over other
    calls: the hot namespace and launch templates of generated code, starting the driver once
    per process, reading a device's limits once, and the checked launch and graph launch of
    slow paths and tests.

    A subclass passes its launch calls to ``__init__``, names :class:`DeviceLimits`' device
    attributes in ``limit_attributes`` and implements :meth:`_start_driver` and
    :meth:`_device_attributes`.
    """

    #: The vendor's names of the device attributes :class:`DeviceLimits` holds, in its field
    #: order: block x, y, z; threads per block; grid x, y, z; shared memory per block, without
    #: and with opting in.
    limit_attributes: tuple[str, ...]

    def __init__(
        self,
        compiler: RuntimeCompiler,
        launch: Callable[..., tuple],
        graph_launch: Callable[..., tuple],
        no_extra: object,
        check: StatusCheck,
        streams: dict[int, object],
        *,
        launch_detail: bool = True,
    ) -> None:
        """``compiler`` compiles for this vendor; ``launch`` and ``graph_launch`` are the vendor
        calls (generated code calls them as ``_<their name>``), ``no_extra`` what the launch takes
        for its unused ``extra`` argument, ``check`` the driver's result check, ``streams`` the
        raw-handle -> stream-object cache generated code reads as ``_STREAMS``.
        ``launch_detail``: whether a failed launch's error carries the driver's sentence for its
        status."""
        self._compiler = compiler
        self._lock = threading.Lock()
        self._initialized = False
        self._limits: dict[int, DeviceLimits] = {}
        self._streams = streams
        self._driver_check = check
        self._launch_detail = launch_detail
        self._launch_name = launch.__name__
        self._graph_launch_name = graph_launch.__name__
        self._no_extra = no_extra
        self._raw_graph_launch = graph_launch
        self.raw_launch = launch
        self.hot_namespace = {
            f"_{self._launch_name}": launch,
            f"_{self._graph_launch_name}": graph_launch,
            "_STREAMS": streams,
            "_stream_object": self.stream_object,
            "_launch_failed": self._launch_failed,
            "_graph_launch_failed": self._graph_launch_failed,
            **self.torch_hot_namespace(),
        }
        self.launch_template = (
            f"_r = _{self._launch_name}({{function}}, {{gx}}, {{gy}}, {{gz}}, {{bx}}, {{by}}, {{bz}}, {{shared}}, "
            f"{{stream}}, {{params}}, {no_extra!r})\n"
            "if _r[0]: _launch_failed(_r[0], {label})"
        )
        self.graph_launch_template = (
            f"_r = _{self._graph_launch_name}({{exec}}, {{stream}})\nif _r[0]: _graph_launch_failed(_r[0])"
        )

    def graph_launch_parts(self) -> tuple[Callable, Callable]:
        return self.hot_namespace[f"_{self._graph_launch_name}"], self.hot_namespace["_graph_launch_failed"]

    # --- what a vendor implements --------------------------------------------------------
    @abc.abstractmethod
    def _start_driver(self) -> None:
        """Initialise the driver: called once per process, under a lock, by :meth:`_ensure_init`."""

    @abc.abstractmethod
    def _device_attributes(self, device: int) -> Callable[[str], int]:
        """A reader of ``device``'s attributes by vendor name (after :meth:`_ensure_init`)."""

    @abc.abstractmethod
    def _on_device(self, device: int) -> contextlib.AbstractContextManager:
        """A context in which driver calls act on ``device`` (CUDA: its primary context pushed;
        HIP: it made current)."""

    @abc.abstractmethod
    def _load_function(self, image: bytes, lowered: str) -> tuple[object, object]:
        """(function, owner): ``image`` loaded as a module and its function ``lowered``; the
        owner is what must stay alive as long as the function (the module, ...)."""

    @abc.abstractmethod
    def _function_attribute(self, function: object, name: str) -> int:
        """A function attribute by its name without the vendor prefix (``SHARED_SIZE_BYTES``)."""

    # --- the steps -----------------------------------------------------------------------
    def _ensure_init(self) -> None:
        if self._initialized:
            return
        with self._lock:
            if self._initialized:
                return
            self._start_driver()
            self._initialized = True

    def device_limits(self, device: int) -> DeviceLimits:
        limits = self._limits.get(device)
        if limits is None:
            self._ensure_init()
            get = self._device_attributes(device)
            bx, by, bz, threads, gx, gy, gz, shared, optin = (get(name) for name in self.limit_attributes)
            limits = self._limits[device] = DeviceLimits((bx, by, bz), threads, (gx, gy, gz), shared, optin)
        return limits

    def compiler_version(self) -> str:
        return self._compiler.version()

    def compile(
        self, source: str, name_expressions: Sequence[str], options: Sequence[str], arch: str
    ) -> CompiledBinary:
        return self._compiler.compile(source, name_expressions, options, arch)

    def load(self, binary: CompiledBinary, name_expression: str, device: int) -> LoadedFunction:
        lowered = binary.lowered_names[name_expression]
        with self._on_device(device):
            function, owner = self._load_function(binary.image, lowered)
            return LoadedFunction(
                handle=function,
                address=int(function),
                device=device,
                name=name_expression,
                max_threads_per_block=self._function_attribute(function, "MAX_THREADS_PER_BLOCK"),
                static_shared_bytes=self._function_attribute(function, "SHARED_SIZE_BYTES"),
                dynamic_shared_limit=self._function_attribute(function, "MAX_DYNAMIC_SHARED_SIZE_BYTES"),
                owner=owner,
            )

    def _launch_failed(self, status: object, label: str) -> NoReturn:
        raise self._driver_check.error(f"{self._launch_name}({label})", status, with_detail=self._launch_detail)

    def _graph_launch_failed(self, status: object) -> NoReturn:
        raise self._driver_check.error(self._graph_launch_name, status, with_detail=self._launch_detail)

    def launch(self, function, grid, block, shared_bytes, stream, params) -> None:  # Backend.launch's types
        result = self.raw_launch(
            function.handle, *grid, *block, shared_bytes, self.stream_object(stream), params.address, self._no_extra
        )
        if int(result[0]):
            self._launch_failed(result[0], function.name)

    def graph_launch(self, raw_exec: int, stream: int) -> None:
        result = self._raw_graph_launch(self.graph_exec_object(raw_exec), self.stream_object(stream))
        if int(result[0]):
            self._graph_launch_failed(result[0])


__all__ = ["DriverBackend", "RuntimeCompiler", "StatusCheck", "status_name", "unpack"]
