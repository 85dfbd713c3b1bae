"""The rebinding plan on made-up graphs: pointer ranges, views, overlaps, staging decisions."""

from __future__ import annotations

import bisect
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.rebinding import (
    REBOUND,
    STAGED,
    UNUSED,
    ConfigView,
    Extent,
    InputRange,
    LaunchView,
    NodeView,
    ParamView,
    addresses_in,
    addresses_of,
    addresses_readable,
    build_plan,
    inputs_at,
    inputs_reached,
    inputs_reached_by_group,
    match_launches,
    pointer_words_of,
)

X = InputRange(0, "args[0]", 0x10000, 0x10000 + 4096)
Y = InputRange(1, "args[1]", 0x20000, 0x20000 + 4096)
Z = InputRange(2, "args[2]", 0x30000, 0x30000)  # empty


def pointer_param(index, offset, read_only=True):
    return ParamView(index, offset, 8, "Q", "pointer", read_only=read_only)


def launch(function, pointers, scalars=(), kernel="k", sources=None, dynamic=()):
    params, data = [], b""
    for value, read_only in pointers:
        params.append(pointer_param(len(params), len(data), read_only))
        data += struct.pack("<Q", value)
    for value, expression, args in scalars:
        evaluate = eval("lambda _s: " + expression.format(*[f"_s[{k}]" for k in range(max(args) + 1)]))
        params.append(
            ParamView(
                len(params), len(data), 4, "i", "scalar", expression=expression, scalar_args=args, evaluate=evaluate
            )
        )
        data += struct.pack("<i", value)
    return LaunchView(function, kernel, data, tuple(params), sources or {}, frozenset(dynamic))


def node_for(index, view, function=None):
    parts = tuple(view.param_bytes[p.offset : p.offset + p.size] for p in view.params)
    return NodeView(index, "kernel", function or view.function, parts)


def plan(inputs, launches, nodes, **kw):
    options = dict(staged=set(), copied_back=set(), torch_read=set(), torch_written=set())
    options.update(kw)
    return build_plan(inputs, launches, nodes, **options)


def test_pointers_rebind_with_their_offset_inside_the_input():
    view = launch(0xF1, [(X.lo, True), (Y.lo + 256, False)])
    result = plan([X, Y], [view], [NodeView(0, "memset", pointers=(0x99990000,)), node_for(1, view)])
    assert result.failure is None and not result.needs_staging
    assert [(b.node, b.input, b.offset, b.delta) for b in result.pointers] == [(1, 0, 0, 0), (1, 1, 8, 256)]
    assert result.choices == {0: REBOUND, 1: REBOUND}


def test_pointers_outside_every_input_are_left_alone():
    view = launch(0xF1, [(0x50000, True)])
    result = plan([X, Y], [view], [node_for(0, view)])
    assert result.pointers == [] and result.choices == {0: UNUSED, 1: UNUSED}


def test_matching_ignores_foreign_nodes_and_tolerates_reordering():
    a = launch(0xA, [(X.lo, True)])
    b = launch(0xB, [(Y.lo, True)])
    foreign = NodeView(0, "kernel", 0xC, (struct.pack("<Q", 0x77),))
    matches, failure = match_launches([a, b], [foreign, node_for(2, b), node_for(1, a)])
    assert failure is None and sorted(matches) == [(0, 1), (1, 2)]
    same_function_other_bytes = launch(0xA, [(Y.lo, True)])
    _, failure = match_launches([a], [node_for(0, same_function_other_bytes, function=0xA)])
    assert "was not found" in failure


def test_identical_launches_are_matched_one_to_one():
    a = launch(0xA, [(X.lo, True)])
    matches, failure = match_launches([a, a], [node_for(5, a), node_for(6, a)])
    assert failure is None and matches == [(0, 5), (1, 6)]


def test_a_torch_op_reading_an_input_means_staging():
    view = launch(0xF1, [(X.lo, True)])
    result = plan([X, Y], [view], [node_for(0, view)], torch_read={1})
    assert result.needs_staging == {1} and result.needs_copy_back == set()
    assert "torch op reads it" in result.reasons[1][0]


def test_a_torch_op_writing_an_input_means_staging_and_copy_back():
    result = plan([X, Y], [], [], torch_read={0}, torch_written={0})
    assert result.needs_staging == {0} and result.needs_copy_back == {0}


def test_a_jit_write_into_an_input_that_must_be_staged_is_copied_back():
    view = launch(0xF1, [(X.lo, False)])
    result = plan([X], [view], [node_for(0, view)], torch_read={0})
    assert result.needs_staging == {0} and result.needs_copy_back == {0}


def test_foreign_kernel_parameters_are_scanned_for_input_addresses():
    struct_param = struct.pack("<QQQ", 12, Y.lo + 64, 3)  # a pointer inside a by-value struct
    foreign = NodeView(0, "kernel", 0xC, (struct.pack("<i", 1) + b"\0" * 4, struct_param))
    result = plan([X, Y], [], [foreign])
    assert result.needs_staging == {1} and result.needs_copy_back == {1}


def test_copy_nodes_are_scanned_and_unknown_nodes_stage_every_input():
    assert plan([X, Y], [], [NodeView(0, "memcpy", pointers=(X.lo + 8, 0x90000))]).needs_staging == {0}
    # unknown must mean staged (and copied back: it may write), never ignored
    for unknown in (NodeView(0, "memcpy", pointers=()), NodeView(0, "memset", pointers=None)):
        result = plan([X, Y], [], [unknown])
        assert result.needs_staging == {0, 1} and result.needs_copy_back == {0, 1}
    result = plan([X, Y], [], [NodeView(0, "kernel", 0xC, None)])  # no parameter info (HIP)
    assert result.needs_staging == {0, 1} and result.needs_copy_back == {0, 1}
    assert "cannot be read" in result.reasons[0][0]
    result = plan([X, Y], [], [], scanned=False)
    assert result.needs_staging == {0, 1}


def test_pointers_at_4_byte_offsets_inside_packed_structs_are_found():
    packed = struct.pack("<iQi", 7, X.lo + 16, 9)  # a pointer at offset 4 (#pragma pack(4))
    result = plan([X, Y], [], [NodeView(0, "kernel", 0xC, (packed,))])
    assert result.needs_staging == {0}


def test_staged_inputs_keep_their_staging_copies_rebound():
    copy_in = launch(0x5, [(X.lo, True), (0x80000, False)])  # our copy: caller's tensor -> graph buffer
    result = plan([X], [copy_in], [node_for(0, copy_in)], staged={0})
    assert result.failure is None and not result.needs_staging
    assert [(b.input, b.delta) for b in result.pointers] == [(0, 0)]
    assert result.choices == {0: STAGED}


def test_overlapping_inputs_are_staged_and_written_overlaps_refused():
    whole = InputRange(0, "args[0]", 0x10000, 0x10000 + 4096)
    tail = InputRange(1, "args[1]", 0x10000 + 1024, 0x10000 + 4096)
    reader = launch(0xF1, [(tail.lo, True)])
    result = plan([whole, tail], [reader], [node_for(0, reader)])
    assert result.needs_staging == {0, 1} and result.failure is None
    writer = launch(0xF1, [(tail.lo, False)])
    result = plan([whole, tail], [writer], [node_for(0, writer)])
    # refused at once: staging would give the first launch of the next capture separate
    # copies of memory the region writes through one name and reads through the other
    assert "cannot be reproduced" in result.failure
    result = plan([whole, tail], [], [], torch_written={1}, torch_read={1})
    assert "cannot be reproduced" in result.failure


def test_empty_inputs_match_only_their_exact_address():
    view = launch(0xF1, [(Z.lo, True), (X.lo, True)])
    result = plan([X, Z], [view], [node_for(0, view)])
    assert {b.input for b in result.pointers} == {0, 2}


def test_scalars_from_dynamic_arguments_become_bindings():
    view = launch(
        0xF1,
        [(X.lo, True)],
        scalars=[(9, "({1} * 2 + 1)", (1,)), (3, "({2} + 1)", (2,))],
        sources={1: "(_d3 + 1)", 2: "2"},
        dynamic={1},
    )
    result = plan([X], [view], [node_for(0, view)])
    assert len(result.scalars) == 1
    binding = result.scalars[0]
    assert binding.offset == 8 and binding.fmt == "i"
    assert result.arguments == {0: (None, "(_d3 + 1)")}
    arguments = tuple(eval(s, {}, {"_d3": 3}) if s else None for s in result.arguments[0])
    assert binding.evaluate(arguments) == 9


def dynamic_pointer_launch(address, recorded_offset, node=None, row_bytes=256):
    """A launch writing ``cache[pos]``: the pointer's offset is pos * row_bytes."""
    params = (
        ParamView(
            0,
            0,
            8,
            "Q",
            "pointer",
            read_only=False,
            byte_offset=recorded_offset,
            offset_scalar_args=(1,),
            offset_evaluate=lambda s: s[1] * row_bytes,
        ),
    )
    return LaunchView(0xF1, "write_row", struct.pack("<Q", address), params, {1: "_d4"}, frozenset({1}), node=node)


def test_pointer_offsets_from_dynamic_scalars_are_recomputed():
    view = dynamic_pointer_launch(X.lo + 3 * 256, 3 * 256)
    result = plan([X], [view], [node_for(0, view)])
    (binding,) = result.pointers
    assert binding.dynamic and binding.delta == 768 and binding.recorded_offset == 768
    assert result.arguments == {0: (None, "_d4")}
    # a new pointer of the input and pos = 5: new_lo + delta - recorded + evaluate
    new_lo, pos = 0x70000, 5
    assert new_lo + binding.delta - binding.recorded_offset + binding.offset_evaluate((None, pos)) == new_lo + 5 * 256


def test_pointers_into_intermediates_offset_by_dynamic_scalars_are_refused():
    view = dynamic_pointer_launch(0x90000 + 256, 256)  # no input holds this address
    result = plan([X], [view], [node_for(0, view)])
    assert "memory the region allocated" in result.failure


def config_launch(grid, field="grid_x", launched=True):
    params = (pointer_param(0, 0),)
    config = (ConfigView(field, (1,), lambda s: -(-s[1] // 64), "cdiv(n, 64)"),)
    return LaunchView(
        0xF1, "k", struct.pack("<Q", X.lo), params, {1: "_d2"}, frozenset({1}), config=config, launched=launched
    )


def test_grid_sizes_from_dynamic_scalars_become_bindings_block_sizes_are_refused():
    view = config_launch(2)
    result = plan([X], [view], [node_for(0, view)])
    assert result.failure is None and [(c.node, c.field) for c in result.configs] == [(0, "grid_x")]
    assert result.configs[0].evaluate((None, 4000)) == 63
    for field in ("block_x", "shared"):
        refused = plan([X], [config_launch(2, field)], [node_for(0, view)])
        assert "replay patches grid sizes only" in refused.failure


def test_a_launch_skipped_at_a_zero_dynamic_grid_asks_for_a_later_recording():
    result = plan([X], [config_launch(0, launched=False)], [])
    assert result.retry_later and "skipped" in result.retry_later and result.failure is None


def test_launches_are_matched_to_the_node_the_capture_reported():
    a = launch(0xA, [(X.lo, True)])
    b = launch(0xA, [(X.lo, True)])
    nodes = [node_for(5, a)._replace(handle=0x500), node_for(6, b)._replace(handle=0x600)]
    reported = [a.replace(node=0x600), b.replace(node=0x500)]
    matches, failure = match_launches(reported, nodes)
    assert failure is None and matches == [(0, 6), (1, 5)]
    _, failure = match_launches([a.replace(node=0x999)], nodes)
    assert "not the graph node" in failure


def test_byte_identical_launches_with_different_provenance_are_refused_without_node_identity():
    # scale(x, s) twice with equal bytes: one s is dynamic, the other a constant 2
    dynamic = launch(0xF1, [(X.lo, True)], scalars=[(2, "{1}", (1,))], sources={1: "_d3"}, dynamic={1})
    constant = launch(0xF1, [(X.lo, True)], scalars=[(2, "{1}", (1,))], sources={1: "_lit0"})
    assert dynamic.param_bytes == constant.param_bytes
    _, failure = match_launches([dynamic, constant], [node_for(0, dynamic), node_for(1, constant)])
    assert "cannot say which graph node is which" in failure
    matches, failure = match_launches([dynamic, dynamic], [node_for(0, dynamic), node_for(1, dynamic)])
    assert failure is None and len(matches) == 2  # same provenance: either pairing is exact


def test_staging_copies_of_overlapping_inputs_stay_bound_to_their_own_input():
    whole = InputRange(0, "args[0]", 0x10000, 0x10000 + 4096)
    tail = InputRange(1, "args[1]", 0x10000 + 1024, 0x10000 + 4096)
    copy_in = launch(0x5, [(tail.lo, True), (0x80000, False)]).replace(staging_input=1)
    result = plan([whole, tail], [copy_in], [node_for(0, copy_in)], staged={0, 1})
    assert result.failure is None
    assert [(b.input, b.delta) for b in result.pointers] == [(1, 0)]


# --- the scan of foreign nodes' parameters for input addresses ---------------------------------

_ADDRESSES = st.integers(0, 2**64 - 1) | st.sampled_from([0, 0x10000, 0x10FFF, 0x11000, 0x30000, 2**64 - 1])


@settings(max_examples=300, deadline=None)
@given(data=st.binary(min_size=0, max_size=80))
def test_pointer_words_are_every_8_byte_window_at_4_byte_offsets(data):
    expected = [struct.unpack_from("<Q", data, i)[0] for i in range(0, len(data) - 7, 4)]
    assert _reference_pointer_words(data).tolist() == expected
    words, param_of = pointer_words_of([data])
    assert words.tolist() == expected and param_of.tolist() == [0] * len(expected)


def _reference_pointer_words(data: bytes) -> np.ndarray:
    """The scan parameter by parameter, as the plan made it before it read every node's
    parameters in one pass: the reference the one pass must equal."""
    windows = (len(data) - 4) // 4
    if windows <= 0:
        return np.zeros(0, dtype=np.uint64)
    halves = np.frombuffer(data, dtype="<u4", count=windows + 1).astype(np.uint64)
    return halves[:-1] | (halves[1:] << np.uint64(32))


def _reference_inputs_reached_by_each(inputs, words):
    """Each node's words compared with each input in turn (the plan's former rule)."""
    reached = [[] for _ in words]
    sizes = [len(w) for w in words]
    if not sum(sizes):
        return reached
    every = np.concatenate(words)
    node_of = np.repeat(np.arange(len(words)), sizes)
    held = np.zeros(len(every), dtype=bool)
    for candidate in inputs:
        if candidate.lo < candidate.hi:
            inside = (every >= candidate.lo) & (every < candidate.hi)
            if inside.any():
                held |= inside
                for node in np.unique(node_of[inside]).tolist():
                    reached[node].append(candidate)
    for candidate in inputs:
        if candidate.lo == candidate.hi and candidate.lo:
            at = (every == candidate.lo) & ~held
            if at.any():
                for node in np.unique(node_of[at]).tolist():
                    reached[node].append(candidate)
    return reached


def _reference_addresses_in(node):
    if node.kind == "kernel":
        if node.params is None:
            return None
        return np.concatenate([np.zeros(0, dtype=np.uint64), *(_reference_pointer_words(p) for p in node.params)])
    if node.pointers is None or (node.kind == "memcpy" and not node.pointers):
        return None
    return np.array(node.pointers, dtype=np.uint64)


#: A parameter's bytes: addresses (some at or next to the inputs' bounds) packed at any
#: alignment among bytes of any length, so words straddle and parameters end unaligned.
_PARAM = st.lists(
    st.one_of(_ADDRESSES.map(struct.Struct("<Q").pack), st.binary(min_size=1, max_size=7)), max_size=8
).map(b"".join)
_BOUNDS = st.lists(st.tuples(_ADDRESSES, st.integers(0, 5000)), min_size=0, max_size=6)


def _ranges(bounds):
    return [InputRange(i, f"args[{i}]", lo, min(lo + size, 2**64 - 1)) for i, (lo, size) in enumerate(bounds)]


@settings(max_examples=400, deadline=None)
@given(params=st.lists(_PARAM, max_size=12))
def test_every_parameters_words_in_one_pass_are_each_parameters_own(params):
    words, param_of = pointer_words_of(params)
    expected = [_reference_pointer_words(p) for p in params]
    assert words.dtype == np.uint64
    assert words.tolist() == [w for each in expected for w in each.tolist()]
    assert param_of.tolist() == [n for n, each in enumerate(expected) for _ in range(len(each))]


#: A parameter of whole 4-byte halves (a pointer, an int, a struct of them, or nothing), as
#: most kernels' are: every parameter so, the scan reads the joined bytes by halves.
_HALVES_PARAM = st.lists(
    st.one_of(_ADDRESSES.map(struct.Struct("<Q").pack), st.binary(min_size=4, max_size=4)), max_size=6
).map(b"".join)


@settings(max_examples=400, deadline=None)
@given(params=st.lists(_HALVES_PARAM, max_size=12))
def test_parameters_of_whole_halves_give_each_parameters_own_words(params):
    words, param_of = pointer_words_of(params)
    expected = [_reference_pointer_words(p) for p in params]
    assert words.dtype == np.uint64 and param_of.dtype == np.intp
    assert words.tolist() == [w for each in expected for w in each.tolist()]
    assert param_of.tolist() == [n for n, each in enumerate(expected) for _ in range(len(each))]


@settings(max_examples=300, deadline=None)
@given(
    bounds=st.lists(st.tuples(_ADDRESSES, st.integers(0, 5000)), min_size=0, max_size=5),
    words=st.lists(_ADDRESSES, min_size=0, max_size=30),
)
def test_inputs_reached_is_the_owners_of_every_word(bounds, words):
    """All words at once, as the word-by-word rule decides: inside an input, or at an empty
    input's address where no other input holds it."""
    inputs = _ranges(bounds)
    array = np.array(words, dtype=np.uint64)
    expected = {r.index for word in words for r in inputs_at(inputs, word)}
    assert {r.index for r in inputs_reached(inputs, array)} == expected


@settings(max_examples=300, deadline=None)
@given(bounds=_BOUNDS, nodes=st.lists(st.lists(_ADDRESSES, min_size=0, max_size=12), min_size=0, max_size=6))
def test_the_inputs_each_node_reaches_are_decided_at_once_as_node_by_node(bounds, nodes):
    """Every node's words at once, as each node's alone: the owners of its words, the inputs
    in their order and the empty ones last (the order the planner gives its reasons in)."""
    inputs = _ranges(bounds)
    arrays = [np.array(words, dtype=np.uint64) for words in nodes]
    every = np.array([w for words in nodes for w in words], dtype=np.uint64)
    node_of = np.repeat(np.arange(len(nodes)), [len(words) for words in nodes])
    reached = inputs_reached_by_group(inputs, every, node_of, len(nodes))
    assert len(reached) == len(nodes)
    assert reached == _reference_inputs_reached_by_each(inputs, arrays)
    for words, found in zip(nodes, reached):
        owners = {r.index for word in words for r in inputs_at(inputs, word)}
        order = [r.index for r in inputs if r.lo < r.hi] + [r.index for r in inputs if not r.lo < r.hi]
        assert [r.index for r in found] == [i for i in order if i in owners]


_FOREIGN = st.one_of(
    st.builds(lambda params: NodeView(0, "kernel", 0xF, tuple(params)), st.lists(_PARAM, max_size=6)),
    st.builds(lambda params: NodeView(0, "kernel", 0xF, tuple(params)), st.lists(_HALVES_PARAM, max_size=6)),
    st.builds(lambda: NodeView(0, "kernel", 0xF, None)),
    st.builds(
        lambda kind, pointers: NodeView(0, kind, pointers=pointers),
        st.sampled_from(["memcpy", "memset"]),
        st.none() | st.lists(_ADDRESSES, max_size=3).map(tuple),
    ),
)


@settings(max_examples=400, deadline=None)
@given(bounds=_BOUNDS, nodes=st.lists(_FOREIGN, max_size=8))
def test_the_foreign_node_scan_in_one_pass_decides_as_node_by_node(bounds, nodes):
    """The scan of foreign nodes' parameters and addresses, all nodes at once, against the
    former node-by-node scan: the same words per node, the same inputs reached per node."""
    inputs = _ranges(bounds)
    readable = [node for node in nodes if addresses_readable(node)]
    assert [addresses_readable(node) for node in nodes] == [_reference_addresses_in(n) is not None for n in nodes]
    words, node_of = addresses_of(readable)
    expected = [_reference_addresses_in(node) for node in readable]
    for n, node in enumerate(readable):
        assert words[node_of == n].tolist() == expected[n].tolist()
        assert addresses_in(node).tolist() == expected[n].tolist()
    assert inputs_reached_by_group(inputs, words, node_of, len(readable)) == _reference_inputs_reached_by_each(
        inputs, expected
    )


# --- pointers from tensors that reach beyond the input they point into --------------------------


def _with_extents(view: LaunchView, extents: dict[int, tuple]) -> LaunchView:
    return view.replace(extents={param: Extent(*extent) for param, extent in extents.items()})


def test_a_global_holding_the_argument_is_never_rebound_to_it():
    """A region called as step(cache[i]) that also passes the global ``cache`` to a kernel:
    recorded with i = 0, the global's pointer is the argument's address. Bound by address it
    would follow the argument to row i on replay; its jit argument reaches beyond the input,
    so the capture is refused instead (the key runs eagerly)."""
    base, row = 0x7F0000000000, 8 * 4
    row0 = InputRange(0, "args[0]", base, base + row)
    write_row = launch(0xA1, [(row0.lo, False)], kernel="write_row")
    col_sums = _with_extents(launch(0xB2, [(base, True)], kernel="col_sums"), {0: (base, base + 4 * row)})
    result = plan([row0], [write_row, col_sums], [node_for(0, write_row), node_for(1, col_sums)])
    assert result.failure is not None and "reaches beyond it" in result.failure and "args[0]" in result.failure
    assert "col_sums: pointer parameter 0" in result.failure


@settings(max_examples=200, deadline=None)
@given(offset=st.integers(0, 4095), width=st.integers(1, 4096), read_only=st.booleans())
def test_a_pointer_whose_provenance_is_in_doubt_stages_its_input_and_then_refuses(offset, width, read_only):
    """A pointer into an input that another holder of its memory may have given (the call's
    argument a row of a live tensor) is never bound to the input by its address, wherever its
    tensor lies inside the input: the input is staged for the next capture (copied back where
    the launch writes it), where the region's own views point into the graph's buffer; a
    doubted pointer into an input already staged is the other holder's, and refuses the
    capture. Without the doubt the same extent binds."""
    address = X.lo + offset
    lo, hi = address, min(address + width, X.hi)
    doubted = _with_extents(launch(0xF1, [(address, read_only)]), {0: (lo, hi, "maybe another's")})
    result = plan([X, Y], [doubted], [node_for(0, doubted)])
    assert result.failure is None and result.pointers == []
    assert result.needs_staging == {0} and result.needs_copy_back == (set() if read_only else {0})
    assert "another holder of its memory" in " ".join(result.reasons[0])
    result = plan([X, Y], [doubted], [node_for(0, doubted)], staged={0})
    assert result.failure is not None and result.pointers == [] and not result.needs_staging
    assert f"points into input {X.path}, but maybe another's" in result.failure and "cannot tell" in result.failure
    clear = _with_extents(launch(0xF1, [(address, read_only)]), {0: (lo, hi)})
    result = plan([X, Y], [clear], [node_for(0, clear)])
    assert result.failure is None and [(b.input, b.delta) for b in result.pointers] == [(0, offset)]


def test_a_doubted_pointer_reaching_beyond_its_input_refuses_at_once():
    """Reaching beyond the input (a global holding it) refuses the capture directly, doubt
    or not: staging would only lead to the same refusal one capture later."""
    doubted = _with_extents(launch(0xF1, [(X.lo, True)]), {0: (X.lo, X.hi + 64, "maybe another's")})
    result = plan([X, Y], [doubted], [node_for(0, doubted)])
    assert result.failure is not None and "reaches beyond it" in result.failure and not result.needs_staging


@settings(max_examples=300, deadline=None)
@given(
    lo_shift=st.integers(-64, 64),
    hi_shift=st.integers(-64, 64),
    offset=st.integers(0, 4095),
)
def test_a_pointer_binds_to_an_input_only_where_its_tensor_lies_inside_it(lo_shift, hi_shift, offset):
    """The class: any jit argument whose byte range is inside the input (a view of it) binds
    as before; any that starts before or ends after it refuses the capture."""
    address = X.lo + offset
    lo, hi = min(X.lo + lo_shift, address), max(X.hi + hi_shift, address + 1)
    view = _with_extents(launch(0xF1, [(address, True)]), {0: (lo, hi)})
    result = plan([X, Y], [view], [node_for(0, view)])
    inside = X.lo <= lo and hi <= X.hi
    if inside:
        assert result.failure is None and [(b.input, b.delta) for b in result.pointers] == [(0, offset)]
    else:
        assert result.failure is not None and "reaches beyond it" in result.failure and result.pointers == []


def test_extents_of_pointers_outside_inputs_or_of_staging_copies_are_ignored():
    outside = _with_extents(launch(0xF1, [(0x50000, True)]), {0: (0x40000, 0x90000)})
    result = plan([X, Y], [outside], [node_for(0, outside)])
    assert result.failure is None and result.pointers == []
    copy = launch(0xC0, [(X.lo, True)]).replace(staging_input=0, extents={0: Extent(X.lo - 64, X.hi + 64)})
    result = plan([X, Y], [copy], [node_for(0, copy)], staged={0})
    assert result.failure is None and [(b.input, b.delta) for b in result.pointers] == [(0, 0)]


def test_fixed_addresses_are_every_node_word_a_replay_does_not_change():
    """Sorted, unique, without zero and without the per-call ranges (the recorded inputs,
    the staging buffers); a kernel's words at every 4-byte offset, copies' and memsets'
    addresses; None once a node's addresses cannot be read."""
    from replay.rebinding import fixed_addresses

    weight, global_row, inside_x = 0x50000, 0x60010, X.lo + 64
    kernel = NodeView(0, "kernel", 0xF, (struct.pack("<QQ", weight, inside_x), struct.pack("<Q", 0)))
    copy = NodeView(1, "memcpy", pointers=(global_row, X.lo))
    memset = NodeView(2, "memset", pointers=(weight,))
    other = NodeView(3, "other")
    words = fixed_addresses([kernel, copy, memset, other], [(X.lo, X.hi)])
    assert words == tuple(sorted(set(words)))
    assert {weight, global_row} <= set(words) and 0 not in words
    assert not any(X.lo <= w < X.hi for w in words)
    assert fixed_addresses([], [(X.lo, X.hi)]) == ()
    assert fixed_addresses([kernel, NodeView(4, "kernel", 0xF, None)], []) is None
    assert fixed_addresses([NodeView(5, "memcpy", pointers=None)], []) is None


# --- the plan skips pointers into no input without asking each one -------------------------------


@st.composite
def _random_capture(draw):
    """Inputs that may overlap or be empty, jit launches whose pointers land inside, at the
    bounds of or outside them (some with offsets from a dynamic scalar, some through a tensor
    whose extent doubts them, some replay's own staging copies), and their kernel nodes."""
    bounds = draw(st.lists(st.tuples(st.integers(1, 40), st.sampled_from([0, 64, 256, 4096])), max_size=5))
    inputs = [InputRange(i, f"args[{i}]", lo << 10, (lo << 10) + size) for i, (lo, size) in enumerate(bounds)]
    edges = [0, 1 << 10, 41 << 10, 0x7FFF_0000] + [a + d for r in inputs for a in (r.lo, r.hi) for d in (-8, 0, 8)]
    address = st.sampled_from(edges) | st.integers(0, 50 << 10)
    launches, nodes = [], []
    for number in range(draw(st.integers(0, 6))):
        params, data, extents = [], b"", {}
        for _ in range(draw(st.integers(0, 4))):
            dynamic = draw(st.booleans()) and draw(st.booleans())
            params.append(
                ParamView(
                    len(params),
                    len(data),
                    8,
                    "Q",
                    "pointer",
                    read_only=draw(st.booleans()),
                    offset_scalar_args=(0,) if dynamic else (),
                    offset_evaluate=(lambda _s: 0) if dynamic else None,
                )
            )
            if draw(st.integers(0, 5)) == 0:
                extents[len(params) - 1] = Extent(0, 1 << 20, draw(st.sampled_from(["", "another holder"])))
            data += struct.pack("<Q", draw(address))
        staging = draw(st.none() | st.integers(0, 5))
        view = LaunchView(
            0x100 + number % 2, f"k{number}", data, tuple(params), {0: "_d0"}, frozenset({0}), extents=extents
        ).replace(staging_input=staging)
        launches.append(view)
        nodes.append(node_for(number, view))
    return inputs, launches, nodes, set(draw(st.lists(st.integers(0, 5), max_size=3)))


@settings(max_examples=400, deadline=None)
@given(capture=_random_capture())
def test_pointers_skipped_as_into_no_input_decide_as_if_each_were_asked(capture):
    """The plan asks only the pointers some input may hold (one bisect of the inputs' placed
    stretches); asking every pointer, as if every address were placed, decides the same."""
    import replay.rebinding as rebinding

    inputs, launches, nodes, staged = capture
    skipping = plan(inputs, launches, nodes, staged=staged)
    with pytest.MonkeyPatch.context() as patched:
        patched.setattr(rebinding, "_placed_bounds", lambda _inputs: [0, 1 << 65])
        asking = plan(inputs, launches, nodes, staged=staged)
    assert skipping == asking
    for address in range(0, 42 << 10, 256):
        placed = bisect.bisect_right(rebinding._placed_bounds(inputs), address) & 1
        assert bool(placed) == bool(inputs_at(inputs, address))
