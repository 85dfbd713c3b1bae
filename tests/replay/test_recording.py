"""Recording helpers that need no GPU (the captures themselves are tested on the GPU)."""

from __future__ import annotations

import collections
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from replay.recording import _first_line


def test_a_failure_without_a_message_still_has_a_reason():
    # a capture that fails with an exception whose message is empty must still end in a
    # ReplayWarning naming something, never an IndexError that hides the eager fallback
    assert _first_line(RuntimeError("")) == "RuntimeError"
    assert _first_line(RuntimeError("   \n  ")) == "RuntimeError"
    assert _first_line(RuntimeError("first\nsecond")) == "first"


def _record(args, params, dynamic_config=(), checks=(), launched=True):
    from jitcore.backends.abi import ParamLayout, parse_param
    from jitcore.recorder import LaunchRecord

    layout = ParamLayout.of([parse_param("float* x")])
    return LaunchRecord(
        jit_function="f",
        kernel="k<float>",
        function=0xABC,
        device=0,
        grid=(4, 1, 1),
        block=(64, 1, 1),
        shared_bytes=0,
        layout=layout,
        param_bytes=bytes(8),
        params=params,
        args=args,
        stream=0,
        launched=launched,
        dynamic_config=dynamic_config,
        checks=checks,
    )


class _JitScalar:
    def __jit_scalar__(self):
        return 7


def test_launch_views_carry_every_kind_of_argument_and_each_record_once():
    # every argument kind a kept record holds: a dropped tensor (None), a dynamic scalar
    # (its source, constants and index), plain numbers and objects with __jit_scalar__
    # (bound by a fresh name, never by repr), with configs and checks passed through
    import math

    from jitcore.recorder import CheckRecord, ConfigRecord, ParamRecord
    from replay.dynamic import DynamicScalar
    from replay.recording import launch_views

    pointer = ParamRecord(index=0, name="x", offset=0, size=8, fmt="Q", kind="pointer", arg_index=0, byte_offset=16)
    scalar = ParamRecord(index=1, name="s", offset=8, size=4, fmt="f", kind="scalar", scalar_args=(1,), evaluate=abs)
    config = ConfigRecord("grid_x", [1], abs, "{1}")
    check = CheckRecord([2], abs, len, "{2}")
    d = DynamicScalar("(_d0 + _k9)", 3, "n", {"_k9": 2})
    first = _record((None, d, 2.5, math.nan, _JitScalar(), True), (pointer, scalar), (config,), (check,))
    second = _record((None, None), (pointer,), launched=False)
    views = launch_views([first, second], [11, None], {1: 0})
    a, b = views
    assert [p.kind for p in a.params] == ["pointer", "scalar"] and a.params[0].byte_offset == 16
    assert a.params[1].evaluate is abs and a.params[1].scalar_args == (1,)
    assert b.params[0] is a.params[0]  # one view per parameter record
    assert a.dynamic_args == {1} and a.scalar_sources[1] == "(_d0 + _k9)"
    assert set(a.scalar_sources) == {1, 2, 3, 4, 5}
    names = [a.scalar_sources[k] for k in (2, 3, 4, 5)]
    assert all(n.startswith("_lit") for n in names) and len(set(names)) == 4
    values = [a.constants[n] for n in names]
    assert values[0] == 2.5 and math.isnan(values[1]) and values[2] == 7 and values[3] is True
    assert a.constants["_k9"] == 2
    assert [(c.field, c.scalar_args, c.evaluate, c.expression) for c in a.config] == [("grid_x", (1,), abs, "{1}")]
    assert [(c.scalar_args, c.value, c.size) for c in a.checks] == [((2,), abs, len)]
    assert (a.node, a.staging_input, a.launched) == (11, None, True)
    assert (b.node, b.staging_input, b.launched) == (None, 0, False)
    assert b.scalar_sources == {} and b.constants == {} and b.config == () and b.checks == ()
    assert (a.function, a.kernel, a.param_bytes) == (0xABC, "k<float>", bytes(8))


def test_launches_sharing_a_params_tuple_share_its_views_and_plain_numbers_are_bound_by_name():
    # jit call states hand out one params tuple for launches whose pointers sit at the same
    # offsets: its views are made once; an equal tuple of the same records gets equal views
    from jitcore.recorder import ParamRecord
    from replay.recording import launch_views

    pointer = ParamRecord(index=0, name="x", offset=0, size=8, fmt="Q", kind="pointer", arg_index=0, byte_offset=0)
    scalar = ParamRecord(index=1, name="s", offset=8, size=4, fmt="f", kind="scalar", scalar_args=(1,), evaluate=abs)
    shared = (pointer, scalar)
    a, b, c = launch_views(
        [_record((None, 4, -0.0), shared), _record((None, 2**70, 1.5), shared), _record((None, 1), (pointer, scalar))]
    )
    assert a.params is b.params and c.params == a.params and c.params[0] is a.params[0]
    for view, values in ((a, (4, -0.0)), (b, (2**70, 1.5))):
        names = [view.scalar_sources[k] for k in (1, 2)]
        assert all(n.startswith("_lit") for n in names)
        got = [view.constants[n] for n in names]
        assert got == list(values) and [type(v) for v in got] == [type(v) for v in values]
    assert str(a.constants[a.scalar_sources[2]]) == "-0.0"  # the value itself, sign included


class _RaisingAttribute:
    def __getattr__(self, name):
        raise KeyError(name)  # not an AttributeError: hasattr lets it through, as must the C rule


@pytest.mark.parametrize("native", ["c", "python"])
def test_records_keep_the_arguments_analysis_needs_and_no_tensor(native, monkeypatch):
    """records_without_tensors, in C (jitcore.backends._native.without_tensors) or Python
    (JITCORE_NATIVE=0): scalar_or_none of each argument, every other field the same object."""
    import numpy as np
    import torch

    from replay.dynamic import DynamicScalar
    from replay.recording import records_without_tensors, scalar_or_none

    if native == "python":
        monkeypatch.setenv("JITCORE_NATIVE", "0")
    else:
        pytest.importorskip("jitcore.backends._native")
    d = DynamicScalar("_d0", 3, "n")
    parameter = torch.nn.Parameter(torch.randn(2))
    arguments = (torch.randn(3), parameter, 2, 2.5, True, d, _JitScalar(), None, "text", np.float32(1.5), 2**80)
    records = [_record(arguments, ()), _record((), ()), _record((torch.randn(1), 7), ())]
    kept = records_without_tensors(records)
    assert len(kept) == len(records)
    for record, copy in zip(records, kept):
        assert type(copy) is type(record)
        assert copy.args == tuple(map(scalar_or_none, record.args))
        assert [type(a) for a in copy.args] == [type(scalar_or_none(a)) for a in record.args]
        for name in record._fields:
            if name != "args":
                assert getattr(copy, name) is getattr(record, name)
    assert kept[0].args[5] is d and kept[0].args[1] is None
    with pytest.raises(KeyError):
        records_without_tensors([_record((_RaisingAttribute(),), ())])


def test_pointer_extents_name_the_tensors_that_are_not_the_input_itself():
    """Per record: the byte range of each pointer's jit argument where it points into an input
    and is not that input tensor (a view of it, a global holding it); nothing for the input
    itself, for pointers outside every input, or for scalars."""
    import struct

    import torch

    from jitcore.recorder import ParamRecord
    from replay import rebinding
    from replay.recording import InputDoubt, pointer_extents
    from replay.region_keys import byte_range

    cache = torch.randn(4, 8)
    row = cache[0]
    inner = row[2:6]
    elsewhere = torch.randn(16)
    inputs = [rebinding.InputRange(0, "args[0]", *byte_range(row))]

    def record(*tensors):
        params = tuple(
            ParamRecord(index=i, name=None, offset=8 * i, size=8, fmt="Q", kind="pointer", arg_index=i)
            for i in range(len(tensors))
        )
        data = b"".join(struct.pack("<Q", t.data_ptr()) for t in tensors)
        return _record_with(tensors, params, data)

    records = [record(row, inner), record(cache, elsewhere), record(elsewhere)]
    extents = pointer_extents(records, inputs, [row])
    assert extents == [{1: rebinding.Extent(*byte_range(inner))}, {0: rebinding.Extent(*byte_range(cache))}, {}]
    assert pointer_extents(records, [], [row]) == [{}, {}, {}]

    # an input another tensor held when the call began: pointers from other tensors carry the
    # doubt, the input's own pointers do not; an input a global holds: every pointer into it
    some, every = InputDoubt("shared", itself=False), InputDoubt("a global", itself=True)
    doubted = pointer_extents(records, inputs, [row], {0: some})
    assert doubted == [
        {1: rebinding.Extent(*byte_range(inner), "shared")},
        {0: rebinding.Extent(*byte_range(cache), "shared")},
        {},
    ]
    doubted = pointer_extents(records, inputs, [row], {0: every})
    assert doubted[0] == {
        0: rebinding.Extent(*byte_range(row), "a global"),
        1: rebinding.Extent(*byte_range(inner), "a global"),
    }
    assert doubted[2] == {}

    # the edges of the inputs' span: one past an input's last byte is outside it, but an empty
    # input sits exactly at its address (inputs_at's two rules, which the quick span test keeps)
    after = cache[1]  # starts one past row's last byte
    empty = rebinding.InputRange(1, "args[1]", after.data_ptr(), after.data_ptr())
    at_end = [record(after), record(cache[0, :1])]
    first = rebinding.Extent(*byte_range(cache[0, :1]))
    assert pointer_extents(at_end, inputs, [row]) == [{}, {0: first}]
    assert pointer_extents(at_end, [*inputs, empty], [row]) == [{0: rebinding.Extent(*byte_range(after))}, {0: first}]


def test_input_doubts_name_the_inputs_whose_memory_another_tensor_or_the_region_holds():
    """Taken before the region runs: a tensor alone (whole or freshly made) is in no doubt; a
    row of a tensor that lives on, a tensor with a view the caller keeps, or one a detached
    alias shares, is (for pointers other tensors give); the very tensor a global of the
    region holds is, for every pointer. The check reads torch's own count of the storage's
    holders, so it is tested on every kind of holder rather than on one case."""
    import torch

    from replay.recording import HeldTensors, input_doubts

    alone, fresh = torch.randn(4, 8), torch.randn(4, 8)[1].clone()
    base = torch.randn(4, 8)
    row = base[1]
    kept = torch.randn(16)
    kept_view = kept[2:]  # noqa: F841 (kept alive: the caller holds a view)
    aliased = torch.randn(16)
    alias = aliased.detach()
    held = torch.randn(8)
    tensors = {0: alone, 1: fresh, 2: row, 3: kept, 4: aliased, 5: held}
    doubts = input_doubts(tensors, HeldTensors(named=[held, torch.randn(3)]))
    assert set(doubts) == {2, 3, 4, 5}
    assert [doubts[i].itself for i in (2, 3, 4, 5)] == [False, False, False, True]
    assert "reads by name" in doubts[5].reason and "other than the argument" in doubts[2].reason
    assert input_doubts({0: alone, 1: fresh}) == {}
    del base  # the row alone still holds its base alive: still in doubt
    assert set(input_doubts({2: row})) == {2}

    class Unreadable(torch.Tensor):  # a storage torch will not hand out: in doubt
        def untyped_storage(self):
            raise RuntimeError("no storage of its own")

    odd = torch.randn(3).as_subclass(Unreadable)
    assert set(input_doubts({0: odd})) == {0} and not input_doubts({0: odd})[0].itself

    # a tensor the region reaches by name over the input's bytes through a storage of its own
    # (a DLPack alias: torch's count of the storage's holders does not see it)
    source, elsewhere = torch.randn(16), torch.randn(16)
    alias = torch.from_dlpack(source)
    assert input_doubts({0: source}) == {}
    assert set(input_doubts({0: source, 1: elsewhere}, HeldTensors(named=[alias]))) == {0}
    assert set(input_doubts({0: source[4:8].clone()}, HeldTensors(named=[alias]))) == set()  # a copy lies elsewhere

    # a module's parameters and buffers: by identity alone (a DLPack alias of one is not read)
    parameter = torch.randn(6)
    attributes = HeldTensors(attributes=[parameter, torch.from_dlpack(source)])
    doubts = input_doubts({0: parameter, 1: source}, attributes)
    assert set(doubts) == {0} and doubts[0].itself

    # a search of what the region reads by name cut short: any argument may be among the rest,
    # even a tensor alone, even for pointers it gave itself (the capture refuses it)
    doubts = input_doubts({0: alone, 1: row, 2: held}, HeldTensors(named=[held], complete=False))
    assert set(doubts) == {0, 1, 2} and all(d.itself for d in doubts.values())
    assert "more values by name" in doubts[0].reason


@settings(max_examples=300, deadline=None)
@given(
    ranges=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 40)), max_size=12),
    probe=st.tuples(st.integers(0, 240), st.integers(0, 40)),
)
def test_byte_ranges_answer_overlap_as_a_walk_over_every_range_would(ranges, probe):
    """The bisection input_doubts asks of the tensors a region reaches by name: any range
    overlapping [lo, hi), empty ranges (and an empty probe) overlapping nothing."""
    from replay.recording import _ByteRanges

    spans = [(lo, lo + size) for lo, size in ranges]
    lo, hi = probe[0], probe[0] + probe[1]
    expected = hi > lo and any(a < hi and lo < b for a, b in spans if b > a)
    assert _ByteRanges(spans)(lo, hi) is expected


def _record_with(args, params, data):

    return _record(args, params).replace(param_bytes=data)


def test_a_staged_input_reached_through_other_memory_refuses_the_capture():
    """A staged input (a copy of the caller's tensor) whose caller storage the region also
    reaches otherwise: a torch op seen in that storage (observer ranges after ``watched``) or
    a jit pointer into it. Refused, naming the input; a storage that is the input's own, an
    observation of the input's range alone, and pointers elsewhere pass."""
    import struct

    import pytest
    import torch

    from jitcore.recorder import ParamRecord
    from replay.recording import (
        CaptureFailed,
        _CaptureInputs,
        _refuse_staged_inputs_reached_otherwise,
        _storages_beyond,
        input_ranges,
    )
    from replay.region_keys import byte_range

    cache, own, other = torch.randn(4, 8), torch.randn(8), torch.randn(16)
    tensors = {0: cache[1], 1: own}
    staged = {0: torch.empty(8), 1: torch.empty(8)}
    inputs = input_ranges(tensors, ["args[0]", "args[1]"])
    watched = [(r.lo, r.hi) for r in inputs] + [byte_range(b) for b in staged.values()]
    storages = _storages_beyond(tensors, staged, {})
    storage = cache.untyped_storage()
    assert storages == {0: (storage.data_ptr(), storage.data_ptr() + storage.nbytes())}  # own's is its own
    # a whole tensor another tensor held when the call began (a global over the same memory):
    # its storage is watched too, though it holds nothing beyond the input
    assert _storages_beyond(tensors, staged, {1: None}) == {**storages, 1: byte_range(own)}
    prepared = _CaptureInputs(tensors, inputs, staged, watched, [0, 1, 0, 1], None, storages)
    assert prepared.observed_ranges() == [*watched, storages[0]]
    first = len(watched)

    def observation(read=(), written=()):
        return type("Seen", (), {"read": set(read), "written": set(written)})()

    def pointing_at(*pointed):
        params = tuple(
            ParamRecord(index=i, name=None, offset=8 * i, size=8, fmt="Q", kind="pointer", arg_index=i)
            for i in range(len(pointed))
        )
        return _record_with(pointed, params, b"".join(struct.pack("<Q", t.data_ptr()) for t in pointed))

    _refuse_staged_inputs_reached_otherwise(prepared, observation(read=range(first)), [pointing_at(other, own)])
    for seen, records in (
        (observation(read=[first]), []),
        (observation(written=[first]), []),
        (observation(), [pointing_at(other, cache[3])]),
    ):
        with pytest.raises(CaptureFailed, match=r"args\[0\] must be staged .* another tensor"):
            _refuse_staged_inputs_reached_otherwise(prepared, seen, records)
    assert prepared.leaves_seen(range(first + 1)) == set()  # (both inputs staged; the storage's range ignored)


def test_pool_segments_never_hand_a_pool_id_to_a_snapshot_that_takes_its_references(monkeypatch):
    """torch 2.11's one-pool snapshot frees a reference of each number of the pool's id. The
    probe (numbers of its own, once per process) finds it, and from then on pool_segments asks
    the one-pool snapshot with copies of the id's numbers and gives back what it took; where
    a copy cannot be an object of our own (a small number, on a Python where they are not
    immortal), it filters the whole snapshot by each segment's pool instead. Where the
    one-pool snapshot takes nothing, it is asked with the pool's id itself. Stand-ins for
    torch's snapshot, one that takes a reference the way torch's does (through the C API) and
    one that does not; the process would crash later if anything taken were not given back."""
    import ctypes
    import sys

    import torch

    from replay import recording

    big = 299 + int("1")  # 300, made at run time: an object of its own
    segments = [
        {"device": 0, "address": 0x1000, "total_size": 512, "segment_pool_id": (0, big)},
        {"device": 0, "address": 0x9000, "total_size": 256, "segment_pool_id": (0, 7)},
        {"device": 1, "address": 0x5000, "total_size": 128, "segment_pool_id": (0, big)},
        {"device": 0, "address": 0x7000, "total_size": 64, "segment_pool_id": (big + 1000, big)},
    ]

    def snapshot(takes):
        calls = []

        def memory_snapshot(mempool_id=None, include_traces=True):
            calls.append(mempool_id)
            if mempool_id is None:
                return segments
            if takes:
                for number in mempool_id:
                    ctypes.pythonapi.Py_DecRef(ctypes.py_object(number))
            return [s for s in segments if s["segment_pool_id"] == tuple(mempool_id)]

        return memory_snapshot, calls

    small_immortal = sys.version_info >= (3, 12)
    for pool, expected in (((0, big), [(0x1000, 512)]), ((big + 1000, big), [(0x7000, 64)])):
        copied = small_immortal or min(pool) > 256  # else the whole snapshot is filtered
        for takes in (True, False):
            fake, calls = snapshot(takes)
            monkeypatch.setattr(torch.cuda, "memory_snapshot", fake)
            monkeypatch.setattr(recording, "_SNAPSHOT_TAKES_POOL_IDS", [])
            assert recording.pool_segments(0, pool) == expected
            held = [sys.getrefcount(n) for n in pool]  # (known_pool_bytes keeps the id too)
            for _ in range(4):
                assert recording.pool_segments(0, pool) == expected
            assert recording.known_pool_bytes(0, pool) == sum(size for _, size in expected)
            now = [sys.getrefcount(n) for n in pool]  # (read outside an assert: pytest's rewrite holds operands)
            assert now == held
            probe, *rest = calls
            assert probe is not None and tuple(probe) != pool and min(probe) > 2**52
            probe_refs = sys.getrefcount(probe[0])
            assert probe_refs == 2  # calls and this call's argument: nothing taken
            if not takes:
                assert rest == [pool] * 5  # the pool's own id
            elif not copied:
                assert rest == [None] * 5  # the whole snapshot
            else:
                assert rest == [pool] * 5 and all(c is not p for c in rest for c, p in zip(c, pool) if p > 256)
                copy_refs = [sys.getrefcount(c[1]) for c in rest]
                assert copy_refs == [2] * 5  # calls and this call's argument: nothing taken
            assert recording._one_pool_snapshot_takes_its_ids() is takes


def test_a_pool_is_walked_again_only_when_the_allocator_mapped_or_freed_a_segment(monkeypatch):
    """current_pool_segments: the segments last measured while the allocator's counts of
    device allocations and frees are those read before that measurement, else a snapshot;
    always a snapshot where torch gives no counts. Stand-ins for torch's statistics and
    one-pool snapshot."""
    import torch

    from replay import recording

    pool = (0, 123456789)
    held = [(0x1000, 512)]
    stats = {"num_device_alloc": 4, "num_device_free": 1}
    walks = []

    def memory_snapshot(mempool_id=None, include_traces=True):
        walks.append(mempool_id)
        return [{"device": 0, "address": a, "total_size": n} for a, n in held]

    monkeypatch.setattr(torch.cuda, "memory_snapshot", memory_snapshot)
    monkeypatch.setattr(recording, "_SNAPSHOT_TAKES_POOL_IDS", [False])
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda device: dict(stats), raising=False)
    assert recording.current_pool_segments(0, pool) == ([(0x1000, 512)], True)
    assert recording.current_pool_segments(0, pool) == ([(0x1000, 512)], False)
    assert recording.pool_bytes(0, pool) == 512 and len(walks) == 1
    held.append((0x9000, 2048))  # a capture grew the pool: one more device allocation
    stats["num_device_alloc"] += 1
    assert recording.current_pool_segments(0, pool) == ([(0x1000, 512), (0x9000, 2048)], True)
    assert recording.known_pool_bytes(0, pool) == 2560 and len(walks) == 2
    stats["num_device_free"] += 1  # another pool's segment freed: walked again, the same
    assert recording.current_pool_segments(0, pool)[1] is True and len(walks) == 3
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda device: {}, raising=False)  # a torch without them
    for _ in range(2):
        assert recording.current_pool_segments(0, pool)[1] is True
    assert len(walks) == 5
    recording._forget_pool(0, pool)


def test_an_output_outside_the_pool_known_takes_a_snapshot_before_own_outputs_decide(monkeypatch):
    """Segments known are the pool's whatever the allocator's counts say: an output inside
    them is decided without a walk; one outside them and outside the inputs (a segment the
    pool gained without the counts saying so, or a global) is decided by a snapshot."""
    from replay import recording

    walks = []
    monkeypatch.setattr(recording, "pool_segments", lambda device, pool: walks.append(pool) or [(0x8000, 0x100)])

    inside, outside = torch.empty(4), torch.empty(4)
    ranges = {id(inside): (0x1000, 0x1010), id(outside): (0x8000, 0x8010)}
    monkeypatch.setattr(recording, "byte_range", lambda t: ranges[id(t)])
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    known = [(0x1000, 0x2000)]
    assert recording._pool_memory_holding((inside, 3), [], 0, (0, 1), known, False) is known
    assert recording._pool_memory_holding(outside, [], 0, (0, 1), known, True) is known  # measured just now
    assert recording._pool_memory_holding(outside, [(0x8000, 0x8010)], 0, (0, 1), known, False) is known  # an input
    assert walks == []
    assert recording._pool_memory_holding({"y": outside}, [], 0, (0, 1), known, False) == [(0x8000, 0x8100)]
    assert walks == [(0, 1)]

    class ModelOutput(collections.OrderedDict):  # a result no graph returns: left to own_outputs' refusal
        pass

    for result in (ModelOutput(y=outside), {inside: outside}):
        assert recording._pool_memory_holding(result, [], 0, (0, 1), known, False) is known
    prepared = types.SimpleNamespace(watched=[], host_ranges=list)
    resets = []
    for result in (ModelOutput(y=outside), {inside: outside}):
        with pytest.raises(recording.CaptureFailed, match="a dict subclass|keyed by a tensor"):
            recorded = types.SimpleNamespace(outputs=result)
            graph = types.SimpleNamespace(reset=lambda: resets.append(1))
            recording._give_outputs_their_own_memory(recorded, prepared, graph, known, None, None, 0)
    assert resets == [1, 1]  # nothing of the capture left behind


class _CopyBackend:
    """A backend that adds copy nodes (``added``) or, with ``adds=False``, only captures them
    into the graph (``captured``: the copies made inside its capture_into)."""

    def __init__(self, adds: bool = True) -> None:
        self.adds, self.added, self.captured, self.capturing = adds, [], [], False

    def append_copies(self, raw_graph, copies, device):
        if not self.adds:
            raise NotImplementedError("no copy nodes here")
        self.added.append((raw_graph, list(copies), device))

    def capture_into(self, raw_graph, raw_stream):
        import contextlib

        @contextlib.contextmanager
        def capturing():
            self.capturing = True
            yield
            self.capturing = False

        self.captured.append((raw_graph, raw_stream))
        return capturing()


def test_the_outputs_copies_are_added_as_nodes_where_the_backend_can_else_captured():
    """The (destination, source) byte copies own_outputs makes: flat (destination, source,
    bytes) copies the backend adds after every node, or, where it cannot, the same copies
    captured into the graph; nothing for no copies."""
    from types import SimpleNamespace

    from replay import recording

    graph, stream = SimpleNamespace(raw_cuda_graph=lambda: 0x6000), SimpleNamespace(cuda_stream=0xBEEF)
    source = torch.arange(24, dtype=torch.uint8)
    copies = [(torch.zeros(16, dtype=torch.uint8), source[:16]), (torch.zeros(4, dtype=torch.uint8), source[20:])]
    adding = _CopyBackend()
    recording._append_copies(copies, adding, graph, stream)
    flat = [(d.data_ptr(), s.data_ptr(), d.nbytes) for d, s in copies]
    assert adding.added == [(0x6000, flat, None)] and adding.captured == []
    assert all(not d.any() for d, _ in copies)  # nothing copied now: the graph copies on replay
    recording._append_copies([], adding, graph, stream)
    assert len(adding.added) == 1
    capturing = _CopyBackend(adds=False)
    recording._append_copies(copies, capturing, graph, stream)
    assert capturing.captured == [(0x6000, 0xBEEF)] and not capturing.capturing
    assert [d.tolist() for d, _ in copies] == [list(range(16)), [20, 21, 22, 23]]  # the copies ran inside it
