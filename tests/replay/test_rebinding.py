"""The rebinding plan on made-up graphs: pointer ranges, views, overlaps, staging decisions."""

from __future__ import annotations

import struct

from replay.rebinding import (
    REBOUND,
    STAGED,
    UNUSED,
    InputRange,
    LaunchView,
    NodeView,
    ParamView,
    build_plan,
    match_launches,
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
        params.append(ParamView(len(params), len(data), 4, "i", "scalar", expression=expression, scalar_args=args))
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


def test_copy_nodes_are_scanned_and_unknown_ones_ignored():
    assert plan([X, Y], [], [NodeView(0, "memcpy", pointers=(X.lo + 8, 0x90000))]).needs_staging == {0}
    assert plan([X, Y], [], [NodeView(0, "memcpy", pointers=())]).needs_staging == set()  # HIP: unknown
    assert plan([X, Y], [], [NodeView(0, "kernel", 0xC, None)]).needs_staging == set()  # no param info


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
    assert result.needs_copy_back >= {0, 1}
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
    assert binding.source == "((_d3 + 1) * 2 + 1)" and binding.offset == 8 and binding.fmt == "i"
    assert eval(binding.source, {}, {"_d3": 3}) == 9
