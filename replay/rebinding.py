"""The rebinding plan: for each region input, rebind it or stage it, and how.

Pure logic over plain data (addresses, parameter bytes, node lists), so it is tested on the CPU
with made-up graphs; :mod:`replay.recording` feeds it what a real capture produced.

- Every jit launch recorded during capture is matched to the kernel node holding it (same
  function, same parameter bytes).
- A jit pointer parameter whose value lies inside exactly one input's byte range becomes a
  :class:`PointerBinding` (node, offset, input, delta): at replay, ``new pointer + delta`` is
  written when the input moved, so views and slices rebase.
- A jit scalar parameter computed from dynamic region scalars becomes a
  :class:`ScalarBinding` with the expression to recompute it.
- An input that something other than a jit launch touches (a torch op, seen by the observer;
  a foreign kernel or copy node, seen by scanning parameters) cannot be patched: it is staged
  (copied into a recorded buffer at the start of the graph) and, if written, copied back at
  the end. Inputs that overlap each other are staged too (which one a pointer belongs to is
  ambiguous); overlapping inputs that are also written cannot be graphed at all.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence

import attrs

REBOUND, STAGED, UNUSED = "rebound", "staged", "unused"


@attrs.frozen
class InputRange:
    index: int  # leaf index
    path: str
    lo: int
    hi: int  # one past the last byte (lo == hi for empty tensors)


@attrs.frozen
class ParamView:
    """A jit parameter as the plan needs it (a subset of jitcore's ParamRecord)."""

    index: int
    offset: int
    size: int
    fmt: str
    kind: str  # "pointer", "scalar", "constant"
    read_only: bool = False
    expression: str | None = None  # scalars: with {k} for jit argument k
    convert: object = None
    scalar_args: tuple[int, ...] = ()  # scalars: the jit arguments the value depends on


@attrs.frozen
class LaunchView:
    """A recorded jit launch as the plan needs it."""

    function: int
    kernel: str
    param_bytes: bytes
    params: tuple[ParamView, ...]
    # jit argument index -> Python source of its value: an expression over the dynamic leaves
    # for dynamic scalars, a literal for plain numbers (other arguments are absent)
    scalar_sources: Mapping[int, str] = attrs.Factory(dict)
    dynamic_args: frozenset[int] = frozenset()


@attrs.frozen
class NodeView:
    index: int
    kind: str  # "kernel", "memcpy", "memset", "other"
    function: int = 0
    params: tuple[bytes, ...] | None = None  # kernel nodes: each parameter's bytes, if known
    pointers: tuple[int, ...] | None = ()  # memcpy/memset: addresses touched; None = unknown


@attrs.frozen
class PointerBinding:
    node: int  # node index in the graph
    launch: int  # launch index
    param: int
    offset: int
    input: int  # leaf index
    delta: int


@attrs.frozen
class ScalarBinding:
    node: int
    launch: int
    param: int
    offset: int
    fmt: str
    source: str  # Python source over the dynamic leaves
    convert: object = None


@attrs.define
class Plan:
    matches: list[tuple[int, int]] = attrs.Factory(list)  # (launch index, node index)
    pointers: list[PointerBinding] = attrs.Factory(list)
    scalars: list[ScalarBinding] = attrs.Factory(list)
    choices: dict[int, str] = attrs.Factory(dict)  # input leaf index -> REBOUND / STAGED / UNUSED
    reasons: dict[int, list[str]] = attrs.Factory(dict)
    needs_staging: set[int] = attrs.Factory(set)  # inputs that must be staged (not staged this capture)
    needs_copy_back: set[int] = attrs.Factory(set)
    failure: str | None = None  # why this capture cannot be used at all


def _owners(inputs: Sequence[InputRange], address: int) -> list[InputRange]:
    found = [r for r in inputs if r.lo <= address < r.hi]
    if not found:
        found = [r for r in inputs if r.lo == r.hi == address and address]
    return found


def _pointer_words(data: bytes) -> list[int]:
    """8-byte aligned words of a parameter's bytes (where a pointer could be)."""
    return [struct.unpack_from("<Q", data, i)[0] for i in range(0, len(data) - 7, 8)]


def _overlapping(inputs: Sequence[InputRange]) -> dict[int, set[int]]:
    overlaps: dict[int, set[int]] = {}
    for i, a in enumerate(inputs):
        for b in inputs[i + 1 :]:
            if a.lo < b.hi and b.lo < a.hi:
                overlaps.setdefault(a.index, set()).add(b.index)
                overlaps.setdefault(b.index, set()).add(a.index)
    return overlaps


def match_launches(
    launches: Sequence[LaunchView], nodes: Sequence[NodeView]
) -> tuple[list[tuple[int, int]], str | None]:
    """Pair each jit launch with the kernel node that holds it, in capture order where possible."""
    used: set[int] = set()
    matches = []
    cursor = 0
    kernels = [n for n in nodes if n.kind == "kernel"]
    for number, launch in enumerate(launches):
        wanted = [launch.param_bytes[p.offset : p.offset + p.size] for p in launch.params]
        order = kernels[cursor:] + kernels[:cursor]
        for node in order:
            if node.index in used or node.function != launch.function or node.params is None:
                continue
            if list(node.params[: len(wanted)]) == wanted and len(node.params) == len(wanted):
                used.add(node.index)
                matches.append((number, node.index))
                cursor = (kernels.index(node) + 1) % max(len(kernels), 1)
                break
        else:
            return (
                matches,
                f"jit launch {number} ({launch.kernel}) was not found among the captured graph's kernel nodes",
            )
    return matches, None


def build_plan(
    inputs: Sequence[InputRange],
    launches: Sequence[LaunchView],
    nodes: Sequence[NodeView],
    *,
    staged: set[int],
    copied_back: set[int],
    torch_read: set[int],
    torch_written: set[int],
    scanned: bool = True,
) -> Plan:
    """Decide, for one capture, what each input becomes and which parameters to patch.

    ``staged``/``copied_back``: inputs that were staged (and copied back) in this capture.
    ``torch_read``/``torch_written``: inputs the observer saw torch ops read/write.
    ``scanned``: whether foreign kernel parameters could be read (False on HIP).
    """
    plan = Plan()
    by_index = {r.index: r for r in inputs}
    overlaps = _overlapping(inputs)
    plan.matches, plan.failure = match_launches(launches, nodes)
    if plan.failure:
        return plan

    def need(index: int, reason: str, copy_back: bool = False) -> None:
        plan.reasons.setdefault(index, []).append(reason)
        if index not in staged:
            plan.needs_staging.add(index)
        if copy_back and index not in copied_back:
            plan.needs_copy_back.add(index)

    jit_nodes = {node for _, node in plan.matches}
    written_by_jit: set[int] = set()
    for launch_number, node_index in plan.matches:
        launch = launches[launch_number]
        for param in launch.params:
            raw = launch.param_bytes[param.offset : param.offset + param.size]
            if param.kind == "pointer":
                (address,) = struct.unpack("<Q", raw)
                owners = _owners(inputs, address)
                if len(owners) == 1 and owners[0].index not in overlaps:
                    # (a staged input's own memory is reached only by our staging copies,
                    # whose pointers must follow the input like any other)
                    owner = owners[0]
                    plan.pointers.append(
                        PointerBinding(
                            node_index, launch_number, param.index, param.offset, owner.index, address - owner.lo
                        )
                    )
                    if not param.read_only:
                        written_by_jit.add(owner.index)
                elif owners:
                    for owner in owners:
                        need(
                            owner.index,
                            f"it overlaps another input and {launch.kernel} points into it",
                            copy_back=not param.read_only,
                        )
            elif param.kind == "scalar" and param.expression is not None:
                if not set(param.scalar_args) & launch.dynamic_args:
                    continue  # depends on constants only: fixed for this graph
                count = max(param.scalar_args) + 1
                missing = [k for k in param.scalar_args if k not in launch.scalar_sources]
                if missing:
                    plan.failure = (
                        f"{launch.kernel}: scalar parameter {param.index} depends on unknown arguments {missing}"
                    )
                    return plan
                source = param.expression.format(*[launch.scalar_sources.get(k, "None") for k in range(count)])
                plan.scalars.append(
                    ScalarBinding(
                        node_index, launch_number, param.index, param.offset, param.fmt, source, param.convert
                    )
                )
    for node in nodes:
        if node.index in jit_nodes:
            continue
        words: list[int] | None
        if node.kind == "kernel":
            words = None if node.params is None else [w for p in node.params for w in _pointer_words(p)]
        elif node.kind in ("memcpy", "memset"):
            words = (
                None if node.pointers is None or (node.kind == "memcpy" and not node.pointers) else list(node.pointers)
            )
        else:
            continue
        if words is None:
            continue  # unknown: the observer covers torch ops; see docs for other kernels
        for word in words:
            for owner in _owners(inputs, word):
                if owner.index not in staged:
                    need(owner.index, f"a non-jit {node.kind} node reads or writes it", copy_back=True)
    for index in torch_read:
        if index in by_index:
            need(index, "a torch op reads it", copy_back=index in torch_written)
    for index in torch_written:
        if index in by_index:
            need(index, "a torch op writes it", copy_back=True)
    for index in written_by_jit & plan.needs_staging:
        if index not in copied_back:
            plan.needs_copy_back.add(index)
    for index, partners in overlaps.items():
        if (index in torch_written or index in written_by_jit or index in copied_back) and partners:
            plan.failure = (
                f"input {by_index[index].path} overlaps {', '.join(by_index[p].path for p in sorted(partners))} "
                "and is written: its aliasing cannot be reproduced by a graph"
            )
    if plan.needs_staging or plan.needs_copy_back:
        return plan  # the caller re-records with these staged; choices come from that capture
    bound = {b.input for b in plan.pointers}
    for r in inputs:
        plan.choices[r.index] = STAGED if r.index in staged else REBOUND if r.index in bound else UNUSED
    return plan
