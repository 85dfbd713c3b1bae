"""A recorded graph and its generated replay function.

Replaying is straight-line Python generated per graph (print it with ``REPLAY_DUMP=1`` or
``Session.dump()``): read the data pointer of each rebound input, and when it differs from
the last replay write ``pointer + delta`` into every kernel-node parameter bound to it;
recompute parameters that depend on dynamic scalars and write those that changed; push each
dirty node to the graph exec with the driver's node update; launch the graph once on the
current stream; return the outputs in the region's structure. Nothing else runs per call.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Sequence

import torch

from jitcore.backends import get_backend
from replay import keys
from replay.dynamic import DynamicScalar
from replay.errors import ReplayMismatchError, StaleOutputError
from replay.recording import Capture, CaptureFailed


def dump_enabled() -> bool:
    return os.environ.get("REPLAY_DUMP", "").strip() not in ("", "0")


def guard_outputs(value: object, owner) -> object:
    """Hand out tensors that raise once ``owner`` (an entry) has been replayed again."""
    spec, leaves, _ = keys.flatten((value,), {})
    wrapped = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            leaf = leaf.as_subclass(StaleGuardTensor)
            leaf._replay_owner = owner
            leaf._replay_generation = owner.generation
        wrapped.append(leaf)
    return keys.unflatten(spec, wrapped)[0][0]


class StaleGuardTensor(torch.Tensor):
    """An output handed out in ``check_stale`` mode: any use after the graph that produced it
    has been replayed again raises :class:`StaleOutputError` instead of reading new data."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, StaleGuardTensor):
                owner = getattr(value, "_replay_owner", None)
                if owner is not None and owner.generation != value._replay_generation:
                    raise StaleOutputError(
                        f"this output of region {owner.region.name} was overwritten by a later replay "
                        f"(replay {owner.generation}, output of replay {value._replay_generation}); copy "
                        "outputs you keep (tensor.clone()) or use capture(clone_outputs=True)"
                    )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _bitwise_equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))
    return a == b


def storage_clone(tensor: torch.Tensor) -> torch.Tensor:
    """An independent copy with the very same layout (strides, offset, overlaps)."""
    storage = tensor.untyped_storage().clone()
    copy = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    copy.set_(storage, tensor.storage_offset(), tensor.shape, tensor.stride())
    return copy


class RecordedGraph:
    """One key's graph: its exec, node updaters, outputs and the generated replay."""

    def __init__(
        self,
        region,
        key: tuple,
        capture: Capture,
        spec: object,
        leaves: Sequence,
        paths: Sequence[str],
        session,
        number: int,
    ):
        backend = get_backend()
        self.region = region
        self.region_name = region.name
        self.entry = region.entries[key]
        self.key = key
        self.capture = capture
        self.graph = capture.graph
        self.device = capture.device
        self.plan = capture.plan
        self.staged = capture.staged
        self.copied_back = capture.copied_back
        self.paths = list(paths)
        self.spec = spec
        # what the leaves looked like, to record this key again without the caller's tensors
        self.template = [
            ("tensor", tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype)
            if isinstance(leaf, torch.Tensor)
            else ("leaf", leaf)
            for leaf in leaves
        ]
        self.input_bytes = sum(keys.extent_bytes(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor))
        self.session = session
        self.generation = 0
        self.replays = 0
        self.memory = capture.memory
        self.name = re.sub(r"\W", "_", f"replay_{region.name}_{number}")
        raw_exec = self.graph.raw_cuda_graph_exec()
        nodes = {n.index: n for n in capture.nodes}
        self.updaters = {}
        for binding in (*self.plan.pointers, *self.plan.scalars):
            if binding.node not in self.updaters:
                record = capture.records[binding.launch]
                self.updaters[binding.node] = backend.node_updater(
                    raw_exec, nodes[binding.node], record.layout, record.param_bytes
                )
        self.checks = []
        for record in capture.records:
            if record.check_globals is not None and record.check_globals not in self.checks:
                self.checks.append(record.check_globals)
        self.output_spec, output_leaves, _ = keys.flatten((capture.outputs,), {})
        self.outputs = self._classify_outputs(output_leaves)
        self.namespace: dict[str, object] = dict(backend.hot_namespace)
        self.source = self._generate(backend, leaves)
        code = compile(self.source, f"<replay graph {self.name}>", "exec")
        exec(code, self.namespace)
        self.replay = self.namespace[self.name]
        if dump_enabled():
            print(f"# replay graph\n{self.source}")

    # --- outputs -------------------------------------------------------------------------
    def _classify_outputs(self, output_leaves: list) -> list[tuple]:
        """Each output leaf: ("tensor", t) the graph's own buffer; ("alias", leaf, size,
        stride, delta) a view of an input, rebuilt on the new input; ("const", v);
        ("dynamic", source). Addresses are the capture's: the graph holds those."""
        classified = []
        for value in output_leaves:
            if isinstance(value, DynamicScalar):
                classified.append(("dynamic", value.source))
                continue
            if not isinstance(value, torch.Tensor):
                classified.append(("const", value))
                continue
            address, owner, base = value.data_ptr(), None, 0
            for input_range in self.capture.inputs:
                i = input_range.index
                if i in self.staged and i not in self.copied_back:
                    continue  # a view of a read-only staged buffer: the graph's own memory
                lo = self.staged[i].data_ptr() if i in self.staged else input_range.lo
                if value.numel() and lo <= address < lo + max(input_range.hi - input_range.lo, 1):
                    owner, base = i, lo
                    break
            if owner is None:
                classified.append(("tensor", value))
                continue
            if value.dtype != self.capture.input_dtypes[owner]:
                raise CaptureFailed(f"an output is a view of input {self.paths[owner]} with another dtype")
            delta, remainder = divmod(address - base, value.element_size())
            if remainder:
                raise CaptureFailed(f"an output is a misaligned view of input {self.paths[owner]}")
            classified.append(("alias", owner, tuple(value.shape), tuple(value.stride()), delta))
        return classified

    def build_outputs(self, leaves: Sequence, clone: bool, guard: bool) -> object:
        values = []
        dynamic_values = {f"_d{i}": getattr(leaf, "value", None) for i, leaf in enumerate(leaves)}
        for item in self.outputs:
            kind = item[0]
            if kind == "tensor":
                value = item[1]
                if clone:
                    value = value.clone()
                elif guard:
                    value = value.as_subclass(StaleGuardTensor)
                    value._replay_owner = self.entry
                    value._replay_generation = self.entry.generation
            elif kind == "alias":
                _, owner, size, stride, delta = item
                source = leaves[owner]
                value = torch.as_strided(source, size, stride, source.storage_offset() + delta)
            elif kind == "dynamic":
                value = eval(item[1], {"__builtins__": {}}, dynamic_values)
            else:
                value = item[1]
            values.append(value)
        args, _ = keys.unflatten(self.output_spec, values)
        return args[0]

    # --- generation ----------------------------------------------------------------------
    def _generate(self, backend, leaves: Sequence) -> str:
        ns = self.namespace
        count = len(leaves)
        params = ", ".join(f"l{i}" for i in range(count))
        lines = [f"def {self.name}({params}):", f"    # graph for {self.region_name}, key {self.key!r}"[:300]]
        for number, check in enumerate(self.checks):
            ns[f"_check{number}"] = check
            lines.append(f"    _check{number}()")
        for node in self.updaters:
            lines.append(f"    _dirty{node} = False")
        ns["_last"] = last = []
        ns["_pack"] = {}
        by_input: dict[int, list] = {}
        for binding in self.plan.pointers:
            by_input.setdefault(binding.input, []).append(binding)
        extents = {i: keys.extent_bytes(leaf) for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)}
        recorded_pointer = {r.index: r.lo for r in self.capture.inputs}
        for input_index, bindings in sorted(by_input.items()):
            slot = len(last)
            last.append(recorded_pointer[input_index])  # what the graph's nodes hold now
            lines.append(f"    _p = l{input_index}.data_ptr()")
            lines.append(f"    if _p != _last[{slot}]:")
            lines.append(f"        _last[{slot}] = _p")
            for binding in bindings:
                ns[f"_buf{binding.node}"] = self.updaters[binding.node].params.buffer
                lines.append(f"        _pack_Q(_buf{binding.node}, {binding.offset}, _p + {binding.delta})")
            for node in sorted({b.node for b in bindings}):
                lines.append(f"        _dirty{node} = True")
        ns["_pack_Q"] = struct.Struct("<Q").pack_into
        used = {int(m) for s in self.plan.scalars for m in re.findall(r"\b_d(\d+)\b", s.source)}
        for i in sorted(used):
            lines.append(f"    _d{i} = l{i}.value")
        recorded = {f"_d{i}": v for i, v in self.capture.dynamic_values.items()}
        for number, binding in enumerate(self.plan.scalars):
            slot = len(last)
            last.append(eval(binding.source, {"__builtins__": {"min": min, "max": max}}, recorded))
            packer = f"_pack_s{number}"
            ns[packer] = struct.Struct("<" + binding.fmt).pack_into
            ns[f"_buf{binding.node}"] = self.updaters[binding.node].params.buffer
            converted = f"_conv{number}(_v)" if binding.convert is not None else "_v"
            if binding.convert is not None:
                ns[f"_conv{number}"] = binding.convert
            lines.append(f"    _v = {binding.source}")
            lines.append(f"    if _v != _last[{slot}]:")
            lines.append(f"        _last[{slot}] = _v")
            lines.append(f"        {packer}(_buf{binding.node}, {binding.offset}, {converted})")
            lines.append(f"        _dirty{binding.node} = True")
        for i in sorted(self.copied_back):
            others = [j for j in extents if j != i]
            for j in others:
                lines.append(
                    f"    if l{i}.data_ptr() < l{j}.data_ptr() + {max(extents[j], 1)} and "
                    f"l{j}.data_ptr() < l{i}.data_ptr() + {max(extents[i], 1)}:"
                )
                lines.append(f"        return _eager(({params}{',' if count == 1 else ''}))")
        ns["_eager"] = self.session_eager
        if self.updaters:
            ns["_SET"] = next(iter(self.updaters.values())).set_call
            ns["_set_failed"] = self._set_failed
        for node, updater in self.updaters.items():
            ns[f"_args{node}"] = updater.set_args
            lines.append(f"    if _dirty{node}:")
            lines.append(f"        _r = _SET(*_args{node})")
            lines.append(f"        if _r[0]: _set_failed(_r[0], {node})")
        ns["_current_stream"] = backend.hot_namespace["_current_stream"]
        ns["_stream_switch"] = self.session.stream_switch
        ns["_LAST_STREAM"] = self.session.last_stream
        ns["_EXEC"] = backend.graph_exec_object(self.graph.raw_cuda_graph_exec())
        lines += [
            f"    _s = _current_stream({self.device})",
            "    if _s != _LAST_STREAM[0]:",
            "        _stream_switch(_s)",
            "    _so = _STREAMS.get(_s)",
            "    if _so is None:",
            "        _so = _stream_object(_s)",
        ]
        lines += [
            "    " + line for line in backend.graph_launch_template.format(exec="_EXEC", stream="_so").splitlines()
        ]
        ns["_stats"] = self.session.stats_record
        ns["_entry"] = self
        dirty = " + ".join(f"_dirty{node}" for node in self.updaters)
        staged_copies = len(self.staged) + len(self.copied_back)
        policy = self.session.policy
        if policy.check_stale:
            ns["_owner"] = self.entry
            lines.append("    _owner.generation += 1")
        lines += ["    _entry.replays += 1", "    _stats.replays += 1"]
        if dirty:
            lines.append(f"    _stats.patches += {dirty}")
        if staged_copies:
            lines.append(f"    _stats.staged_copies += {staged_copies}")
        simple = all(item[0] in ("tensor", "const") for item in self.outputs)
        if simple and not policy.clone_outputs and not policy.check_stale:
            ns["_OUT"] = self.build_outputs(leaves, clone=False, guard=False)
            lines.append("    return _OUT")
        else:
            ns["_build_outputs"] = self.build_outputs
            lines.append(
                f"    return _build_outputs(({params}{',' if count == 1 else ''}), {policy.clone_outputs}, "
                f"{policy.check_stale})"
            )
        return "\n".join(lines) + "\n"

    def session_eager(self, leaves: tuple) -> object:
        """A call this graph cannot serve (its inputs alias in a way the capture did not)."""
        return self.region._eager(self.key[1], leaves)

    def _set_failed(self, status: object, node: int) -> None:
        from jitcore.errors import DriverError

        raise DriverError(f"graph node update (node {node}) in {self.name}", int(status), str(status))

    # --- verification --------------------------------------------------------------------
    def verify(self, leaves: Sequence, eager) -> object:
        """Replay, then run the region eagerly on copies of the inputs taken before the
        replay, and compare outputs and every input afterwards bit for bit."""
        snapshots = [storage_clone(leaf) if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        result = self.replay(*leaves)
        replayed = [t.clone() if isinstance(t, torch.Tensor) else t for t in keys.flatten((result,), {})[1]]
        expected = eager(snapshots)
        expected_leaves = keys.flatten((expected,), {})[1]
        problems = []
        if len(replayed) != len(expected_leaves):
            problems.append("a different number of outputs")
        for number, (a, b) in enumerate(zip(replayed, expected_leaves)):
            if not _bitwise_equal(a, b):
                problems.append(f"output {number}")
        for i, (leaf, snapshot) in enumerate(zip(leaves, snapshots)):
            if isinstance(leaf, torch.Tensor) and not _bitwise_equal(leaf, snapshot):
                problems.append(f"input {self.paths[i]} after the call")
        if problems:
            raise ReplayMismatchError(
                f"replay of region {self.region_name} differs from an eager run in {', '.join(problems)}: the "
                "graph is stale (a tensor or value it baked in has changed) or the region is not deterministic; "
                "Session.invalidate() drops graphs"
            )
        return result

    def placeholder_leaves(self) -> list:
        """Leaves like the recorded ones (fresh tensors of the same layout, same constants)."""
        leaves = []
        for item in self.template:
            if item[0] == "tensor":
                _, shape, stride, dtype = item
                leaves.append(torch.empty_strided(shape, stride, dtype=dtype, device=f"cuda:{self.device}"))
            else:
                leaves.append(item[1])
        return leaves

    def release(self) -> None:
        self.updaters.clear()
        self.outputs = []
        self.namespace.clear()
        self.staged = {}
        self.graph.reset()
