"""Which outputs are the caller's own objects (replay.output_identity), and what the recording
call hands out: on the CPU, with real tensors (a capture's own objects are plain tensors; the
GPU tests in test_hazards_gpu.py replay real graphs)."""

from __future__ import annotations

import attrs
import torch

from replay import output_identity
from replay.dynamic import DynamicScalar


@attrs.frozen
class Held:
    named: tuple = ()
    attributes: tuple = ()


def test_an_argument_returned_is_told_from_a_view_of_it_covering_it_whole():
    x, y = torch.randn(8), torch.randn(4, 2)
    staged = torch.empty(4, 2)  # what the region was given in y's place
    given = output_identity.given_objects([x, 3, y], {2: staged}, None)
    assert given == {0: x, 2: staged}
    outputs = (x, x[:], x.view(x.shape), staged, staged[:], y, 3)
    identity = output_identity.identify(outputs, given)
    # the objects themselves, not their views (nor the caller's tensor the region never saw)
    assert identity.inputs == {0: 0, 3: 2} and identity.held == frozenset() and identity.repeats == {}


def test_tensors_the_region_reaches_by_name_and_repeated_objects_are_named():
    w, b, x = torch.randn(4), torch.randn(4), torch.randn(4)
    row = w[1:]
    identity = output_identity.identify({"w": w, "row": row, "pair": [row, b, x, x]}, {0: x}, Held((w,), (b,)))
    # flattened: w, row, row, b, x, x
    assert identity.held == frozenset({0, 3}) and identity.inputs == {4: 0}
    assert identity.repeats == {2: 1, 5: 4}  # an object twice: the second is the first


def test_outputs_no_graph_can_return_identify_nothing():
    class Odd(dict):
        pass

    assert output_identity.identify(Odd(a=torch.randn(2)), {}) is output_identity.UNKNOWN


def test_owned_outputs_keep_where_their_memory_was_when_recorded():
    buffer = torch.empty(64, dtype=torch.uint8)
    out = torch.empty(0).set_(buffer.untyped_storage(), 2, (4,), (1,))
    other = torch.randn(3)
    address = buffer.data_ptr()
    identity = output_identity.with_memory(output_identity.UNKNOWN, (other, out), {address})
    assert identity.owned == {1: (address, 64)}
    out.resize_(1000)  # a caller moving the memory later changes nothing recorded
    assert buffer.data_ptr() != address and identity.owned == {1: (address, 64)}


@attrs.define
class Capture:
    outputs: object
    staged: dict = attrs.Factory(dict)
    owned_outputs: set = attrs.Factory(set)
    identity: output_identity.OutputIdentity = output_identity.UNKNOWN
    host: object = None


def test_the_recording_call_hands_out_what_a_replay_would_and_never_the_captures_own_objects():
    x, y, w = torch.randn(8), torch.randn(6), torch.randn(5)
    staged = torch.empty(6)  # y's staged buffer: the region saw it
    buffer = torch.empty(16)
    owned = torch.empty(0).set_(buffer.untyped_storage(), 0, (2, 4), (4, 1))
    empty = torch.empty(0, 3)
    outputs = (x, x[:], staged, staged[2:], owned, w[1:], w, empty, owned, DynamicScalar("_d3", 7, "args[3]"))
    given = output_identity.given_objects([x, y, w], {1: staged}, None)
    identity = output_identity.identify(outputs, given, Held((w,)))
    capture = Capture(outputs, {1: staged}, {buffer.data_ptr()}, identity)
    first = output_identity.first_outputs(capture, [x, y, w, 7])
    arg, whole_view, staged_arg, staged_view, mine, global_view, held, fresh_empty, again, scalar = first
    assert arg is x and staged_arg is y and held is w  # as eagerly: the objects themselves
    assert whole_view is not x and whole_view._base is x and torch.equal(whole_view, x)
    assert staged_view._base is y and staged_view.data_ptr() == y.data_ptr() + 8  # a view of the caller's y
    assert mine is not owned and mine.data_ptr() == owned.data_ptr() and again is mine  # one object twice
    assert global_view is not outputs[5] and global_view.data_ptr() == w.data_ptr() + 4
    assert fresh_empty is not empty and fresh_empty.shape == (0, 3) and scalar == 7
    # whatever the caller does to them leaves the capture's own objects as they were
    for value in (whole_view, staged_view, global_view):
        value.unsqueeze_(0)
    mine.t_()
    assert outputs[1].shape == (8,) and outputs[3].shape == (4,) and outputs[4].shape == (2, 4)
    assert outputs[5].shape == (4,) and x.shape == (8,) and w.shape == (5,)


def test_without_identity_every_tensor_is_handed_out_fresh():
    x = torch.randn(4)
    first = output_identity.first_outputs(Capture((x, x)), [x])
    assert first[0] is not x and first[1] is not x and first[0] is not first[1]


def test_one_object_given_for_several_arguments_and_returned_is_noted():
    x, y = torch.randn(4), torch.randn(4)
    identity = output_identity.identify((x, y), {0: x, 1: y, 2: x})
    assert identity.inputs == {0: 0, 1: 1} and identity.same == ((0, 2),)
    assert output_identity.identify((y,), {0: x, 1: y, 2: x}).same == ()  # not returned: nothing to tell


def test_a_tensor_given_memory_of_its_own_is_never_returned_as_itself():
    """A tensor the region made (in the pool) and also stored where it reaches it by name is
    copied into memory the graph owns: the graph writes that, not the stored tensor."""
    made = torch.randn(4)
    identity = output_identity.identify((made,), {}, Held((made,)))
    assert identity.held == frozenset({0})
    buffer = torch.empty(16)
    own = torch.empty(0).set_(buffer.untyped_storage(), 0, (4,), (1,))
    identity = output_identity.with_memory(identity, (own,), {buffer.data_ptr()})
    assert identity.held == frozenset() and identity.owned == {0: (buffer.data_ptr(), 64)}


def test_the_recording_call_hands_out_through_hand_out_only_what_the_graph_writes():
    """``clone_outputs`` and ``check_stale`` touch the memory a replay overwrites, never the
    caller's argument, a global or views of them: the recording call as its replays."""
    x, w = torch.randn(8), torch.randn(5)
    buffer = torch.empty(16)
    owned = torch.empty(0).set_(buffer.untyped_storage(), 0, (2, 4), (4, 1))
    outputs = (x, x[1:], w, w[1:], owned, owned, torch.empty(0))
    identity = output_identity.identify(outputs, output_identity.given_objects([x, w], {}, None), Held((w,)))
    capture = Capture(outputs, {}, {buffer.data_ptr()}, identity)
    first = output_identity.first_outputs(capture, [x, w], torch.Tensor.clone)
    arg, view, held, held_view, mine, again, empty = first
    assert arg is x and held is w and view._base is x and held_view.data_ptr() == w.data_ptr() + 4
    assert again is mine and mine.data_ptr() != owned.data_ptr() and torch.equal(mine, owned)
    assert empty.shape == (0,)
