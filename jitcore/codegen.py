"""Call states: a traced launcher turned into straight-line Python.

A call state reads the data pointers and dynamic sizes it needs from the raw arguments, writes
them into persistent parameter buffers (one ``struct.pack_into`` per run of non-constant
parameters; constants are written once when a thread's buffers are made) and calls the vendor
launch directly, once per recorded kernel launch. Print one with ``JITCORE_DUMP=1`` or
``fn.dump()``; an example::

    def launch_axpy__state0(x, y, out, alpha, /, stream=None):
        if _ACTIVE[0]:
            return _recording((x, y, out, alpha), (x, y, out, alpha), stream)
        ...
        x_numel = x.numel()
        _g0x = (-(-x_numel // 256))
        if not 0 < _g0x <= 2147483647: _bad_config(0, 'grid', (_g0x, 1, 1))
        _pack0_0(_b[0], 0, x.data_ptr(), y.data_ptr(), out.data_ptr(), alpha, x_numel)
        _r = _cuLaunchKernel(_f0, _g0x, 1, 1, 256, 1, 1, 0, ...)

Each thread gets its own buffers, so concurrent hits never share a half-written one.
"""

from __future__ import annotations

import builtins
import os
import struct
import threading
from collections.abc import Sequence

from jitcore import recorder, symbolic
from jitcore.backends import abi
from jitcore.backends.abi import PackedParams
from jitcore.backends.base import Backend
from jitcore.errors import ArgumentError, LaunchConfigError
from jitcore.symbolic import Sym
from jitcore.tracing import Trace, TraceLaunch


def dump_enabled() -> bool:
    return os.environ.get("JITCORE_DUMP", "").strip() not in ("", "0")


def stream_handle(stream: object) -> int:
    """A raw stream handle from a torch stream or an int."""
    if isinstance(stream, int):
        return stream
    raw = getattr(stream, "cuda_stream", None)
    if isinstance(raw, int):
        return raw
    raise TypeError(
        f"stream= expects a torch.cuda.Stream or a raw stream handle (int), got {type(stream).__qualname__}"
    )


def leaf_values(trace: Trace, args: Sequence[object]) -> dict[str, object]:
    """Read every leaf the trace uses from concrete arguments (the slow, generic way)."""
    values: dict[str, object] = {}
    for variable, leaf in trace.leaves.items():
        arg = args[leaf.arg_index]
        if leaf.kind == "size":
            values[variable] = arg.shape[leaf.dim]
        elif leaf.kind == "stride":
            values[variable] = arg.stride()[leaf.dim]
        elif leaf.kind == "numel":
            values[variable] = arg.numel()
        else:
            values[variable] = arg
    return values


def _value(expr: object, values: dict[str, object]) -> object:
    return expr.evaluate(values) if isinstance(expr, Sym) else expr


class CallState:
    """One traced launcher for one key: generated ``run`` plus what replay's hook needs."""

    def __init__(
        self, owner: str, index: int, key: tuple, trace: Trace, backend: Backend, returns: tuple[int, ...] | int | None
    ):
        self.owner = owner
        self.key = key
        self.trace = trace
        self.backend = backend
        self.device = trace.device
        self.returns = returns
        self.param_names = trace.param_names
        self.check_globals: object = None  # set by the jit function once it has a drift snapshot
        self._tls = threading.local()
        self.name = f"{owner}__state{index}"
        self.namespace: dict[str, object] = dict(backend.hot_namespace)
        self.namespace.update(
            {
                "_ACTIVE": recorder.ACTIVE,
                "_recording": self.run_recording,
                "_tls": self._tls,
                "_new_buffers": self._new_buffers,
                "_stream_handle": stream_handle,
                "_StructError": struct.error,
                "_pack_failed": self._pack_failed,
                "_bad_config": self._bad_config,
                "_grow_shared": self._grow_shared,
                "_bf16": abi.float_to_bfloat16_bits,
            }
        )
        self._config_sources: dict[int, tuple[str, str, str]] = {}
        self._provenance = [self._static_provenance(launch) for launch in trace.launches]
        self._evaluators: dict[str, _Evaluator] = {}
        self.namespace["_current_hook"] = recorder.current
        self.namespace["_report"] = self._report
        self.source = self._generate()
        exec(compile(self.source, f"<jitcore call state {self.name}>", "exec"), self.namespace)
        self.run = self.namespace[self.name]
        self._run_recording = self.namespace[f"{self.name}__rec"]
        self.run.source = self.source
        self.run.call_state = self
        for launch in trace.launches:  # static shared memory over the default limit: opt in now
            if symbolic.is_static(launch.shared) and launch.shared > launch.function.dynamic_shared_limit:
                backend.set_dynamic_shared_limit(launch.function, launch.shared)

    # --- generation ----------------------------------------------------------------------
    def _generate(self) -> str:
        """Two functions: ``run`` (the hot path) and ``run__rec``, the same code that also
        reports each launch to this thread's recorder (used while any recorder is installed)."""
        return self._generate_one(recording=False) + "\n" + self._generate_one(recording=True)

    def _generate_one(self, *, recording: bool) -> str:
        trace = self.trace
        args = ", ".join(self.param_names)
        args_tuple = f"({args},)" if self.param_names else "()"
        if recording:
            lines = [
                f"def {self.name}__rec({args}{', ' if self.param_names else ''}stream, _original):",
                "    _hook = _current_hook()",
            ]
        else:
            lines = [
                f"def {self.name}({args}{', /' if self.param_names else ''}, stream=None):",
                f"    # call state of {self.owner} for key {self.key!r}",
                "    if _ACTIVE[0]:",
                f"        return _recording({args_tuple}, {args_tuple}, stream)",
            ]
        lines += [
            "    try:",
            "        _b = _tls.b",
            "    except AttributeError:",
            "        _b = _new_buffers()",
            "    if stream is None:",
            f"        stream = _current_stream({trace.device})",
            "    elif stream.__class__ is not int:",
            "        stream = _stream_handle(stream)",
            "    _so = _STREAMS.get(stream)",
            "    if _so is None:",
            "        _so = _stream_object(stream)",
            "    try:",
        ]
        body: list[str] = []
        body += self._leaf_reads()
        pointer_args = sorted({s.arg_index for launch in trace.launches for s in launch.sources if s.kind == "pointer"})
        for index in pointer_args:
            name = self.param_names[index]
            body.append(f"{name}_ptr = {name}.data_ptr()")
        for number, launch in enumerate(trace.launches):
            body += self._launch_lines(number, launch)
            if recording:
                grid, block, shared = self._config_sources[number]
                body.append(
                    f"if _hook is not None: _report(_hook, {number}, _b, {args_tuple}, _original, stream, "
                    f"{grid}, {block}, {shared})"
                )
        lines += ["        " + line for line in body] or ["        pass"]
        lines += [
            "    except _StructError as _e:",
            f"        _pack_failed(_e, {args_tuple})",
        ]
        if self.returns is not None:
            target = "_original" if recording else None
            lines.append(f"    return {self._return_source(target)}")
        return "\n".join(lines) + "\n"

    def _return_source(self, original: str | None = None) -> str:
        def name(i: int) -> str:
            return f"{original}[{i}]" if original else self.param_names[i]

        if isinstance(self.returns, int):
            return name(self.returns)
        return "(" + "".join(f"{name(i)}, " for i in self.returns) + ")"

    def _used_leaves(self) -> list:
        """Leaves some launch actually uses (tracing registers every dynamic size it sees)."""
        used: dict[str, None] = {}
        for launch in self.trace.launches:
            exprs = [*launch.grid, *launch.block, launch.shared]
            for source in launch.sources:
                exprs += [source.offset, source.value]
            for expr in exprs:
                if isinstance(expr, Sym):
                    for leaf in expr.leaves():
                        used.setdefault(leaf.args[0], None)
        return [self.trace.leaves[variable] for variable in used]

    def _leaf_reads(self) -> list[str]:
        lines = []
        by_arg: dict[int, list] = {}
        for leaf in self._used_leaves():
            by_arg.setdefault(leaf.arg_index, []).append(leaf)
        for index in sorted(by_arg):
            leaves = by_arg[index]
            name = self.param_names[index]
            sizes = [leaf for leaf in leaves if leaf.kind == "size"]
            strides = [leaf for leaf in leaves if leaf.kind == "stride"]
            if sizes:
                lines.append(f"{name}_shape = {name}.shape")
                lines += [f"{leaf.variable} = {name}_shape[{leaf.dim}]" for leaf in sizes]
            if strides:
                lines.append(f"{name}_strides = {name}.stride()")
                lines += [f"{leaf.variable} = {name}_strides[{leaf.dim}]" for leaf in strides]
            lines += [f"{leaf.variable} = {name}.numel()" for leaf in leaves if leaf.kind == "numel"]
        return lines

    def _launch_lines(self, number: int, launch: TraceLaunch) -> list[str]:
        lines: list[str] = []
        limits = self.trace.limits
        function = launch.function
        self.namespace[f"_f{number}"] = function.handle
        self.namespace[f"_fn{number}"] = function

        def local(expr: object, name: str) -> str:
            if symbolic.is_static(expr):
                return repr(expr)
            lines.append(f"{name} = {expr.source()}")
            return name

        grid = [local(g, f"_g{number}{'xyz'[i]}") for i, g in enumerate(launch.grid)]
        block = [local(b, f"_b{number}{'xyz'[i]}") for i, b in enumerate(launch.block)]
        shared = local(launch.shared, f"_s{number}")
        grid_t, block_t = f"({', '.join(grid)})", f"({', '.join(block)})"
        self._config_sources[number] = (grid_t, block_t, shared)
        for axis, expr in enumerate(launch.grid):
            if not symbolic.is_static(expr):
                lines.append(
                    f"if not 0 < {grid[axis]} <= {limits.max_grid[axis]}: _bad_config({number}, 'grid', {grid_t})"
                )
        if not all(symbolic.is_static(b) for b in launch.block):
            threads = min(limits.max_threads_per_block, function.max_threads_per_block or limits.max_threads_per_block)
            checks = " or ".join(f"not 0 < {block[axis]} <= {limits.max_block[axis]}" for axis in range(3))
            product = f"{block[0]} * {block[1]} * {block[2]}"
            lines.append(f"if {checks} or {product} > {threads}: _bad_config({number}, 'block', {block_t})")
        if not symbolic.is_static(launch.shared):
            available = limits.max_shared_per_block_optin - function.static_shared_bytes
            lines.append(f"if not 0 <= {shared} <= {available}: _bad_config({number}, 'shared', {shared})")
            lines.append(f"if {shared} > _fn{number}.dynamic_shared_limit: _grow_shared({number}, {shared})")
        layout = launch.kernel.layout
        dynamic = [i for i, s in enumerate(launch.sources) if s.kind != "constant"]
        for run_number, run in enumerate(layout.runs(dynamic)):
            offset, packer = layout.struct_for(run)
            packer_name = f"_pack{number}_{run_number}"
            self.namespace[packer_name] = packer.pack_into
            values = ", ".join(self._param_source(launch, i) for i in run)
            lines.append(f"{packer_name}(_b[{2 * number}], {offset}, {values})")
        lines += self.backend.launch_template.format(
            function=f"_f{number}",
            gx=grid[0],
            gy=grid[1],
            gz=grid[2],
            bx=block[0],
            by=block[1],
            bz=block[2],
            shared=shared,
            stream="_so",
            params=f"_b[{2 * number + 1}]",
            label=repr(launch.kernel.name_expression),
        ).splitlines()
        return lines

    def _param_source(self, launch: TraceLaunch, index: int) -> str:
        source = launch.sources[index]
        param = launch.kernel.param_types[index]
        if source.kind == "pointer":
            pointer = f"{self.param_names[source.arg_index]}_ptr"
            offset = source.offset * source.itemsize if source.itemsize else 0
            if symbolic.is_static(offset):
                return pointer if offset == 0 else f"{pointer} + {offset}"
            return f"{pointer} + {offset.source()}"
        text = symbolic.render(source.value)
        return f"_bf16({text})" if param.kind == "bfloat16" else text

    # --- buffers -------------------------------------------------------------------------
    def _new_buffers(self) -> tuple:
        """This thread's buffers, with every constant parameter written once."""
        flat: list[object] = []
        owners = []
        for launch in self.trace.launches:
            packed = PackedParams(launch.kernel.layout)
            for index, source in enumerate(launch.sources):
                if source.kind == "constant":
                    _pack_one(packed, launch, index, source.value)
            flat += [packed.buffer, packed.address]
            owners.append(packed)
        self._tls.owners = owners  # the void* arrays behind the addresses live as long as the thread's buffers
        buffers = self._tls.b = tuple(flat)
        return buffers

    # --- slow paths ----------------------------------------------------------------------
    def _evaluate(self, launch: TraceLaunch, values: dict[str, object]) -> list[object]:
        result = []
        for source in launch.sources:
            if source.kind == "pointer":
                arg = values["__args__"][source.arg_index]
                result.append(arg.data_ptr() + int(_value(source.offset, values)) * source.itemsize)
            else:
                result.append(_value(source.value, values))
        return result

    def _pack_failed(self, error: struct.error, args: tuple) -> None:
        values = leaf_values(self.trace, args)
        values["__args__"] = args
        for launch in self.trace.launches:
            for index, value in enumerate(self._evaluate(launch, values)):
                param = launch.kernel.param_types[index]
                try:
                    _pack_one(PackedParams(launch.kernel.layout), launch, index, value)
                except (struct.error, OverflowError, TypeError) as exc:
                    raise ArgumentError(
                        f"{self.owner}: argument {index} ({param.describe()}) of "
                        f"{launch.kernel.name_expression} gets {value!r}, which does not fit ({exc})"
                    ) from None
        raise ArgumentError(f"{self.owner}: a kernel argument does not fit its C type ({error})")

    def _bad_config(self, number: int, what: str, value: object) -> None:
        launch = self.trace.launches[number]
        raise LaunchConfigError(
            f"{self.owner}: {launch.kernel.name_expression} launched with {what} {value}, outside "
            "the device's limits (each grid and block dimension must be at least 1)"
        )

    def _grow_shared(self, number: int, nbytes: int) -> None:
        self.backend.set_dynamic_shared_limit(self.trace.launches[number].function, nbytes)

    def run_recording(self, args: tuple, original: tuple, stream: object = None) -> object:
        """The path taken while any recorder is installed: launches the same bytes as ``run``
        and reports each launch to this thread's recorder, if it has one. ``original`` are
        the arguments as the caller passed them (dynamic scalars included)."""
        return self._run_recording(*args, stream, original)

    def _static_provenance(self, launch: TraceLaunch) -> list[tuple]:
        """What each parameter's provenance is, computed once per launch of the trace (with
        the records and encoders that do not change from call to call)."""
        layout = launch.kernel.layout
        static = []
        for index, source in enumerate(launch.sources):
            param = launch.kernel.param_types[index]
            common = dict(index=index, name=param.name, offset=layout.offsets[index], size=param.size, fmt=param.fmt)
            leaves = self._leaves_of(source.value) if source.kind == "value" else []
            if source.kind == "pointer":
                static.append(("pointer", common, source.arg_index, param.const_pointee))
            elif any(leaf.kind == "scalar" for leaf in leaves):
                scalar_args = tuple(sorted({leaf.arg_index for leaf in leaves if leaf.kind == "scalar"}))
                static.append(("scalar", common, source.value, leaves, param, _Encoder(param), scalar_args))
            else:
                static.append(("constant", recorder.ParamRecord(kind="constant", **common)))
        return static

    def _report(self, hook, number, buffers, args, original, stream, grid, block, shared) -> None:
        launch = self.trace.launches[number]
        packed = bytes(buffers[2 * number])
        values = None
        params = []
        for item in self._provenance[number]:
            kind, common = item[0], item[1]
            if kind == "constant":
                params.append(common)  # the cached record itself
            elif kind == "pointer":
                _, _, arg_index, read_only = item
                (address,) = struct.unpack_from("<Q", packed, common["offset"])
                params.append(
                    recorder.ParamRecord(
                        kind="pointer",
                        arg_index=arg_index,
                        byte_offset=address - args[arg_index].data_ptr(),
                        read_only=read_only,
                        **common,
                    )
                )
            else:
                _, _, expr, leaves, param, encoder, scalar_args = item
                if values is None and any(leaf.kind != "scalar" for leaf in leaves):
                    values = leaf_values(self.trace, args)
                substitutions = {
                    leaf.variable: f"{{{leaf.arg_index}}}" if leaf.kind == "scalar" else repr(values[leaf.variable])
                    for leaf in leaves
                }
                expression = expr.render_with(substitutions)
                evaluator = self._evaluators.get(expression)
                if evaluator is None:
                    evaluator = self._evaluators[expression] = _Evaluator(expression, len(self.param_names))
                params.append(
                    recorder.ParamRecord(
                        kind="scalar",
                        scalar_args=scalar_args,
                        evaluate=evaluator,
                        encode=encoder,
                        expression=expression,
                        convert=abi.float_to_bfloat16_bits if param.kind == "bfloat16" else None,
                        **common,
                    )
                )
        hook.launch(
            recorder.LaunchRecord(
                jit_function=self.owner,
                kernel=launch.kernel.name_expression,
                function=launch.function.address,
                device=self.device,
                grid=grid,
                block=block,
                shared_bytes=shared,
                layout=launch.kernel.layout,
                param_bytes=packed[: launch.kernel.layout.size],
                params=tuple(params),
                args=tuple(original),
                stream=stream,
                check_globals=self.check_globals,
            )
        )

    def _leaves_of(self, expr: object) -> list:
        if not isinstance(expr, Sym):
            return []
        return [self.trace.leaves[leaf.args[0]] for leaf in expr.leaves()]


class _Evaluator:
    """Recompute a scalar parameter from new runtime-scalar values (sizes stay as recorded),
    through the expression compiled once into a lambda."""

    def __init__(self, expression: str, arg_count: int):
        source = expression.format(*[f"_s[{i}]" for i in range(arg_count)])
        self.source = source
        self._function = eval(
            builtins.compile(f"lambda _s: {source}", "<jitcore param evaluator>", "eval"),
            {"__builtins__": {"min": min, "max": max}},
        )

    def __call__(self, scalars: dict[int, object]) -> object:
        return self._function(scalars)


class _Encoder:
    """Turn a value into a parameter's bytes exactly as the call state packs it."""

    def __init__(self, param: abi.ParamType):
        self.param = param
        self.packer = struct.Struct("<" + param.fmt)

    def __call__(self, value: object) -> bytes:
        if self.param.kind == "bfloat16":
            value = abi.float_to_bfloat16_bits(float(value))
        return self.packer.pack(value)


def _pack_one(packed: PackedParams, launch: TraceLaunch, index: int, value: object) -> None:
    param = launch.kernel.param_types[index]
    if param.kind == "bfloat16":
        value = abi.float_to_bfloat16_bits(float(value))
    struct.pack_into("<" + param.fmt, packed.buffer, launch.kernel.layout.offsets[index], value)
