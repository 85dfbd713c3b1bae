"""The text of a recorded graph's replay function: generated per graph, in the order its lines run.

The function has two phases (replay.graph's docstring tells why): the checks and the values
computed from the call, changing nothing (the exactness checks are replay.graph_checks'), then
the patches of the nodes, the launch, the counters and the outputs (replay.graph_outputs').
Everything the function reads is a value of its namespace under a generated name, never a
user's name or a value's repr; the C step (replay.step_program) reads the same objects from
that namespace, so the two run one program.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Callable, Sequence

import attrs

from jitcore.for_replay import current_stream_reader
from replay import graph_checks, graph_outputs
from replay import host as host_inputs
from replay.source_text import Source
from replay.step_program import NodeValue, PointerWrite, ScalarWrite


class _Mismatch:
    """Returned by a replay function for a call its graph cannot serve exactly."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MISMATCH"


MISMATCH = _Mismatch()

#: What computing a call's values may raise where the eager call raises or computes otherwise:
#: the replay declines the call (MISMATCH).
ARITHMETIC_ERRORS = (struct.error, OverflowError, TypeError, ValueError, ArithmeticError)


class _Unknown:
    """A remembered value after an interrupted patch: equal to nothing, so it is pushed again."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


UNKNOWN = _Unknown()

#: A dynamic leaf's value in a generated expression.
DYNAMIC_NAME = re.compile(r"\b_d(\d+)\b")


@attrs.define
class PatchSlot:
    """One value a replay may write into a kernel node; ``_last[index]`` in the generated
    code is what the node holds now."""

    index: int
    value: str  # the expression of what this call needs the node to hold
    writes: list[str]  # the statements writing it into the node's buffer or dimensions
    step: NodeValue | None = None  # the same value as the C step writes it; None: it does not

    @property
    def changed(self) -> str:
        """The generated name of whether this call's value differs from the node's."""
        return f"_c{self.index}"


@attrs.define
class Patches:
    """What phase 1 of a replay computed for the nodes, and phase 2 may write into them."""

    slots: dict[int, list[PatchSlot]] = attrs.Factory(dict)  # node index -> its slots
    last: list[object] = attrs.Factory(list)  # per slot, what its node holds now: ``_last``
    zero_grids: dict[int, list[str]] = attrs.Factory(dict)  # node -> conditions of a grid of 0
    # node -> when a staging copy has nothing to do: the caller passed the staged buffer itself
    in_place: dict[int, list[str]] = attrs.Factory(dict)

    def add(self, node: int, value: str, writes: list[str], *, held: object, step: Callable | None = None) -> None:
        """A slot of ``node`` whose node holds ``held`` now (the recorded value); ``step``
        makes the C step's NodeValue from the slot's index in ``_last``."""
        index = len(self.last)
        self.slots.setdefault(node, []).append(PatchSlot(index, value, writes, step(index) if step else None))
        self.last.append(held)


@attrs.frozen
class GeneratedReplay:
    """A replay function's text and what the C step's program takes from its generation."""

    source: str
    patches: Patches
    check_names: tuple[str, ...]  # the launchers' globals checks, by their names in the namespace


class ReplaySource:
    """The generator of one graph's replay function (a RecordedGraph, or a polymorphic variant:
    whatever holds the attributes read here), writing into ``graph.namespace``."""

    def __init__(self, graph, backend, leaves: Sequence) -> None:
        self.graph = graph
        self.backend = backend
        self.leaves = leaves
        self.code = Source(graph.namespace)

    def generate(self) -> GeneratedReplay:
        """The replay function's source, step by step in the order its lines run."""
        graph, code, leaves = self.graph, self.code, self.leaves
        self._bind_runtime()
        check_names = graph_checks.emit_guards(code, graph, len(leaves))
        graph_checks.alias_checks(code, graph, leaves)
        graph_checks.same_argument_checks(code, graph)
        graph_checks.own_output_checks(code, graph, leaves)
        graph_checks.staged_storage_checks(code, graph)
        graph_checks.alignment_checks(code, graph)
        self._load_own_state()
        # --- phase 1: compute, change nothing ---
        self._read_dynamic_values()
        patches = self._compute_new_values()
        disabled = self._decide_which_nodes_change(patches)
        # --- phase 2: patch, remembering only what the driver took ---
        self._patch_nodes(patches, disabled)
        self._point_outputs_at_the_slot()
        self._fill_host_buffers()
        # --- launch ---
        self._launch()
        self._after_host_launch()
        self._mark_the_slot_written()
        self._count_replay()
        graph_outputs.return_outputs(code, graph)
        return GeneratedReplay(code.text(), patches, check_names)

    def _bind_runtime(self) -> None:
        """The objects every replay may use, under the names the C step reads them by
        (replay.step_program.NAMESPACE_FIELDS): bound whether or not this text uses them, so
        the namespace is the one place both take them from."""
        graph, ns = self.graph, self.code.namespace
        session = graph.session
        ns.update(
            _MISMATCH=MISMATCH,
            _ARITHMETIC_ERRORS=ARITHMETIC_ERRORS,
            _rollback=graph._interrupted,
            _set_failed=graph._set_failed,
            _current_stream=current_stream_reader(self.backend),
            _stream_switch=session.stream_switch,
            _LAST_STREAM=session.last_stream,
            _stats=session.counters,
            _me=graph,
        )
        if graph.output_slots is not None:
            ns["_retarget"], ns["_choose"] = graph._retarget, graph.output_slots.choose

    def _load_own_state(self) -> None:
        """In a polymorphic session the exec may be shared by several graphs (the graph of a
        bucket and its variants for smaller sizes, replay.polymorphic): when another one
        launched it last, its nodes are first put back to this graph's recorded state. A
        call declined after this only leaves the exec in a state of this graph."""
        if not self.graph.session.policy.polymorphic:
            return
        code = self.code
        code.line("_fam = _me.family")
        code.line("if _fam is not None and _fam.loaded is not _me:")
        code.line("_fam.load(_me)", 2)

    def _read_dynamic_values(self) -> None:
        """Read the value of each dynamic argument that a recomputed jit argument or a
        dynamic output uses (``_d{i}``), once per call."""
        sources = [s for text in self.graph.plan.arguments.values() for s in text if s]
        sources += graph_outputs.dynamic_sources(self.graph.outputs)
        for i in sorted({int(m) for source in sources for m in DYNAMIC_NAME.findall(source)}):
            self.code.line(f"_d{i} = l{i}.value")

    def _compute_new_values(self) -> Patches:
        """Phase 1: the jit arguments, index checks and every value the nodes may need, inside
        one ``try`` where anything is computed (an arithmetic error declines the call: the
        eager run raises the exact error, or computes)."""
        plan, code = self.graph.plan, self.code
        computes = bool(plan.arguments or plan.scalars or plan.configs)
        if computes:
            code.line("try:")
            self._recompute_arguments()
        patches = Patches()
        code.namespace["_last"] = patches.last
        code.namespace["_pack_Q"] = struct.Struct("<Q").pack_into
        self._compute_pointers(patches)
        self._skip_copies_in_place(patches)
        self._compute_scalars(patches)
        self._compute_grids(patches)
        if computes:
            code.line("except _ARITHMETIC_ERRORS:")
            code.line("return _MISMATCH", 2)
        return patches

    def _recompute_arguments(self) -> None:
        """Each launch's jit arguments that replay follows (``_a{launch}``), then the
        launcher's index checks over them: where eager would raise IndexError, decline."""
        plan, code = self.graph.plan, self.code
        for launch, sources in sorted(plan.arguments.items()):
            values = "".join(
                f"{code.with_constants(s, plan.constants) if s is not None else 'None'}, " for s in sources
            )
            code.line(f"_a{launch} = ({values})", 2)
        for check in plan.checks:
            value, size = code.bind(check.value, "_index"), code.bind(check.size, "_extent")
            code.line(f"_i = {value}(_a{check.launch})", 2)
            code.line(f"_n = {size}(_a{check.launch})", 2)
            code.line("if not -_n <= _i < _n:", 2)
            code.line("return _MISMATCH", 3)

    def _compute_pointers(self, patches: Patches) -> None:
        """New pointers: an input's pointer plus the recorded delta. A view offset computed
        from a dynamic scalar is recomputed and must stay inside its input; the fixed pointers
        into one input in one node share one remembered value, the input's pointer."""
        graph, code = self.graph, self.code
        recorded_pointer = {r.index: r.lo for r in graph.capture.inputs}
        static: dict[tuple[int, int], list] = {}
        for number, binding in enumerate(graph.plan.pointers):
            buffer = code.bind(graph.updaters[binding.node].params.buffer, "_buf")
            if not binding.dynamic:
                static.setdefault((binding.input, binding.node), []).append(binding)
                continue
            evaluate = code.bind(binding.offset_evaluate, "_offset")
            value = f"_q{number}"
            code.line(
                f"{value} = _p{binding.input} + {int(binding.delta - binding.recorded_offset)} + "
                f"{evaluate}(_a{binding.launch})",
                2,
            )
            code.line(f"if not _p{binding.input} <= {value} <= _p{binding.input} + _e{binding.input}:", 2)
            code.line("return _MISMATCH", 3)
            writes = [f"_pack_Q({buffer}, {binding.offset}, {value})"]
            patches.add(binding.node, value, writes, held=recorded_pointer[binding.input] + binding.delta)
        for (input_index, node), bound in sorted(static.items()):
            buffer = code.bind(graph.updaters[node].params.buffer, "_buf")
            step_writes = tuple([PointerWrite(int(b.offset), int(b.delta)) for b in bound])
            writes = [f"_pack_Q({buffer}, {w.offset}, _p{input_index} + {w.delta})" for w in step_writes]
            patches.add(
                node,
                f"_p{input_index}",
                writes,
                held=recorded_pointer[input_index],
                step=lambda last, i=input_index, w=step_writes: NodeValue(last, i, None, w),
            )

    def _skip_copies_in_place(self, patches: Patches) -> None:
        """A staged input passed as its staged buffer (``_S{i}``) needs no copy in or back:
        those nodes are disabled for the call (see RecordedGraph._inputs_taken_in_place)."""
        for i, (buffer, nodes) in sorted(self.graph.in_place.items()):
            self.code.namespace[f"_S{i}"] = buffer.data_ptr()
            for node in nodes:
                patches.in_place.setdefault(node, []).append(f"_p{i} == _S{i}")

    def _compute_scalars(self, patches: Patches) -> None:
        """Scalar parameters computed from dynamic scalars, packed to their exact bytes (a
        value that does not fit its C type raises, and the call is declined)."""
        graph, code = self.graph, self.code
        for number, binding in enumerate(graph.plan.scalars):
            state = graph.node_states[binding.node]
            size = struct.calcsize("<" + binding.fmt)
            packer = code.bind(struct.Struct("<" + binding.fmt).pack, "_packer")
            evaluate = code.bind(binding.evaluate, "_value")
            computed = f"{evaluate}(_a{binding.launch})"
            if binding.convert is not None:
                computed = f"{code.bind(binding.convert, '_convert')}({computed})"
            code.line(f"_v{number} = {packer}({computed})", 2)
            buffer = code.bind(graph.updaters[binding.node].params.buffer, "_buf")
            write = ScalarWrite(int(binding.offset), size)
            patches.add(
                binding.node,
                f"_v{number}",
                [f"{buffer}[{write.offset}:{write.offset + write.size}] = _v{number}"],
                held=state.held[write.offset : write.offset + write.size],
                step=lambda last, n=number, w=write: NodeValue(last, None, n, (w,)),
            )

    def _compute_grids(self, patches: Patches) -> None:
        """Grid sizes computed from dynamic scalars: declined beyond the device's limits; a
        grid of 0 means the node must not run at all."""
        graph, code = self.graph, self.code
        limits = self.backend.device_limits(graph.device) if graph.plan.configs else None
        for number, binding in enumerate(graph.plan.configs):
            evaluate = code.bind(binding.evaluate, "_size")
            axis = "xyz".index(binding.field[-1])
            code.line(f"_g{number} = {evaluate}(_a{binding.launch})", 2)
            code.line(f"if not 0 <= _g{number} <= {int(limits.max_grid[axis])}:", 2)
            code.line("return _MISMATCH", 3)
            updater = graph.updaters[binding.node]
            dimension = code.bind(updater.set_dimension, "_dimension")
            field = code.bind(binding.field, "_field")
            patches.add(
                binding.node,
                f"_g{number}",
                [f"{dimension}({field}, _g{number})"],
                held=updater.dimensions()[updater.DIMENSIONS.index(binding.field)],
            )
            patches.zero_grids.setdefault(binding.node, []).append(f"_g{number} == 0")

    def _decide_which_nodes_change(self, patches: Patches) -> dict[int, bool | None]:
        """Still changing nothing: which nodes are disabled (a grid of 0; where the backend
        cannot disable a node, the call is declined), which values differ from what their
        node holds (``_c``), and which nodes must be updated (``_u``). Returns the nodes that
        can be disabled, with what each is now (the generated code's ``_disabled``)."""
        code = self.code
        code.namespace["_disabled"] = disabled = {}
        for node in {**patches.zero_grids, **patches.in_place}:
            zero, in_place = patches.zero_grids.get(node, []), patches.in_place.get(node, [])
            if self.graph.updaters[node].enable_call is None:  # (never for copies skipped in place)
                code.line(f"if {' or '.join(zero)}:")  # cannot disable the node: run eagerly
                code.line("return _MISMATCH", 2)
            else:
                # a grid of 0, or a staging copy with nothing to do: disable the node
                code.line(f"_z{node} = {' or '.join(zero + in_place)}")
                disabled[node] = False
        for node, slots in patches.slots.items():
            for slot in slots:
                code.line(f"{slot.changed} = {slot.value} != _last[{slot.index}]")
            dirty = " or ".join(slot.changed for slot in slots)
            code.line(f"_u{node} = {f'not _z{node} and ' if node in disabled else ''}({dirty})")
        return disabled

    def _patch_nodes(self, patches: Patches, disabled: dict[int, bool | None]) -> None:
        """Phase 2: write each changed value and push each dirty node to the exec, then
        enable or disable the nodes whose grid became or stopped being 0. What a node holds
        is remembered only once the driver took it; any exception rolls every buffer back."""
        if not (patches.slots or disabled):
            return
        code = self.code
        any_change = " or ".join([f"_u{n}" for n in patches.slots] + [f"_z{n} is not _disabled[{n}]" for n in disabled])
        code.line(f"if {any_change}:")
        code.line("try:", 2)
        for node, slots in patches.slots.items():
            updater = self.graph.updaters[node]
            set_call, set_args = code.bind(updater.set_call, "_set"), code.bind(updater.set_args, "_set_args")
            code.line(f"if _u{node}:", 3)
            for slot in slots:
                code.line(f"if {slot.changed}:", 4)
                for write in slot.writes:
                    code.line(write, 5)
            code.line(f"_r = {set_call}(*{set_args})", 4)
            code.line(f"if _r[0]: _set_failed(_r[0], {node})", 4)
            for slot in slots:
                code.line(f"if {slot.changed}: _last[{slot.index}] = {slot.value}", 4)
            code.line("_stats.patches += 1", 4)
        for node in disabled:
            updater = self.graph.updaters[node]
            enable, args = code.bind(updater.enable_call, "_enable"), code.bind(updater.enable_args, "_enable_args")
            code.line(f"if _z{node} is not _disabled[{node}]:", 3)
            code.line(f"_r = {enable}(*{args}, 0 if _z{node} else 1)", 4)
            code.line(f"if _r[0]: _set_failed(_r[0], {node})", 4)
            code.line(f"_disabled[{node}] = _z{node}", 4)
        code.line("except BaseException:", 2)
        code.line("_rollback()", 3)
        code.line("raise", 3)

    def _point_outputs_at_the_slot(self) -> None:
        """Phase 2, last: when the chosen slot is not the one the output copies write, point
        them at it (a node update per copy; nothing declines the call after this)."""
        if self.graph.output_slots is not None:
            self.code.line("if _o is not _me.bound_slot:")
            self.code.line("_retarget(_o)", 2)

    def _fill_host_buffers(self) -> None:
        """Host inputs (replay.host): wait until the last launch of this graph is done with
        their pinned buffers, then copy each caller's tensor into its buffer (a memmove over
        the byte extent, the layouts being equal; torch's strided copy for sparse layouts).
        Last before the launch: nothing after it declines the call."""
        host, code = self.graph.host, self.code
        if host is None:
            return
        code.line(f"{code.bind(host.wait, '_host_wait')}()")
        for i in sorted(host.buffers):
            kind, target, extent = host.copier(i)
            if kind == "memmove":
                code.namespace["_memmove"] = host_inputs._memmove
                code.line(f"_memmove({int(target)}, _p{i}, {int(extent)})")
            elif kind == "copy":
                code.line(f"{code.bind(target, '_host_copy')}(l{i})")

    def _launch(self) -> None:
        """Launch the graph once on the current stream (telling the session when the stream
        changed), once the streams callers read its output memory on (``record_stream``) have
        done what was enqueued on them."""
        graph, backend, code = self.graph, self.backend, self.code
        code.line(f"_s = _current_stream({int(graph.device)})")
        code.line("if _s != _LAST_STREAM[0]:")
        code.line("_stream_switch(_s)", 2)
        readers = readers_holder(graph)
        if readers is not None:
            code.line(f"if {readers}.readers:")
            code.line(f"{readers}.wait_for_readers(_s)", 2)
        if graph.uses_rng:
            # torch's replay advances the captured generators' offsets before launching, so
            # each replay draws fresh numbers exactly as the eager sequence would
            code.namespace["_torch_replay"] = graph.graph.replay
            code.line("_torch_replay()")
            return
        code.namespace["_EXEC"] = backend.graph_exec_object(graph.graph.raw_cuda_graph_exec())
        if not backend.raw_stream_handles:  # the launch takes a vendor stream object
            code.line("_so = _STREAMS.get(_s)")
            code.line("if _so is None:")
            code.line("_so = _stream_object(_s)", 2)
        stream = "_s" if backend.raw_stream_handles else "_so"
        for line in backend.graph_launch_template.format(exec="_EXEC", stream=stream).splitlines():
            code.line(line)

    def _after_host_launch(self) -> None:
        """Host inputs: the launch just enqueued reads their buffers until it is done."""
        host = self.graph.host
        if host is not None:
            self.code.line(f"{self.code.bind(host.launched_on, '_host_launched')}(_s, {int(self.graph.device)})")

    def _mark_the_slot_written(self) -> None:
        """The slot now holds this graph's outputs; freed later, it waits for this stream. The
        graph keeps the stream where its release must tell the allocator of it (:func:`notes_stream`)."""
        if notes_stream(self.graph):
            self.code.line("_me.stream = _s")
        if self.graph.output_slots is not None:
            self.code.line("_o.writer = _me")
            self.code.line("_me.slot = _o")
            self.code.line("if _s not in _o.streams:")
            self.code.line("_o.written_from(_s)", 2)

    def _count_replay(self) -> None:
        """Count the replay: the entry's generation (which outputs handed out remember, in
        ``check_stale`` mode), its replays and the session's counters."""
        graph, code = self.graph, self.code
        if graph.session.policy.check_stale:
            code.namespace["_owner"] = graph.entry
            code.line("_owner.generation += 1")
        code.line("_me.replays += 1")
        code.line("_stats.replays += 1")
        copies = staged_copies(graph)
        skipped = [f"_z{node}" for _buffer, nodes in graph.in_place.values() for node in nodes]
        if skipped:  # copies skipped in place are not made
            code.line(f"_stats.staged_copies += {copies} - ({' + '.join(skipped)})")
        elif copies:
            code.line(f"_stats.staged_copies += {copies}")


def readers_holder(graph) -> str | None:
    """The generated name of what notes the streams callers read the memory a replay writes on
    (replay.output_slots): the slot chosen, the graph itself for its own output buffers, None
    where a replay writes no output memory."""
    if graph.output_slots is not None:
        return "_o"
    return "_me" if getattr(graph, "own_lanes", ()) else None


def notes_stream(graph) -> bool:
    """Whether a replay keeps its stream (``graph.stream``): where the graph holds memory its
    replays use that goes with it (staged buffers, output buffers of its own)."""
    return bool(graph.staged or getattr(graph, "own_lanes", ()))


def staged_copies(graph) -> int:
    """The staging copies every replay of ``graph`` makes (copies skipped in place aside)."""
    return len(graph.staged) + len(graph.copied_back) + (len(graph.host.buffers) if graph.host else 0)
