"""Call states: a traced launcher turned into straight-line Python (compiled, like every
generated function, through :mod:`jitcore.generated`).

A call state reads the data pointers and dynamic sizes it needs from the raw arguments, writes
them into persistent parameter buffers (one ``struct.pack_into`` per run of non-constant
parameters; constants are written once when a thread's buffers are made) and calls the vendor
launch directly, once per recorded kernel launch. Print one with ``JITCORE_DUMP=1`` or
``fn.dump()``; an example::

    def launch_axpy__state0(_a0, _a1, _a2, _a3, /, stream=None):
        # call state 0 of launch_axpy; arguments: _a0 = x, _a1 = y, _a2 = out, _a3 = alpha
        if _ACTIVE[0]:
            return _recording(_a0, _a1, _a2, _a3, stream, (_a0, _a1, _a2, _a3))
        ...
        _a0_numel = _a0.numel()
        _grid0x = (-(-_a0_numel // 256))
        if not 0 < _grid0x <= 2147483647: _check_grid(0, (_grid0x, 1, 1))
        _pack0_0(_b[0], 0, _a0_ptr, _a1_ptr, _a2_ptr, _a3, _a0_numel)
        if _grid0x:
            _r = _cuLaunchKernel(_f0, _grid0x, 1, 1, 256, 1, 1, 0, ...)

Where the backend has a launch that packs its own parameters (``Backend.packed_launcher``: the
CUDA backend's C helper, csrc/jitcore_native.c), the pack and the launch are one call,
the constants in its template, a tensor's pointer read by the launch (``P`` code), a refused
launch raised by it, and the call state keeps no buffers::

        _L0(_grid0x, 1, 1, 256, 1, 1, 0, stream, _a0, _a1, _a2, _a3, _a0_numel)

The recording variant (``__rec``) always packs into the thread's buffers, which the recorder
reads.

A call state of several launches computes and checks everything first (every launch's grid,
block and shared memory, the index checks, and every parameter packed with struct into the
thread's buffers, also where the backend has a packed launch), then launches: a value one
launch refuses raises before any launch ran, as docs/kernels.md promises.

Every generated function follows the rules of :mod:`jitcore.generated` (mangled names,
values through the namespace, sources registered with linecache, compiled once).

A grid with a dimension of 0 is a launch over no work: it is skipped (and reported to a
recorder with ``launched=False``). Each thread gets its own buffers, so concurrent hits never
share a half-written one.
"""

from __future__ import annotations

import functools
import struct
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from jitcore import recorder, symbolic
from jitcore.backends import abi
from jitcore.backends.abi import PackedParams
from jitcore.backends.base import Backend
from jitcore.errors import ArgumentError, LaunchConfigError
from jitcore.generated import Expression, comment, define, forget_source, python_name, source_filename
from jitcore.symbolic import Binder, Sym
from jitcore.tracing import ParamSource, Trace, TraceLaunch


def never(*args: object) -> bool:
    """A guard that matches no call: the placeholder in a dispatch slot that holds nothing
    (calling it costs what calling a guard costs, so the dispatch code needs no None test)."""
    return False


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


def leaf_values(trace: Trace, args: Sequence[Any]) -> dict[str, object]:
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


# What packing a parameter may raise: struct's range errors, its OverflowError for a float too
# large for ``f``/``e`` (and bfloat16's), and abi's checked conversions.
_PACK_ERRORS = (struct.error, OverflowError, abi.ScalarError)
CONFIG_FIELDS = recorder.CONFIG_FIELDS


def _unique_leaves(trace: Trace, expr: object) -> tuple:
    if not isinstance(expr, Sym):
        return ()
    found: dict[str, object] = {}
    for leaf in expr.leaves():
        found.setdefault(leaf.args[0], trace.leaves[leaf.args[0]])
    return tuple(found.values())


def _scalar_args(leaves: Sequence) -> tuple[int, ...]:
    return tuple(sorted({leaf.arg_index for leaf in leaves if leaf.kind == "scalar"}))


@attrs.frozen
class _PointerPlan:
    common: dict = attrs.field(hash=False)
    arg_index: int
    read_only: bool
    offset: object  # byte offset from the tensor's data pointer: int or Sym
    leaves: tuple
    scalar_args: tuple[int, ...]


@attrs.frozen
class _ScalarPlan:
    common: dict = attrs.field(hash=False)
    expr: object
    leaves: tuple
    param: abi.ParamType
    encoder: object
    scalar_args: tuple[int, ...]


@attrs.frozen
class _ConfigPlan:
    field: str
    expr: object
    leaves: tuple
    scalar_args: tuple[int, ...]


@attrs.frozen
class _LaunchPlan:
    """What a recorder is told about one launch, computed once per call state."""

    params: tuple  # ParamRecord (constants, reused as is), _PointerPlan or _ScalarPlan
    config: tuple[_ConfigPlan, ...]
    #: The sizes and strides (leaf variables) that runtime-dependent values also read: their
    #: evaluators fix them at the recorded values, so they key the records made from them.
    fixed: tuple[str, ...]


#: How many report parts (records for one launch at one set of fixed sizes) a call state keeps.
_REPORT_CACHE_SIZE = 256
_unpack_pointer = struct.Struct("<Q").unpack_from
#: How many pointer records (one per byte offset from the tensor's data pointer) a part keeps,
#: and how many whole params tuples (one per combination of its pointers' offsets).
_POINTER_RECORDS = 16


class StateRun(Protocol):
    """A call state's generated ``run`` function, which carries its state and its source (what
    the jit's cache holds and its dispatcher calls)."""

    call_state: CallState
    source: str

    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


class CallState:
    """One traced launcher for one key: generated ``run`` plus what replay's hook needs."""

    guard: Callable | None  # the jit's guard of this state, set when it is first promoted (jit._promote)

    def __init__(
        self, owner: str, index: int, key: tuple, trace: Trace, backend: Backend, returns: tuple[int, ...] | int | None
    ):
        self.owner = owner
        self.index = index
        self.key = key
        self.trace = trace
        self.backend = backend
        self.device = trace.device
        self.returns = returns
        self.param_names = trace.param_names
        # per launch, the record a packed launch copies for each launch it records (see
        # _record_template); None until the first report of it made one, or where none can be
        self._templates: list = [None] * len(trace.launches)
        self.check_globals = None  # set by the jit function once it has a drift snapshot
        self._tls = threading.local()
        self.name = f"{owner}__state{index}"
        self._ident = python_name(self.name)
        self.namespace: dict[str, object] = dict(backend.hot_namespace)
        self.namespace.update(
            {
                "_ACTIVE": recorder.ACTIVE,
                "_recording": None,  # this state's recording path, once defined
                "_tls": self._tls,
                "_new_buffers": self._new_buffers,
                "_stream_handle": stream_handle,
                "_PACK_ERRORS": _PACK_ERRORS,
                "_pack_failed": self._pack_failed,
                "_bad_config": self._bad_config,
                "_check_grid": self._check_grid,
                "_grow_shared": self._grow_shared,
                "_index_failed": self._index_failed,
                "_current_hook": recorder.current,
                "_report": self._report,
                "_R": self._templates,
            }
        )
        self._binder = Binder(self.namespace)
        self._config_sources: dict[int, tuple[str, str, str]] = {}
        self._provenance = [self._plan_provenance(launch) for launch in trace.launches]
        # per launch: whether its pointers' byte offsets were known when it was traced (a
        # record template serves every call only then)
        self._fixed_offsets = [
            all(not isinstance(p, _PointerPlan) or symbolic.is_static(p.offset) for p in plan.params)
            for plan in self._provenance
        ]
        self._evaluators: dict[tuple, tuple[_Evaluator, str]] = {}
        self._reports: dict[object, tuple] = {}  # launch number or (number, *fixed values) -> _report_parts
        self._check_plans = self._plan_checks()
        self._check_fixed = tuple(
            sorted({leaf.variable for plan in self._check_plans for leaf in plan[4] if leaf.kind != "scalar"})
        )
        # per launch number, what _report puts in every record of it: (jit_function, kernel,
        # function, device), the parameter layout, the sizes its cached parts depend on
        self._report_facts = [
            (
                (self.owner, launch.kernel.name_expression, launch.function.address, self.device),
                launch.kernel.layout,
                plan.fixed + self._check_fixed,
            )
            for launch, plan in zip(trace.launches, self._provenance)
        ]
        self._records_in_c = False  # set by _generate where every launch records itself
        self.source = self._generate()
        self.filename = source_filename(f"call state {self.name}")
        defined = define(self.source, self.filename, self.namespace)
        weakref.finalize(self, forget_source, self.filename)
        self.run = defined[self._ident]
        self._run_recording = defined[f"{self._ident}__rec"]
        # the state's own recording path, called straight from it (see _generate)
        self.namespace["_recording"] = self._run_recording
        self.run.source = self.source
        self.run.call_state = self
        for launch in trace.launches:  # static shared memory over the default limit: opt in now
            if symbolic.is_static(launch.shared) and launch.shared > launch.function.dynamic_shared_limit:
                backend.set_dynamic_shared_limit(launch.function, launch.shared)

    # --- generation ----------------------------------------------------------------------
    def _generate(self) -> str:
        """Two functions: ``run`` (the hot path) and ``run__rec``, the same code that also
        reports each launch to this thread's recorder (used while any recorder is installed).
        Both launch through the same packed launchers where the backend has them (the
        recording path through their ``reporting``, which returns the bytes it packed)."""
        # A packed launch packs and launches in one call, so in a call state of several launches
        # a later launch's refused value would come after the earlier launches ran: there,
        # every launch packs with struct into this thread's buffers first (no slower than
        # packed launches with a checking call of each before, and nothing half-launched).
        packed = None if len(self.trace.launches) > 1 else self._packed_launchers()
        self._records_in_c = packed is not None and _records_in_c(packed)
        return self._generate_one(packed, recording=False) + "\n" + self._generate_one(packed, recording=True)

    def _packed_launchers(self) -> list | None:
        """Each launch as the backend's launch that packs its own parameters
        (Backend.packed_launcher: the constants in its template, the changing parameters'
        struct formats, a tensor's pointer read by the launch itself where it reaches the
        kernel unchanged, the backend's error for a refused launch), or None where the backend
        has none for some launch: then every launch packs with struct into this thread's
        buffers."""
        launch_failed = self.namespace.get("_launch_failed")  # the backend's error for a status
        from jitcore import torch_native  # imported on use: `python -m jitcore.torch_native` runs it as __main__

        torch_native.module()  # where built, its reader serves the launches' 'P' codes
        launchers = []
        for launch in self.trace.launches:
            layout = launch.kernel.layout
            template = _with_constants(launch)
            dynamic = _changing(launch)
            runs = []
            for run in layout.runs(dynamic):
                at, packer = layout.struct_for(run)
                codes = iter("P" if _direct_pointer(launch.sources[i]) else None for i in run)
                fmt = "".join(c if c in "<x" else (next(codes) or c) for c in packer.format)
                runs.append((int(at), fmt))
            failed = launch_failed and functools.partial(launch_failed, label=launch.kernel.name_expression)
            launcher = self.backend.packed_launcher(
                self.backend.launch_function(launch.function),
                template.bytes(),
                tuple(layout.offsets),
                tuple(runs),
                failed,
            )
            if launcher is None:
                return None
            launchers.append(launcher)
        return launchers

    def _generate_one(self, packed: list | None, *, recording: bool) -> str:
        trace = self.trace
        args = [f"_a{i}" for i in range(len(self.param_names))]
        args_tuple = "(" + "".join(f"{a}, " for a in args) + ")"
        if recording:
            lines = [
                f"def {self._ident}__rec({', '.join([*args, 'stream', '_original'])}):",
                "    _hook = _current_hook()",
            ]
            if self._records_in_c:  # a recorder's list the packed launch appends its records to
                lines.append("    _sink = None if _hook is None else getattr(_hook, 'launch_sink', None)")
        else:
            mapping = ", ".join(f"{a} = {name}" for a, name in zip(args, self.param_names)) or "none"
            lines = [
                f"def {self._ident}({', '.join([*args, '/', 'stream=None'] if args else ['stream=None'])}):",
                f"    # {comment(f'call state {self.index} of {self.owner}; arguments: {mapping}')}",
                "    if _ACTIVE[0]:",
                f"        return _recording({''.join(f'{a}, ' for a in args)}stream, {args_tuple})",
            ]
        if packed is None:  # the parameter buffers of this thread (a packed launch has its own)
            lines += [
                "    try:",
                "        _b = _tls.b",
                "    except AttributeError:",
                "        _b = _new_buffers()",
            ]
        lines += [
            "    if stream is None:",
            f"        stream = _current_stream({int(trace.device)})",
            "    elif stream.__class__ is not int:",
            "        stream = _stream_handle(stream)",
        ]
        if packed is None and not self.backend.raw_stream_handles:  # the launch takes a vendor stream object
            lines += [
                "    _so = _STREAMS.get(stream)",
                "    if _so is None:",
                "        _so = _stream_object(stream)",
            ]
        lines += [
            "    try:",
        ]
        body: list[str] = []
        body += self._leaf_reads()
        body += self._index_checks(args_tuple)
        pointer_args = sorted(
            {
                s.arg_index
                for launch in trace.launches
                for s in launch.sources
                if s.kind == "pointer" and (packed is None or not _direct_pointer(s))  # else the launch reads it
            }
        )
        body += [f"_a{index}_ptr = _a{index}.data_ptr()" for index in pointer_args]
        # Two phases, so that a refused value on any launch raises before the first launch
        # (docs/kernels.md: errors, all raised before any GPU work): every launch's
        # configuration checked and parameters packed, then every launch made.
        checked: list[str] = []
        launching: list[str] = []
        for number, launch in enumerate(trace.launches):
            check, launch_lines = self._launch_lines(
                number, launch, recording, args_tuple, packed[number] if packed else None
            )
            checked += check
            launching += launch_lines
        if len(trace.launches) > 1:
            launching.insert(0, "# every launch checked and packed: launch them")
        body += checked + launching
        lines += ["        " + line for line in body] or ["        pass"]
        lines += [
            "    except _PACK_ERRORS as _e:",
            f"        _pack_failed(_e, {args_tuple})",
        ]
        if self.returns is not None:
            lines.append(f"    return {self._return_source('_original' if recording else None)}")
        return "\n".join(lines) + "\n"

    def _return_source(self, original: str | None = None) -> str:
        def name(i: int) -> str:
            return f"{original}[{i}]" if original else f"_a{i}"

        if isinstance(self.returns, int):
            return name(self.returns)
        return "(" + "".join(f"{name(i)}, " for i in self.returns) + ")"

    def _used_leaves(self) -> list:
        """Leaves some launch or index check actually uses (tracing registers every dynamic
        size it sees)."""
        used: dict[str, None] = {}
        exprs: list[object] = []
        for check in getattr(self.trace, "runtime_checks", ()):
            exprs += list(check.expressions())
        for launch in self.trace.launches:
            exprs += [*launch.grid, *launch.block, launch.shared]
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
            arg = f"_a{index}"
            sizes = [leaf for leaf in leaves if leaf.kind == "size"]
            strides = [leaf for leaf in leaves if leaf.kind == "stride"]
            if sizes:
                lines.append(f"{arg}_shape = {arg}.shape")
                lines += [f"{leaf.variable} = {arg}_shape[{int(leaf.dim)}]" for leaf in sizes]
            if strides:
                lines.append(f"{arg}_strides = {arg}.stride()")
                lines += [f"{leaf.variable} = {arg}_strides[{int(leaf.dim)}]" for leaf in strides]
            lines += [f"{leaf.variable} = {arg}.numel()" for leaf in leaves if leaf.kind == "numel"]
        return lines

    def _index_checks(self, args_tuple: str) -> list[str]:
        """Bounds checks of integer indexes only known at call time (torch's IndexError),
        before anything is packed or launched."""
        bind = self._binder.bind
        lines = []
        for number, check in enumerate(getattr(self.trace, "runtime_checks", ())):
            value, size = (symbolic.render(e, bind) for e in check.expressions())
            lines.append(f"if not -({size}) <= {value} < {size}: _index_failed({number}, {args_tuple})")
        return lines

    def _launch_lines(
        self, number: int, launch: TraceLaunch, recording: bool, args_tuple: str, packed: object = None
    ) -> tuple[list[str], list[str]]:
        """(check, launch): the lines that compute and check launch ``number`` without launching
        anything (its grid, block and shared memory computed and checked, its parameters packed
        into this thread's buffer, where it has one: a packed launch packs in its launch call),
        and the lines that launch it. The call state runs every launch's check lines before any
        launch's launch lines."""
        lines: list[str] = []
        limits = self.trace.limits
        function = launch.function
        bind = self._binder.bind
        self.namespace[f"_f{number}"] = self.backend.launch_function(function)
        self.namespace[f"_fn{number}"] = function

        def local(expr: Sym | int, name: str) -> str:
            if symbolic.is_static(expr):
                return symbolic.render(expr, bind)
            lines.append(f"{name} = {expr.source(bind)}")
            return name

        grid = [local(g, f"_grid{number}{'xyz'[i]}") for i, g in enumerate(launch.grid)]
        block = [local(b, f"_block{number}{'xyz'[i]}") for i, b in enumerate(launch.block)]
        shared = local(launch.shared, f"_shared{number}")
        grid_t, block_t = f"({', '.join(grid)})", f"({', '.join(block)})"
        self._config_sources[number] = (grid_t, block_t, shared)
        dynamic_axes = [axis for axis, g in enumerate(launch.grid) if not symbolic.is_static(g)]
        if dynamic_axes:
            inside = " and ".join(f"0 < {grid[axis]} <= {int(limits.max_grid[axis])}" for axis in dynamic_axes)
            lines.append(f"if not ({inside}): _check_grid({number}, {grid_t})")
        if not all(symbolic.is_static(b) for b in launch.block):
            threads = min(limits.max_threads_per_block, function.max_threads_per_block or limits.max_threads_per_block)
            checks = " or ".join(f"not 0 < {block[axis]} <= {int(limits.max_block[axis])}" for axis in range(3))
            product = f"{block[0]} * {block[1]} * {block[2]}"
            lines.append(f"if {checks} or {product} > {int(threads)}: _bad_config({number}, 'block', {block_t})")
        if not symbolic.is_static(launch.shared):
            available = limits.max_shared_per_block_optin - function.static_shared_bytes
            lines.append(f"if not 0 <= {shared} <= {int(available)}: _bad_config({number}, 'shared', {shared})")
        empty = any(symbolic.is_static(g) and g == 0 for g in launch.grid)  # a static grid of zero: never launched
        layout = launch.kernel.layout
        dynamic = _changing(launch)
        if packed is not None:
            launching = self._packed_launch_lines(number, launch, packed, dynamic, grid, block, shared, recording)
        else:
            for run_number, run in enumerate(layout.runs(dynamic)):
                offset, packer = layout.struct_for(run)
                packer_name = f"_pack{number}_{run_number}"
                self.namespace[packer_name] = packer.pack_into
                values = ", ".join(self._param_source(launch, i) for i in run)
                lines.append(f"{packer_name}(_b[{2 * number}], {int(offset)}, {values})")
            launching = self.backend.launch_template.format(
                function=f"_f{number}",
                gx=grid[0],
                gy=grid[1],
                gz=grid[2],
                bx=block[0],
                by=block[1],
                bz=block[2],
                shared=shared,
                stream="stream" if self.backend.raw_stream_handles else "_so",
                params=f"_b[{2 * number + 1}]",
                label=bind(launch.kernel.name_expression),
            ).splitlines()
        if not symbolic.is_static(launch.shared) and not empty:  # checked above: within the device's limits
            grow = f"{shared} > _fn{number}.dynamic_shared_limit"
            if dynamic_axes:  # an empty launch needs no shared memory
                grow = " and ".join([*(grid[axis] for axis in dynamic_axes), grow])
            lines.append(f"if {grow}: _grow_shared({number}, {shared})")
        if empty:
            launched = "False"  # nothing to launch, ever
        elif dynamic_axes:  # a dynamic grid of zero (an empty tensor): no launch
            launched = " and ".join(f"{grid[axis]} != 0" for axis in dynamic_axes)
        else:
            launched = "True"
        if packed is not None:  # it packs (refusing what struct refuses) and skips an empty grid itself
            packed_bytes = f"_p{number}"
        else:
            packed_bytes = f"_b[{2 * number}]"
            if empty:
                launching = []
            elif dynamic_axes:
                nonzero = " and ".join(grid[axis] for axis in dynamic_axes)
                launching = [f"if {nonzero}:", *("    " + x for x in launching)]
        if recording:  # (where the launch records itself, this is the path without a template)
            launching.append(
                ("    " if packed is not None and self._records_in_c else "")
                + f"if _hook is not None: _report(_hook, {number}, {packed_bytes}, {args_tuple}, _original, stream, "
                f"{grid_t}, {block_t}, {shared}, {launched})"
            )
        return lines, launching

    def _packed_launch_lines(
        self,
        number: int,
        launch: TraceLaunch,
        packed: object,
        dynamic: list[int],
        grid: list[str],
        block: list[str],
        shared: str,
        recording: bool,
    ) -> list[str]:
        """The launch through the backend's packed launcher: one call packs the changing
        parameters (exactly as struct would, refusing what struct refuses, also for an empty
        grid) and launches (nothing for a grid with a zero dimension). Only for a call state of
        one launch (see :meth:`_generate`). The recording path calls its ``reporting``, which
        returns the bytes it packed, as ``_p{number}``; or, where the recorder takes records
        made in C (its ``launch_sink``) and this launch has its record template, ``recorded``,
        which also makes the launch's record and hands it to the recorder."""
        self.namespace[f"_L{number}"] = packed
        values = "".join(
            f", _a{launch.sources[i].arg_index}"
            if _direct_pointer(launch.sources[i])
            else f", {self._param_source(launch, i)}"
            for i in dynamic
        )
        config = ", ".join([*grid, *block, shared])
        reporting = f"_p{number} = _L{number}.reporting({config}, stream{values})  # the bytes it packed"
        if recording and self._records_in_c:
            return [
                f"if _sink is not None and _R[{number}] is not None:",
                f"    _L{number}.recorded(_sink, _R[{number}], _original, {config}, stream{values})",
                "else:",
                f"    {reporting}",
            ]
        if recording:
            return [reporting]
        return [f"_L{number}({config}, stream{values})  # raises the backend's error if the launch fails"]

    def _param_source(self, launch: TraceLaunch, index: int) -> str:
        source = launch.sources[index]
        param = launch.kernel.param_types[index]
        bind = self._binder.bind
        if source.kind == "pointer":
            pointer = f"_a{source.arg_index}_ptr"
            offset = source.offset * source.itemsize if source.itemsize else 0
            if symbolic.is_static(offset) and offset == 0:
                return pointer
            return f"{pointer} + {symbolic.render(offset, bind)}"
        text = symbolic.render(source.value, bind)
        if self._packs_exactly(param, source.value):
            convert = abi.pack_conversion(param)
            return text if convert is None else f"{bind(convert)}({text})"
        # checked conversion: an integer for a floating parameter must convert exactly, a
        # numpy bool for an integer parameter is its int, ...
        return f"{bind(functools.partial(abi.scalar_value, param))}({text})"

    def _packs_exactly(self, param: abi.ParamType, value: object) -> bool:
        """Whether struct packing the raw value (after :func:`abi.pack_conversion`) is exactly
        :func:`abi.scalar_value` (so the hot path needs no checked conversion call): range
        errors are struct's to raise."""
        if not isinstance(value, Sym):
            return False
        import numpy as np

        types_ = {leaf.value_type for leaf in _unique_leaves(self.trace, value) if leaf.kind == "scalar"}
        if param.kind in ("int", "uint"):
            return not value.is_float and all(t is not None and issubclass(t, (int, np.integer)) for t in types_)
        if param.kind == "bool":
            return all(t in (bool, np.bool_) for t in types_) and bool(types_)
        return value.is_float  # floating parameters: a float rounds to nearest; an int must be exact

    # --- buffers -------------------------------------------------------------------------
    def _new_buffers(self) -> tuple:
        """This thread's buffers, with every constant parameter written once."""
        flat: list[object] = []
        owners = []
        for launch in self.trace.launches:
            packed = _with_constants(launch)
            flat += [packed.buffer, packed.address]
            owners.append(packed)
        self._tls.owners = owners  # the void* arrays behind the addresses live as long as the thread's buffers
        buffers = self._tls.b = tuple(flat)
        return buffers

    # --- slow paths ----------------------------------------------------------------------
    def _pack_failed(self, error: Exception, args: tuple) -> None:
        """A parameter did not pack: find which, and say so in the user's terms."""
        values = leaf_values(self.trace, args)
        for launch in self.trace.launches:
            for index, source in enumerate(launch.sources):
                param = launch.kernel.param_types[index]
                origin = ""
                try:
                    if source.kind == "pointer":
                        value = args[source.arg_index].data_ptr() + int(_value(source.offset, values)) * source.itemsize
                        struct.pack("<Q", value)
                        continue
                    value = _value(source.value, values)
                    if isinstance(source.value, Sym) and source.value.op == "leaf":
                        origin = f" (launcher argument {self.trace.leaves[source.value.args[0]].arg_name!r})"
                    struct.pack("<" + param.fmt, abi.scalar_value(param, value))
                except (*_PACK_ERRORS, TypeError) as exc:
                    raise ArgumentError(
                        f"{self.owner}: argument {index} ({param.describe()}) of "
                        f"{launch.kernel.name_expression} gets {value!r}{origin}, which does not fit ({exc})"
                    ) from None
        raise ArgumentError(f"{self.owner}: a kernel argument does not fit its C type ({error})") from error

    def _bad_config(self, number: int, what: str, value: object) -> None:
        launch = self.trace.launches[number]
        raise LaunchConfigError(
            f"{self.owner}: {launch.kernel.name_expression} launched with {what} {value}, outside "
            "the device's limits (grid dimensions must be 0 or more, 0 launching nothing; block "
            "dimensions at least 1)"
        )

    def _check_grid(self, number: int, grid: tuple) -> None:
        """A grid outside 1..max on some axis: fine (an empty launch, skipped) when every
        dimension is within 0..max, else a LaunchConfigError."""
        limits = self.trace.limits.max_grid
        if not all(isinstance(g, int) and 0 <= g <= limit for g, limit in zip(grid, limits)):
            self._bad_config(number, "grid", grid)

    def _grow_shared(self, number: int, nbytes: int) -> None:
        self.backend.set_dynamic_shared_limit(self.trace.launches[number].function, nbytes)

    def _index_failed(self, number: int, args: tuple) -> None:
        check = self.trace.runtime_checks[number]
        raise check.error(leaf_values(self.trace, args)) from None

    def run_recording(self, args: tuple, original: tuple, stream: object = None) -> object:
        """The path taken while any recorder is installed: launches the same bytes as ``run``
        and reports each launch to this thread's recorder, if it has one. ``original`` are
        the arguments as the caller passed them (dynamic scalars included)."""
        return self._run_recording(*args, stream, original)

    # --- the recorder hook ---------------------------------------------------------------
    def _plan_provenance(self, launch: TraceLaunch) -> _LaunchPlan:
        """Where each parameter and each launch dimension comes from, computed once per
        launch of the trace (with the records and encoders that do not change per call)."""
        layout = launch.kernel.layout
        params: list[object] = []
        for index, source in enumerate(launch.sources):
            param = launch.kernel.param_types[index]
            common = dict(index=index, name=param.name, offset=layout.offsets[index], size=param.size, fmt=param.fmt)
            if source.kind == "pointer":
                offset = source.offset * source.itemsize if source.itemsize else 0
                leaves = _unique_leaves(self.trace, offset)
                params.append(
                    _PointerPlan(common, source.arg_index, param.const_pointee, offset, leaves, _scalar_args(leaves))
                )
                continue
            leaves = _unique_leaves(self.trace, source.value) if source.kind == "value" else ()
            if _scalar_args(leaves):
                params.append(_ScalarPlan(common, source.value, leaves, param, _Encoder(param), _scalar_args(leaves)))
            else:
                params.append(recorder.ParamRecord(kind="constant", **common))
        config = []
        for field, expr in zip(CONFIG_FIELDS, (*launch.grid, *launch.block, launch.shared)):
            leaves = _unique_leaves(self.trace, expr)
            if _scalar_args(leaves):
                config.append(_ConfigPlan(field, expr, leaves, _scalar_args(leaves)))
        dependent = [p for p in params if isinstance(p, (_PointerPlan, _ScalarPlan)) and p.scalar_args] + config
        fixed = sorted({leaf.variable for item in dependent for leaf in item.leaves if leaf.kind != "scalar"})
        return _LaunchPlan(tuple(params), tuple(config), tuple(fixed))

    def _plan_checks(self) -> list[tuple]:
        """The index checks that depend on runtime scalars: (number, check, value leaves, size
        leaves, all their leaves, scalar arguments), computed once per call state."""
        plans = []
        for number, check in enumerate(getattr(self.trace, "runtime_checks", ())):
            value_leaves = _unique_leaves(self.trace, check.value)
            size_leaves = _unique_leaves(self.trace, check.size)
            scalar_args = _scalar_args(value_leaves + size_leaves)
            if scalar_args:
                plans.append((number, check, value_leaves, size_leaves, value_leaves + size_leaves, scalar_args))
        return plans

    def _evaluator(self, what: str, expr: object, leaves: tuple, values: dict | None) -> tuple[_Evaluator, str]:
        """(evaluate, expression) for ``expr`` with sizes and strides fixed at ``values``."""
        fixed = tuple((leaf.variable, values[leaf.variable]) for leaf in leaves if leaf.kind != "scalar")
        key = (id(expr), fixed)
        found = self._evaluators.get(key)
        if found is None:
            evaluator = _Evaluator(expr, leaves, dict(fixed), f"evaluator of {what} in {self.name}")
            shown = {leaf.variable: f"{{{leaf.arg_index}}}" for leaf in leaves if leaf.kind == "scalar"}
            shown.update({variable: repr(value) for variable, value in fixed})
            expression = expr.render_with(shown) if isinstance(expr, Sym) else repr(expr)
            found = self._evaluators[key] = (evaluator, expression)
        return found

    def _report(self, hook, number, packed, args, original, stream, grid, block, shared, launched=True) -> None:
        """Tell ``hook`` about launch ``number`` of this call (every launch of a recording
        comes through here unless it records itself, so it is on the first recording call's
        path: what does not change from call to call, every record but the pointers' byte
        offsets, is made once per set of fixed sizes and reused; records are frozen).
        ``packed``: the parameter bytes launched (a packed launcher's) or this thread's buffer
        holding them."""
        facts, layout, fixed = self._report_facts[number]
        if packed.__class__ is not bytes:
            packed = bytes(memoryview(packed)[: layout.size])
        values = leaf_values(self.trace, args) if fixed else None
        key = (number, *(values[v] for v in fixed)) if fixed else number
        parts = self._reports.get(key)
        if parts is None:
            if len(self._reports) >= _REPORT_CACHE_SIZE:
                self._reports.clear()
            parts = self._reports[key] = self._report_parts(number, values)
        params, pointers, config, checks, _by_offsets = parts
        if pointers:
            params = self._pointer_params(parts, packed, args)
        if self._records_in_c and not fixed and self._templates[number] is None and self._fixed_offsets[number]:
            self._templates[number] = self._record_template(number, params, config, checks)
        # the fields in LaunchRecord's order (a record is made per launch: no keywords, and
        # tuple.__new__ as LaunchRecord.with_args uses, without _make's classmethod call)
        hook.launch(
            tuple.__new__(
                recorder.LaunchRecord,
                (
                    *facts,  # jit_function, kernel, function, device
                    grid,
                    block,
                    shared,
                    layout,
                    packed,
                    params,
                    original,
                    stream,
                    self.check_globals,
                    bool(launched),
                    config,
                    checks,
                ),
            )
        )

    def _pointer_params(self, parts: tuple, packed: bytes, args: tuple) -> tuple:
        """The params tuple of a launch whose pointers sit at these byte offsets from their
        tensors' data pointers (one tuple per combination of offsets, shared by the launches
        that have it)."""
        params, pointers, _config, _checks, by_offsets = parts
        offsets = tuple(
            _unpack_pointer(packed, at)[0] - args[item.arg_index].data_ptr() for _, item, at, _, _ in pointers
        )
        made = by_offsets.get(offsets)
        if made is not None:
            return made
        made = list(params)
        for (position, item, _at, offset_evaluate, by_offset), byte_offset in zip(pointers, offsets):
            record = by_offset.get(byte_offset)
            if record is None:
                record = recorder.ParamRecord(
                    kind="pointer",
                    arg_index=item.arg_index,
                    byte_offset=byte_offset,
                    read_only=item.read_only,
                    offset_scalar_args=item.scalar_args,
                    offset_evaluate=offset_evaluate,
                    **item.common,
                )
                if len(by_offset) < _POINTER_RECORDS:
                    by_offset[byte_offset] = record
            made[position] = record
        made = tuple(made)
        if len(by_offsets) < _POINTER_RECORDS:
            by_offsets[offsets] = made
        return made

    def _record_template(self, number: int, params: tuple, config: tuple, checks: tuple) -> recorder.LaunchRecord:
        """The record of launch ``number`` with every field that does not change from call to
        call: what a packed launch copies, its call's fields written in (``recorded``). Only
        for a launch whose records depend on no size (no fixed leaves) and whose pointers sit
        at offsets known when it was traced, so that ``params`` serves every call."""
        facts, layout, _fixed = self._report_facts[number]
        call = None  # grid, block, shared bytes, parameter bytes, arguments, stream, launched: per call
        return tuple.__new__(
            recorder.LaunchRecord,
            (*facts, call, call, call, layout, call, params, call, call, self.check_globals, call, config, checks),
        )

    @property
    def check_globals(self) -> object:
        """The launcher's drift check, which every launch record carries."""
        return self._check_globals

    @check_globals.setter
    def check_globals(self, check: object) -> None:
        self._check_globals = check
        self._templates[:] = [None] * len(self._templates)  # they carry the old one

    def _report_parts(self, number: int, values: dict | None) -> tuple:
        """(params, pointers, config, checks, params by pointer offsets) of launch ``number``
        at these fixed sizes: ``params`` holds every record that does not depend on the call
        (None where a pointer's goes), ``pointers`` lists (position, plan, its offset in the
        parameter bytes, offset evaluator, records by byte offset) for those. The last maps
        the pointers' byte offsets to the whole params tuple, so that launches whose pointers
        sit at the same offsets (most: each at its tensor's start) share one tuple, from
        recording to recording (replay.recording caches its views of it by identity)."""
        label = self.trace.launches[number].kernel.name_expression
        plan = self._provenance[number]
        params: list[object] = []
        pointers = []
        for item in plan.params:
            if isinstance(item, recorder.ParamRecord):
                params.append(item)  # a constant: the cached record itself
            elif isinstance(item, _PointerPlan):
                offset_evaluate = None
                if item.scalar_args:
                    offset_evaluate = self._evaluator(
                        f"{label} pointer {item.common['index']}", item.offset, item.leaves, values
                    )[0]
                pointers.append((len(params), item, item.common["offset"], offset_evaluate, {}))
                params.append(None)
            else:
                evaluator, expression = self._evaluator(
                    f"{label} argument {item.common['index']}", item.expr, item.leaves, values
                )
                params.append(
                    recorder.ParamRecord(
                        kind="scalar",
                        scalar_args=item.scalar_args,
                        evaluate=evaluator,
                        encode=item.encoder,
                        expression=expression,
                        convert=abi.pack_conversion(item.param),
                        **item.common,
                    )
                )
        config = []
        for item in plan.config:
            evaluator, expression = self._evaluator(f"{label} {item.field}", item.expr, item.leaves, values)
            config.append(recorder.ConfigRecord(item.field, item.scalar_args, evaluator, expression))
        checks = []
        for check_number, check, value_leaves, size_leaves, _leaves, scalar_args in self._check_plans:
            value, shown = self._evaluator(f"index check {check_number}", check.value, value_leaves, values)
            size, _ = self._evaluator(f"index check {check_number} size", check.size, size_leaves, values)
            checks.append(recorder.CheckRecord(scalar_args, value, size, shown))
        return tuple(params), tuple(pointers), tuple(config), tuple(checks), {}


class _Evaluator:
    """Recompute a value from new runtime-scalar arguments, sizes and strides fixed as
    recorded: ``evaluate(scalars)``, where ``scalars[k]`` is the value of jit argument ``k``
    (a list, a tuple or a dict; only the indices the value depends on are read). Compiled
    once (an :class:`Expression` of ``_s``) with its constants bound in its namespace (see
    :class:`Binder`)."""

    def __init__(self, expr: object, leaves: tuple, fixed: dict[str, object], description: str):
        namespace: dict[str, object] = {"__builtins__": {"min": min, "max": max}}
        binder = Binder(namespace)
        substitutions = {}
        for leaf in leaves:
            if leaf.kind == "scalar":
                substitutions[leaf.variable] = f"_s[{int(leaf.arg_index)}]"
            else:
                substitutions[leaf.variable] = symbolic.render(fixed[leaf.variable], binder.bind)
        if isinstance(expr, Sym):
            body = expr.render_with(substitutions, bind=binder.bind)
        else:
            body = symbolic.render(expr, binder.bind)
        self._expression = Expression(body, ["_s"], namespace, description)
        self.source = self._expression.source
        self._function = self._expression.function

    def __call__(self, scalars: Sequence[object] | dict[int, object]) -> object:
        return self._function(scalars)


class _Encoder:
    """Turn a value into a parameter's bytes exactly as the call state packs it (checked:
    :class:`~jitcore.backends.abi.ScalarError` when the C type cannot hold it unchanged)."""

    def __init__(self, param: abi.ParamType):
        self.param = param

    def __call__(self, value: object) -> bytes:
        return abi.encode_scalar(self.param, value)


#: The fields of a LaunchRecord that a packed launch's ``recorded`` writes per call, in the
#: order the C helper takes them (csrc/jitcore_native.c, use_launch_record).
_CALL_FIELDS = ("grid", "block", "shared_bytes", "param_bytes", "args", "stream", "launched")
_TOLD_THE_HELPER: list[bool] = []


def _records_in_c(launchers: Sequence) -> bool:
    """Whether every packed launch can make its launch records itself (the C helper's
    ``PackedLaunch.recorded``), the helper told once which class those records are."""
    if not all(hasattr(launcher, "recorded") for launcher in launchers):
        return False
    if not _TOLD_THE_HELPER:
        # a packed launch with ``recorded`` is its PackedLaunch
        from jitcore.backends import _native  # type: ignore[attr-defined]  # a C extension, built by setup.py

        fields = recorder.LaunchRecord._fields
        _native.use_launch_record(recorder.LaunchRecord, tuple(fields.index(f) for f in _CALL_FIELDS))
        _TOLD_THE_HELPER.append(True)
    return True


def _changing(launch: TraceLaunch) -> list[int]:
    """The indices of a launch's parameters that are not constants, in order (packed each call)."""
    return [i for i, s in enumerate(launch.sources) if s.kind != "constant"]


def _with_constants(launch: TraceLaunch) -> PackedParams:
    """A launch's parameter buffer with every constant parameter written (once)."""
    packed = PackedParams(launch.kernel.layout)
    for index, source in enumerate(launch.sources):
        if source.kind == "constant":
            _pack_one(packed, launch, index, source.value)
    return packed


def _direct_pointer(source: ParamSource) -> bool:
    """Whether a parameter is a tensor argument's data pointer itself (no offset added): a
    packed launch reads it from the tensor (its ``P`` code)."""
    if source.kind != "pointer":
        return False
    offset = source.offset * source.itemsize if source.itemsize else 0
    return symbolic.is_static(offset) and offset == 0


def _pack_one(packed: PackedParams, launch: TraceLaunch, index: int, value: object) -> None:
    param = launch.kernel.param_types[index]
    # a constant pointer is the null pointer of a left-out optional tensor (tracing packs it as 0)
    packed_value = value if param.is_pointer else abi.scalar_value(param, value)
    struct.pack_into("<" + param.fmt, packed.buffer, launch.kernel.layout.offsets[index], packed_value)
