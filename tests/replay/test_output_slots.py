"""The output slots' bookkeeping on the CPU (replay.output_slots), with real tensors: torch's
storage use count is what tells a held slot from a free one, on the CPU as on the GPU. The
GPU tests (test_output_slots_gpu.py) replay real graphs into them."""

from __future__ import annotations

import gc

import attrs
import pytest
import torch

from replay import output_slots
from replay.output_slots import OutputSlots


class Graph:
    """What a slot knows of a graph: the slot it wrote last."""

    slot = None


def hand_out(slot, dtype=torch.float32, rows=4):
    """An output a replay hands out: a fresh view of the slot."""
    return torch.as_strided(slot.lanes[0].base(dtype), (rows, 2), (2, 1), 0)


def make(**kwargs):
    allocated, changes = [], []

    def allocate(size):
        buffer = torch.empty(size, dtype=torch.uint8)
        allocated.append(size)
        return buffer

    slots = OutputSlots(allocate, changed=lambda: changes.append(len(slots.slots)), **kwargs)
    return slots, allocated, changes


def test_a_graph_keeps_writing_the_slot_it_wrote_last_while_no_other_graph_wrote_it():
    slots, allocated, _ = make()
    g = Graph()
    first = slots.choose(g, (100,))
    slots.wrote(g, first)
    held = hand_out(first)  # its own previous output, held: still its slot (documented rule)
    assert slots.choose(g, (100,)) is first and allocated == [512]
    del held


def test_a_slot_holding_another_graphs_output_is_never_chosen():
    slots, allocated, _ = make()
    g, h = Graph(), Graph()
    a = slots.choose(g, (64,))
    slots.wrote(g, a)
    out = hand_out(a)
    b = slots.choose(h, (64,))
    assert b is not a and len(slots.slots) == 2  # a is held: h gets a new slot
    slots.wrote(h, b)
    del out
    gc.collect()
    assert slots.choose(g, (64,)) is a  # still g's own
    c = slots.choose(Graph(), (64,))  # a third graph: a free slot, no new one
    assert c in (a, b) and allocated == [512, 512]


@pytest.mark.parametrize(
    "hold",
    [
        lambda out: out,  # the tensor itself
        lambda out: out[1:3],  # a view of it, the output dropped
        lambda out: out.view(torch.int32),  # a view with another dtype
        lambda out: out.untyped_storage(),  # its storage
        lambda out: torch.utils.dlpack.to_dlpack(out),  # a DLPack capsule
        lambda out: [out.t()],  # inside a container
    ],
)
def test_anything_still_reaching_an_output_keeps_its_slot_held(hold):
    slots, _, _ = make()
    g, h = Graph(), Graph()
    a = slots.choose(g, (64,))
    slots.wrote(g, a)
    kept = hold(hand_out(a))
    assert a.held()
    assert slots.choose(h, (64,)) is not a
    del kept
    gc.collect()
    assert not a.held() and slots.choose(h, (64,)) is a


def test_the_slots_own_views_and_repeated_storage_reads_do_not_count_as_held():
    slots, _, _ = make()
    a = slots.choose(Graph(), (64,))
    for dtype in (torch.float32, torch.float16, torch.int64, torch.uint8):
        a.lanes[0].base(dtype)
    for _ in range(3):
        a.lanes[0].buffer.untyped_storage()
        hand_out(a).sum()  # handed out and dropped at once
    gc.collect()
    assert not a.held()


def test_spare_free_slots_beyond_one_are_freed_and_small_free_slots_go_when_a_larger_one_comes():
    slots, allocated, changes = make()
    graphs = [Graph() for _ in range(4)]
    outs = []
    for g in graphs:  # four held outputs: four slots
        slot = slots.choose(g, (64,))
        slots.wrote(g, slot)
        outs.append(hand_out(slot))
    assert len(slots.slots) == 4 and len(allocated) == 4
    outs.clear()
    gc.collect()
    chosen = slots.choose(Graph(), (64,))  # all four free: one chosen, one spare kept
    assert len(slots.slots) == 1 + output_slots.SPARE_SLOTS and chosen in slots.slots
    slots.wrote(graphs[0], chosen)
    held = hand_out(chosen)
    big = slots.choose(Graph(), (5000,))  # larger than every slot: the free smaller one goes
    assert big.sizes == (5120,) and len(slots.slots) == 2 and chosen in slots.slots
    assert slots.nbytes() == 512 + 5120 and changes[-1] == 2
    lanes = [lane for slot in slots.slots for lane in slot.lanes]
    assert sorted(slots.ranges()) == sorted([(lane.address, lane.address + lane.size) for lane in lanes])
    del held


def test_a_new_slot_is_at_least_as_large_as_every_slot_so_far():
    slots, allocated, _ = make()
    g = Graph()
    big = slots.choose(g, (4000,))
    slots.wrote(g, big)
    held = hand_out(big)
    small = slots.choose(Graph(), (10,))
    assert small.sizes == big.sizes == (4096,) and allocated == [4096, 4096]
    del held


def test_a_freed_slot_is_never_chosen_again_and_a_forgotten_graph_writes_nothing():
    slots, _, _ = make()
    g = Graph()
    a = slots.choose(g, (64,))
    slots.wrote(g, a)
    slots.forget(g)
    assert a.writer is None
    slots.release()
    assert a.freed and slots.slots == [] and slots.nbytes() == 0
    again = slots.choose(g, (64,))  # its last slot was freed: a new one
    assert again is not a and not again.freed


def test_release_leaves_held_slots_to_their_outputs():
    slots, _, changes = make()
    g = Graph()
    a = slots.choose(g, (64,))
    slots.wrote(g, a)
    out = hand_out(a)
    out.fill_(3.0)
    slots.release()
    assert not a.freed and slots.slots == []  # dropped from the region, kept by the output
    assert changes[-1] == 0  # and the region told (its output memory index, the memory stat)
    assert torch.equal(out, torch.full((4, 2), 3.0))


def test_each_group_of_outputs_gets_a_lane_of_its_own_at_least_as_large_as_any_graphs():
    slots, allocated, _ = make()
    g, h = Graph(), Graph()
    a = slots.choose(g, (3000, 100))  # two groups of outputs sharing memory: two lanes
    assert a.sizes == (3072, 512) and len({lane.address for lane in a.lanes}) == 2
    slots.wrote(g, a)
    held = torch.as_strided(a.lanes[1].base(torch.float32), (2,), (1,), 0)  # only lane 1 held
    b = slots.choose(h, (4000,))  # one group, larger: a new slot, lane by lane the largest
    assert b is not a and b.sizes == (4096, 512) and allocated == [3072, 512, 4096, 512]
    assert a.fits((3000, 100)) and not a.fits((3000, 100, 1)) and not a.fits((4000,))
    del held


def test_template_views_are_the_slots_own_and_their_detached_copies_are_held():
    slots, _, _ = make()
    g = Graph()
    a = slots.choose(g, (64,))
    outputs = [(0, torch.float32, (4, 2), (2, 1), 0), (0, torch.float16, (8,), (1,), 16)]
    templates = a.views_for(g, outputs)
    assert a.views_for(g, outputs) == templates and not a.held()  # made once, the slot's own
    assert templates[1].storage_offset() == 16 and templates[0].shape == (4, 2)
    out = templates[0].detach()  # what a replay hands out
    assert a.held()
    del out
    assert not a.held()
    g.bound_slot, g.views = a, templates
    slots.forget(g)  # released: its templates go (once nothing else refers to them)
    del templates
    g.views = None
    gc.collect()
    assert not a.held() and a.templates == {}
    g.bound_slot, g.views = a, a.views_for(g, outputs)
    a.free()  # a freed slot unbinds the graphs whose copies point at it
    assert g.bound_slot is None and g.views is None and a.freed


def test_a_free_slot_the_graphs_copies_already_point_at_is_chosen_first():
    # shapes taking turns, each output dropped at once: every graph keeps writing one slot,
    # with no node update (the copies' destinations stay)
    slots, _, _ = make()
    g, h = Graph(), Graph()
    for graph in (g, h):
        graph.bound_slot = None
    a = slots.choose(g, (64,))
    slots.wrote(g, a)
    g.bound_slot = a
    b = slots.choose(h, (64,))
    assert b is a  # free: shared
    slots.wrote(h, b)
    h.bound_slot = b
    extra = slots._new((64,), [])  # another free slot, listed after a
    assert slots.choose(g, (64,)) is a  # h wrote a last, but a is free and g's copies point there
    held = hand_out(a)
    assert slots.choose(g, (64,)) is extra  # held by h's output now: another one
    del held


def test_slots_of_one_mode_are_never_chosen_for_the_other():
    """A slot's buffers are tensors of the mode they were allocated in: an inference tensor
    cannot be saved for backward, so a free inference slot is never given to a no_grad replay
    (and a normal one never to an inference replay, whose eager outputs are inference tensors)."""
    slots, allocated, _ = make()
    g, h = Graph(), Graph()
    with torch.inference_mode():
        a = slots.choose(g, (64,))
        slots.wrote(g, a)
    assert a.inference and a.lanes[0].buffer.is_inference()
    b = slots.choose(h, (64,))  # a is free, but of the other mode
    assert b is not a and not b.inference and not b.lanes[0].buffer.is_inference()
    slots.wrote(h, b)
    with torch.inference_mode():
        assert slots.choose(Graph(), (64,)) is a
    assert slots.choose(Graph(), (64,)) is b and allocated == [512, 512]


@pytest.mark.parametrize(
    "resize",
    [
        lambda out: out.resize_(1000),
        lambda out: out.untyped_storage().resize_(0),
        lambda out: (out.resize_(1), out.resize_(1000)),
    ],
)
def test_a_slot_whose_storage_a_caller_moved_is_dropped_and_never_freed_or_chosen(resize):
    slots, _, changes = make()
    g = Graph()
    a = slots.choose(g, (64,))
    slots.wrote(g, a)
    out = hand_out(a)
    resize(out)
    assert a.moved()
    again = slots.choose(g, (64,))  # even its own last slot: its memory is the storage's now
    assert again is not a and a.freed and a not in slots.slots and a.lanes[0].storage is None
    assert changes and out.untyped_storage() is not None  # the caller's tensor keeps its memory


def test_a_lane_knows_where_its_memory_is_by_address_and_size():
    slots, _, _ = make()
    lane = slots.choose(Graph(), (64,)).lanes[0]
    assert not lane.moved()
    lane.size += 512  # (as if its storage came back at the same address with another size)
    assert lane.moved()
    lane.size -= 512
    lane.address += 1
    assert lane.moved()


def test_a_reader_is_noted_for_any_tensor_over_a_watched_lanes_storage_and_nothing_else():
    slots, _, _ = make()
    g = Graph()
    a = slots.choose(g, (64,))
    output_slots._watch(a.lanes[0])  # (the CPU's lanes are not watched of themselves)
    out = hand_out(a)
    s1, s2 = object(), object()
    output_slots.note_reader(out.view(torch.int32)[1:], s1)
    output_slots.note_reader(out, s1)
    output_slots.note_reader(torch.randn(4), s2)  # memory of its own
    output_slots.note_reader(out.clone(), s2)
    assert a.readers == [s1]
    output_slots.note_reader(out, s2)
    assert a.readers == [s1, s2]
    a.free()  # forgotten with its memory
    assert a.readers == [] and output_slots._WATCHED.get(a.lanes[0].address) is None


def test_the_record_stream_wrapper_is_torchs_call_first(monkeypatch):
    """Installed once, transparent: torch's own call first (its error, if any, before anything
    is noted), then the note."""
    monkeypatch.setattr(torch.Tensor, "record_stream", output_slots._RECORD_STREAM)
    output_slots.watch_record_stream()
    output_slots.watch_record_stream()
    assert torch.Tensor.record_stream is output_slots._record_stream
    assert torch.Tensor.record_stream.__name__ == "record_stream" and torch.Tensor.record_stream.__doc__
    slots, _, _ = make()
    a = slots.choose(Graph(), (64,))
    output_slots._watch(a.lanes[0])
    out = hand_out(a)
    with pytest.raises(Exception) as torchs:
        output_slots._RECORD_STREAM(out, object())
    with pytest.raises(type(torchs.value), match=str(torchs.value)):
        out.record_stream(object())  # not a stream: torch's error, and nothing noted
    assert a.readers == []
    noted = []
    monkeypatch.setattr(output_slots, "_RECORD_STREAM", lambda tensor, stream: noted.append(stream))
    stream = object()
    out.record_stream(stream)
    assert noted == [stream] and a.readers == [stream]


class FreshStorage:
    """A tensor as a torch that keeps no Python object per storage hands it out: each
    ``untyped_storage()`` is a new object over the same memory (here a new storage, too)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def untyped_storage(self) -> torch.UntypedStorage:
        storage = self.tensor.untyped_storage()
        return torch._C._construct_storage_from_data_pointer(storage.data_ptr(), storage.device, storage.nbytes())


class Span:
    """Anything with a storage at ``start``, ``nbytes`` long (memory no tensor here owns)."""

    def __init__(self, start: int, nbytes: int) -> None:
        self.start, self.bytes = start, nbytes

    def untyped_storage(self) -> Span:
        return self

    def data_ptr(self) -> int:
        return self.start

    def nbytes(self) -> int:
        return self.bytes


def watched_slot():
    slots, _, _ = make()
    slot = slots.choose(Graph(), (64,))
    output_slots._watch(slot.lanes[0])  # (the CPU's lanes are not watched of themselves)
    return slot


@pytest.mark.parametrize(
    "reach",
    [
        FreshStorage,  # the storage's Python object new at each call
        lambda out: torch.from_dlpack(out),  # another storage over the same memory
        lambda out: torch.from_dlpack(out[1:]),  # one starting inside the lane
        lambda out: FreshStorage(out.view(torch.int32)[2:]),
    ],
    ids=["a new storage object each time", "a DLPack round trip", "a DLPack view inside", "a view, new objects"],
)
def test_a_reader_is_noted_by_address_whatever_python_object_the_storage_is(reach):
    slot = watched_slot()
    out = hand_out(slot)
    tensor = reach(out)
    assert tensor.untyped_storage() is not slot.lanes[0].storage  # (what this test is about)
    reader = object()
    output_slots.note_reader(tensor, reader)
    output_slots.note_reader(reach(out), reader)  # the same stream again: noted once
    assert slot.readers == [reader]


def test_no_reader_is_noted_for_memory_a_live_lane_does_not_hold():
    slot = watched_slot()
    lane = slot.lanes[0]
    start, end = lane.address, lane.address + lane.size
    for outside in [Span(start - 64, 64), Span(end, 64), Span(start, lane.size + 1), Span(end - 8, 16), Span(start, 0)]:
        output_slots.note_reader(outside, object())
    assert slot.readers == []
    assert output_slots.watched_lane(start, lane.size) is lane and output_slots.watched_lane(end - 8, 8) is lane


def test_a_moved_lanes_old_memory_notes_no_reader():
    """A caller resized the storage: the memory at the lane's old address is the allocator's,
    and a tensor there now is none of the slot's business."""
    slot = watched_slot()
    lane = slot.lanes[0]
    address, size = lane.address, lane.size
    out = hand_out(slot)
    out.untyped_storage().resize_(4096)
    assert lane.moved()
    output_slots.note_reader(Span(address, size), object())
    output_slots.note_reader(out, object())  # the storage itself, moved: not the lane's memory any more
    assert slot.readers == [] and output_slots.watched_lane(address, size) is None


def test_the_watched_addresses_stay_sorted_and_go_with_their_lanes():
    gc.collect()
    slots, _, _ = make()
    before = list(output_slots._STARTS)
    lanes = [slots.choose(Graph(), (64,)).lanes[0]]
    lanes.append(OutputSlots(lambda size: torch.empty(size, dtype=torch.uint8)).choose(Graph(), (2048,)).lanes[0])
    for lane in lanes:
        output_slots._watch(lane)
        output_slots._watch(lane)  # twice: one entry
    assert output_slots._STARTS == sorted(output_slots._STARTS) == sorted(set(output_slots._STARTS))
    assert set(output_slots._STARTS) == set(output_slots._WATCHED)
    assert all(output_slots.watched_lane(lane.address + 1, 8) is lane for lane in lanes)
    output_slots._unwatch(lanes[0])
    del lanes[1:], lane  # the last references: forgotten by its weak reference
    gc.collect()
    assert output_slots._STARTS == before and set(output_slots._STARTS) == set(output_slots._WATCHED)


class FakeStream:
    """A CUDA stream object as the wait sees it (its raw handle, what was waited for on it)."""

    def __init__(self, cuda_stream: int = 0, **ids) -> None:
        self.cuda_stream, self.ids, self.waited = cuda_stream, ids, []

    def wait_event(self, event) -> None:
        self.waited.append(event)


class FakeEvent:
    def record(self, stream) -> None:
        self.stream = stream


def fake_cuda_streams(monkeypatch, default_handle: int = 0) -> tuple[FakeStream, list]:
    """torch.cuda's stream constructors as doubles: the default stream, and the handles handed to
    ExternalStream."""
    default, external = FakeStream(default_handle), []

    def external_stream(handle, device=None):
        external.append((handle, device, FakeStream(handle)))
        return external[-1][2]

    monkeypatch.setattr(torch.cuda, "default_stream", lambda device=None: default)
    monkeypatch.setattr(torch.cuda, "ExternalStream", external_stream)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return default, external


def test_a_raw_handle_of_0_is_the_default_stream_not_a_new_one(monkeypatch):
    """torch.cuda.ExternalStream(0) is a new stream of torch's pool (0 reads as "no handle"):
    waiting there orders nothing the default stream does."""
    default, external = fake_cuda_streams(monkeypatch)
    assert output_slots.torch_stream(0, 0) is default and external == []
    made = output_slots.torch_stream(77, 1)
    assert external == [(77, 1, made)] and made.cuda_stream == 77
    default.cuda_stream = 2  # (a torch whose default stream is the per-thread one)
    with pytest.raises(RuntimeError, match="handle 0"):
        output_slots.torch_stream(0, 0)


def test_the_write_stream_waits_for_each_reader_but_itself_then_forgets_them(monkeypatch):
    default, _ = fake_cuda_streams(monkeypatch)
    reader, itself = FakeStream(55), FakeStream(0)
    generic = attrs.make_class("Generic", ["stream_id", "device_index", "device_type"])(3, 0, 1)  # a torch.Stream
    readers = [reader, itself, generic]
    output_slots.wait_for_readers(readers, 0, 0)
    assert readers == [] and len(default.waited) == 2
    assert default.waited[0].stream is reader
    assert default.waited[1].stream.ids == {"stream_id": 3, "device_index": 0, "device_type": 1}


def test_the_sessions_stream_switch_orders_the_new_stream_after_the_default_one(monkeypatch):
    """Replays of a session share its pool: one on a new stream waits for the last one on the
    previous stream, the default stream (handle 0) included, through torch_stream."""
    import replay

    default, external = fake_cuda_streams(monkeypatch)
    session = replay.capture()
    session.last_stream[0] = 0
    session.stream_switch(77)
    ((handle, _device, side),) = external
    assert handle == 77 and len(side.waited) == 1 and side.waited[0].stream is default
    session.stream_switch(0)
    assert len(default.waited) == 1 and default.waited[0].stream.cuda_stream == 77 and session.last_stream == [0]
