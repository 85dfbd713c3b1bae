"""Bucketing on the CPU: padding, slicing, copying back, refusals and verification, with the
session's recording double (tests/replay/test_session.py) and with a real session, which runs
eagerly without a GPU (the same padding path)."""

from __future__ import annotations

import math
import random
import struct
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import replay
from replay import buckets, padding, region_keys, routing
from replay.errors import ReplayMismatchError
from replay.graph import MISMATCH

from . import fuzz_grammar as fz
from .test_session import _GATE, DoubleSession, FakeGraph, _region, session_factory  # noqa: F401  (a fixture)

BUCKETS = [1, 2, 4, 8, 16, 32, 64]


def rowwise(x, scale):
    return x * scale + 1, scale.sum()  # a batch-shaped output and one that is not


def test_calls_run_the_graph_of_the_next_bucket_and_slices_come_back(session_factory):  # noqa: F811
    session = session_factory(record_after=1, buckets=BUCKETS)
    step = session.region(rowwise)
    scale = torch.randn(5)
    generator = random.Random(0)
    for _ in range(300):
        rows = generator.randint(1, 40)
        x = torch.randn(rows, 5)
        out, total = step(replay.padded(x), scale)
        assert out.shape == (rows, 5) and torch.equal(out, x * scale + 1)
        assert torch.equal(total, scale.sum())
    recorded = {key[region_keys.LEAVES_START][1] for key in step.entries}
    assert recorded <= {(b, 5) for b in BUCKETS}  # 1..40 needs at most the seven buckets 1, 2, ..., 64
    assert session.stats().records == len(recorded)


def test_padding_rows_hold_the_fill_and_sizes_beyond_the_last_bucket_are_exact(session_factory):  # noqa: F811
    session = session_factory(record_after=0, buckets=[4, 8])
    step = session.region(lambda x: x + 0)
    x = torch.arange(6.0).reshape(3, 2)
    assert torch.equal(step(replay.padded(x, fill=-7.5)), x)
    (captured,) = session.captures[0][1]  # the leaves the region was recorded with
    assert captured.shape == (4, 2) and torch.equal(captured[3], torch.full((2,), -7.5))
    wide = torch.randn(11, 2)  # beyond 8: its own exact key
    assert torch.equal(step(replay.padded(wide)), wide)
    assert session.captures[-1][1][0].shape == (11, 2)


def test_padding_along_another_dim_and_keyword_arguments(session_factory):  # noqa: F811
    session = session_factory(record_after=0, buckets=[8])
    step = session.region(lambda x, *, y: x * y)
    x, y = torch.randn(2, 5), torch.randn(2, 5)
    out = step(replay.padded(x, dim=-1), y=replay.padded(y, dim=1))
    assert out.shape == (2, 5) and torch.equal(out, x * y)


def test_written_arguments_are_copied_back_and_read_ones_left_alone(session_factory):  # noqa: F811
    session = session_factory(record_after=0, buckets=[8])

    def bump(x):
        x.add_(1)
        return x.sum(1)

    step = session.region(bump)
    x = torch.randn(3, 4)
    expected = x + 1
    assert torch.equal(step(replay.padded(x, written=True)), expected.sum(1))
    assert torch.equal(x, expected)
    y = torch.randn(3, 4)
    before = y.clone()
    step(replay.padded(y))  # not marked written: the write lands in the padded copy
    assert torch.equal(y, before)


def test_bad_padding_is_refused_before_anything_runs(session_factory):  # noqa: F811
    calls = []
    session = session_factory(record_after=0, buckets=[8])
    step = session.region(lambda *a: calls.append(a))
    x = torch.randn(3, 2)
    with pytest.raises(ValueError, match=r"must agree .* args\[0\] 3, args\[1\] 4"):
        step(replay.padded(x), replay.padded(torch.randn(4, 2)))
    with pytest.raises(ValueError, match=r"must pad the same dimension .* args\[0\] dim 0, args\[1\] dim 1"):
        step(replay.padded(x), replay.padded(torch.randn(2, 3), dim=1))
    with pytest.raises(TypeError, match="unhashable Padded"):
        step([replay.padded(x)])
    with pytest.raises(ValueError, match="dim must be an int in"):
        replay.padded(x, dim=2)
    with pytest.raises(ValueError, match="not exact in torch.int32"):
        replay.padded(torch.zeros(2, dtype=torch.int32), fill=0.5)
    with pytest.raises(ValueError, match="not exact in torch.float16"):
        replay.padded(torch.zeros(2, dtype=torch.float16), fill=1e-9)
    with pytest.raises(TypeError, match="takes a tensor"):
        replay.padded([1, 2])
    plain = session_factory(record_after=0)
    with pytest.raises(ValueError, match="no buckets: capture"):
        plain.region(lambda x: x)(replay.padded(x))
    assert calls == []
    with pytest.raises(ValueError, match="buckets must be"):
        replay.capture(buckets=[0, 4])


def test_verify_every_catches_a_region_whose_rows_are_not_independent(session_factory):  # noqa: F811
    session = session_factory(record_after=0, buckets=[8], verify_every=1)
    centred = session.region(lambda x: x - x.mean(0), name="centred")
    with pytest.raises(ReplayMismatchError, match="region centred: padding changed output .* not independent"):
        centred(replay.padded(torch.randn(3, 4) + 1))
    rows = session.region(lambda x: torch.tanh(x) * 3, name="rows")
    for n in (3, 5, 3):
        x = torch.randn(n, 4)
        assert torch.equal(rows(replay.padded(x)), torch.tanh(x) * 3)
    assert session.stats().verifications >= 4  # the padded calls (and their graphs' own checks)
    scaled = session.region(lambda x, factor: x * factor, name="scaled")  # a dynamic argument too
    x = torch.randn(3, 4)
    assert torch.equal(scaled(replay.padded(x), replay.dynamic(0.5)), x * 0.5)


def test_verification_copies_nested_and_aliased_arguments_as_the_call_sees_them(session_factory):  # noqa: F811
    # the unpadded reference run must not touch the caller's tensors (a cache in a list), and
    # arguments that share memory must still share it in its copies
    session = session_factory(record_after=0, buckets=[8], verify_every=1)

    def step(x, caches, a, b):
        caches[0][: x.shape[0]] += x  # a nested tensor written
        a.mul_(2)  # b is a view of a: the reference's copies must keep that
        return x + caches[0][: x.shape[0]] + b.sum()

    region = session.region(step, name="nested")
    x, cache, a = torch.randn(3, 4), torch.randn(8, 4), torch.randn(5)
    b = a[1:3]
    x_before, cache_before, a_before = x.clone(), cache.clone(), a.clone()
    out = region(replay.padded(x), [cache], a, b)
    expected_cache = cache_before.clone()
    expected_cache[:3] += x_before
    assert torch.equal(cache, expected_cache)  # written once, by the real call only
    assert torch.equal(a, a_before * 2)
    assert torch.equal(out, x_before + expected_cache[:3] + (a_before[1:3] * 2).sum())


def test_a_padded_argument_sharing_memory_with_another_is_refused(session_factory):  # noqa: F811
    calls = []
    session = session_factory(record_after=0, buckets=[8])
    step = session.region(lambda x, y: calls.append(1) or x + y[0])
    x = torch.randn(3, 4)
    with pytest.raises(ValueError, match=r"padded argument args\[0\] shares memory with args\[1\]\[0\]"):
        step(replay.padded(x), [x[0]])  # the copy would not see writes through x[0]
    with pytest.raises(ValueError, match="shares memory"):
        step(replay.padded(x), replay.padded(x))  # the same tensor padded twice: two copies
    assert torch.equal(step(replay.padded(x), [torch.zeros(4)]), x)  # separate memory: fine
    full = torch.randn(8, 4)
    assert torch.equal(step(replay.padded(full), [full[0]]), full + full[0])  # a full bucket is not copied
    assert calls == [1, 1]


class StagingGraph(FakeGraph):
    """A graph double that stages every tensor input, as a graph does whose inputs a torch op
    reads: its replay copies each input into a buffer of its own (unless passed that very
    buffer: the copy is skipped, counted) and runs the region on its buffers. A call that
    handed it its buffer without writing the call's values into it would compute from stale
    values."""

    decline = False  # every replay declines (as one does when a torch setting changed)

    def __init__(self, region, key, capture, spec, leaves, paths, session, number):
        super().__init__(region, key, capture, spec, leaves, paths, session, number)
        self.buffers = {
            i: torch.full_like(leaf, float("nan") if leaf.is_floating_point() else -12345)
            for i, leaf in enumerate(leaves)
            if isinstance(leaf, torch.Tensor)
        }
        self.in_place = {i: (buffer, ()) for i, buffer in self.buffers.items()}
        self.copies = self.skipped = 0
        self.replay = self._staged_replay  # one object, as a generated replay is

    def in_place_buffer(self, index):
        taken = self.in_place.get(index)
        return taken[0] if taken is not None else None

    def _staged_replay(self, *leaves):
        if StagingGraph.decline:
            return MISMATCH
        staged = list(leaves)
        for i, buffer in self.buffers.items():
            if leaves[i] is buffer:
                self.skipped += 1
            else:
                buffer.copy_(leaves[i])
                self.copies += 1
            staged[i] = buffer
        return FakeGraph.replay(self, *staged)


@pytest.fixture
def staging_factory(session_factory, monkeypatch):  # noqa: F811
    """The session double with graphs that stage their inputs, and the jit pad replaced by
    torch's (the pad kernel runs on the GPU only; the GPU tests run it): ``pads`` lists each
    pad in place."""
    pads = []

    def pad_into(tensor, dim, bits, out):
        fill = struct.unpack("<f", struct.pack("<I", bits))[0]  # these tests pad float32
        widths = [0, 0] * (tensor.dim() - 1 - dim) + [0, out.shape[dim] - tensor.shape[dim]]
        out.copy_(torch.constant_pad_nd(tensor, widths, fill))
        pads.append(out)
        return True

    monkeypatch.setattr(padding, "pad_into", pad_into)
    monkeypatch.setattr(DoubleSession, "build_graph", StagingGraph)
    monkeypatch.setattr(StagingGraph, "decline", False)
    return session_factory, pads


def _reference(w, x, buckets, fill=0.0):
    """The eager run of ``scaled_rows`` on ``x`` padded as documented (fuzz_grammar's reference)."""
    return fz.padded_reference(scaled_rows, (replay.padded(x, fill=fill), w), {}, buckets)


def scaled_rows(x, w):
    return x * w + 1


def test_a_staged_padded_argument_is_padded_into_the_graphs_buffer_and_its_copies_skipped(staging_factory):
    make, pads = staging_factory
    session = make(record_after=1, buckets=[4, 8, 16])
    step = session.region(scaled_rows)
    w = torch.randn(5)
    generator = random.Random(5)
    for number in range(200):
        rows = generator.randint(1, 16)
        x = torch.randn(rows, 5)
        fill = generator.choice([0.0, -7.5])
        expected = _reference(w, x, [4, 8, 16], fill)
        assert torch.equal(step(replay.padded(x, fill=fill), w), expected), f"call {number}"
    graphs = [g for g in FakeGraph.instances if isinstance(g, StagingGraph) and g.session is session]
    stats = session.stats()
    skipped = sum(g.skipped for g in graphs)
    assert skipped == stats.padded_in_place == len(pads) > 100
    assert all(any(p is g.buffers[0] for g in graphs) for p in pads)  # only into a graph's own buffer


def test_padding_in_place_is_not_taken_across_streams_with_verify_every_or_for_another_dtype(staging_factory):
    make, pads = staging_factory
    w = torch.randn(5)
    session = make(record_after=1, buckets=[8])
    step = session.region(scaled_rows)
    for _ in range(4):  # warmed, recorded, analysed (and replayed), then replayed in place
        step(replay.padded(torch.randn(5, 5)), w)
    taken = len(pads)
    assert taken == session.stats().padded_in_place == 1
    # the session's last replay was on another stream: a replay there may still read the buffer
    session.last_stream[0] = 12345
    x = torch.randn(6, 5)
    assert torch.equal(step(replay.padded(x), w), _reference(w, x, [8]))
    assert len(pads) == taken
    session.last_stream[0] = 0
    # the same shapes in float64: the guard refuses the graph before anything is written
    x64 = torch.randn(6, 5, dtype=torch.float64)
    assert torch.equal(step(replay.padded(x64), w.double()), _reference(w.double(), x64, [8]))
    assert len(pads) == taken
    # verify_every: verified or declined calls run the region on their arguments
    checked = make(record_after=1, buckets=[8], verify_every=2)
    checked_step = checked.region(scaled_rows)
    for _ in range(6):
        checked_step(replay.padded(torch.randn(5, 5)), w)
    assert len(pads) == taken and checked.stats().padded_in_place == 0


def doubled_plus_one(x):
    return x * 2 + 1


def test_a_buffer_holds_a_pad_only_of_a_tensor_of_its_dtype_and_device():
    """The predicate of padding in place: the device half is checked here on the CPU with a
    meta buffer (on one GPU every graph's buffer is on the call's device, and two GPUs'
    guards already differ by the current device; the jit pad refuses a tensor of another
    device before writing, so no end-to-end test tells this half apart)."""
    from replay.routing import holds_a_pad_of

    buffer = torch.empty(8, 4)
    assert holds_a_pad_of(buffer, torch.randn(3, 4))
    assert not holds_a_pad_of(buffer, torch.randn(3, 4, dtype=torch.float64))
    assert not holds_a_pad_of(buffer, torch.empty(3, 4, dtype=torch.int32))
    assert not holds_a_pad_of(torch.empty(8, 4, device="meta"), torch.randn(3, 4))
    assert not holds_a_pad_of(buffer, torch.empty(3, 4, device="meta"))


@pytest.mark.parametrize("other", [torch.int32, torch.float64, torch.bfloat16], ids=str)
def test_a_padded_argument_of_another_dtype_than_the_buffer_is_never_padded_into_it(staging_factory, other):
    """The pre-key holds shapes only and the guard sees the buffer in the argument's place, so
    the buffer's dtype must be checked against the argument's: an int32 (the same element size)
    or a float64 call of the same shapes padded into a float32 graph's buffer would replay that
    graph on reinterpreted or converted values."""
    make, pads = staging_factory
    session = make(record_after=1, buckets=[8])
    step = session.region(doubled_plus_one)
    for _ in range(4):  # warmed, recorded, analysed, then replayed in place
        step(replay.padded(torch.randn(5, 3)))
    taken = len(pads)
    assert taken == session.stats().padded_in_place == 1
    for number in range(6):
        x = (torch.randn(6, 3) * 100).to(other)
        got = step(replay.padded(x))
        expected = fz.padded_reference(doubled_plus_one, (replay.padded(x),), {}, [8])
        assert got.dtype == expected.dtype == other and torch.equal(got, expected), f"call {number}"
    # none went into the float32 graph's buffer (a graph of their own may take them in place)
    float_graphs = [g for g in FakeGraph.instances if isinstance(g, StagingGraph) and g.session is session]
    float_buffers = [g.buffers[0] for g in float_graphs if g.buffers[0].dtype == torch.float32]
    assert not any(p is b for p in pads[taken:] for b in float_buffers)


def test_a_replay_that_declines_after_the_pad_leaves_the_call_to_the_usual_path(staging_factory, monkeypatch):
    make, pads = staging_factory
    w = torch.randn(5)
    session = make(record_after=1, buckets=[8])
    step = session.region(scaled_rows)
    for _ in range(4):
        step(replay.padded(torch.randn(5, 5)), w)
    monkeypatch.setattr(StagingGraph, "decline", True)
    before = session.stats().padded_in_place
    taken = len(pads)
    x = torch.randn(3, 5)
    assert torch.equal(step(replay.padded(x), w), _reference(w, x, [8]))
    # padded into the buffer, declined, then run the usual way (and not counted in place)
    assert len(pads) == taken + 1 and session.stats().padded_in_place == before


@pytest.mark.parametrize("gate", [pytest.param(True, marks=_GATE), False], ids=["c", "python"])
def test_a_marker_whose_size_needs_no_padding_is_an_ordinary_call(session_factory, monkeypatch, gate):  # noqa: F811
    # beyond the largest bucket, or at a bucket's own size, buckets.call would run the call
    # unpadded: the flat dispatch (the gate in C, or FlatDispatch) takes the marker as its
    # tensor before the full path; the same results, counts and recordings as the plain call
    entered = {"_call": 0, "buckets.call": 0}
    original_call, original_buckets_call = replay.region.Region.full_path, buckets.call

    def counting_call(self, *args):
        entered["_call"] += 1
        return original_call(self, *args)

    def counting_buckets_call(*args, **kwargs):
        entered["buckets.call"] += 1
        return original_buckets_call(*args, **kwargs)

    monkeypatch.setattr(replay.region.Region, "full_path", counting_call)
    monkeypatch.setattr(buckets, "call", counting_buckets_call)
    w = torch.randn(4)

    def run(padded: bool) -> list:
        session = session_factory(record_after=1, buckets=[4, 8])
        step = _region(session, scaled_rows, gate)
        seen = []
        for rows in (9, 11, 8, 9, 4, 9, 8, 12, 4, 9, 8):
            x = torch.randn(rows, 4)
            out = step(replay.padded(x) if padded else x, w)
            assert torch.equal(out, scaled_rows(x, w))
            stats = session.stats()
            seen.append((stats.calls, stats.eager_runs, stats.records, stats.replays, stats.too_rare))
        return seen

    plain = run(padded=False)
    entered.update({"_call": 0, "buckets.call": 0})
    assert run(padded=True) == plain
    assert entered["buckets.call"] == 0  # never padded, never checked for it
    calls_when_padded = entered["_call"]
    entered.update({"_call": 0, "buckets.call": 0})
    run(padded=False)
    assert calls_when_padded == entered["_call"]  # the markers sent no call to the full path
    session = session_factory(record_after=1, buckets=[4, 8])
    step = _region(session, scaled_rows, gate)
    step(replay.padded(torch.randn(3, 4)), w)  # a size to pad: the padded path
    assert entered["buckets.call"] == 1
    x9 = torch.randn(9, 4)
    with pytest.raises(ValueError, match=r"must agree .* args\[0\] 9, args\[1\] 10"):
        step(replay.padded(x9), replay.padded(torch.randn(10, 4)))  # both beyond: still refused
    with pytest.raises(ValueError, match=r"must pad the same dimension"):
        step(replay.padded(x9), replay.padded(torch.randn(4, 9), dim=1))


@pytest.mark.parametrize("policy", [{"verify_every": 1}, {"polymorphic": True}], ids=["verify_every", "polymorphic"])
def test_a_marker_needing_no_padding_keeps_the_padded_path_where_it_verifies_or_is_polymorphic(
    session_factory,  # noqa: F811
    monkeypatch,
    policy,
):
    entered = []
    original = buckets.call
    monkeypatch.setattr(buckets, "call", lambda *a, **k: entered.append(1) or original(*a, **k))
    session = session_factory(record_after=100, buckets=[4, 8], **policy)
    step = session.region(lambda x: x * 2)
    x = torch.randn(9, 3)
    assert torch.equal(step(replay.padded(x)), x * 2)
    assert entered == [1] and step.router.padded_calls == 1


@pytest.mark.parametrize("gate", [pytest.param(True, marks=_GATE), False], ids=["c", "python"])
def test_the_dispatch_takes_markers_that_need_no_padding_as_their_tensors(session_factory, gate):  # noqa: F811
    session = session_factory(record_after=100, buckets=[4, 8])
    seen = []
    step = _region(session, lambda *args: seen.append(args) or len(seen), gate)
    x9, x8, x3 = torch.randn(9, 2), torch.randn(8, 2), torch.randn(3, 2)
    assert step.dispatch((buckets.padded(x9), 5)) == 1 and seen[-1][0] is x9
    assert step.dispatch((buckets.padded(x8), buckets.padded(x8.clone()))) == 2 and seen[-1][0] is x8
    miss = replay.dispatch.MISS
    assert step.dispatch((buckets.padded(x3),)) is miss  # to pad
    assert step.dispatch((buckets.padded(x9), buckets.padded(x8))) is miss  # they disagree
    assert step.dispatch((buckets.padded(x9), replay.dynamic(3))) is miss  # beside a dynamic scalar
    assert step.dispatch((buckets.padded(x9), [1])) is miss  # beside a constant of the full path
    other = session_factory(record_after=100)
    unbucketed = _region(other, lambda x: x, gate)
    assert unbucketed.dispatch((buckets.padded(x9),)) is miss  # no buckets: the full path says so


def test_a_real_session_pads_without_a_gpu():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        with replay.capture(buckets=[4, 16]) as session:
            step = session.region(lambda x: (x * 2, x.shape[0]))
            out, seen = step(replay.padded(torch.ones(3, 2)))
    assert torch.equal(out, torch.full((3, 2), 2.0)) and seen == 4


def test_bucket_for_picks_the_smallest_that_holds():
    assert [routing.bucket_for(n, [2, 4, 8]) for n in (1, 2, 3, 8, 9)] == [2, 2, 4, 8, None]


_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.bool,
]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_padding_equals_a_filled_tensor_with_the_rows_copied_in(data):
    # every dtype, dimension, layout (contiguous, transposed, strided) and exact fill: the
    # padded argument is the call's rows followed by rows of fill, and nothing else
    dtype = data.draw(st.sampled_from(_DTYPES), label="dtype")
    shape = data.draw(st.lists(st.integers(0, 5), min_size=1, max_size=4), label="shape")
    dim = data.draw(st.integers(-len(shape), len(shape) - 1), label="dim")
    layout = data.draw(st.sampled_from(["contiguous", "transposed", "strided"]), label="layout")
    if dtype == torch.bool:
        fill = data.draw(st.sampled_from([False, True, 0, 1]), label="fill")
    elif dtype.is_floating_point:
        fill = data.draw(st.sampled_from([0, 0.0, -0.0, 1.5, -7, math.inf, math.nan]), label="fill")
    else:
        fill = data.draw(st.sampled_from([0, 3, 1.0, True]), label="fill")
    base = (torch.randn(*shape) * 50).to(dtype)
    if layout == "transposed" and len(shape) > 1:
        base = base.transpose(0, -1).contiguous().transpose(0, -1)
    elif layout == "strided":
        base = torch.repeat_interleave(base, 2, dim=-1).to(dtype)[..., ::2]
    rows = base.shape[dim]
    seen = []
    args = (replay.padded(base, dim=dim, fill=fill),)
    marked = routing.marked_call(args, {}, [rows + 3], "r")
    result, _ = buckets.call(lambda x: seen.append(x) or x, marked, "r")
    got_rows, bucket = marked.rows, marked.target
    (grown,) = seen
    expected_shape = list(base.shape)
    expected_shape[dim] = rows + 3
    expected = torch.full(expected_shape, fill, dtype=dtype)
    expected.narrow(dim, 0, rows).copy_(base)
    assert (got_rows, bucket) == (rows, rows + 3)
    assert grown.dtype == dtype and grown.shape == expected.shape
    assert torch.equal(grown.view(torch.uint8) if dtype == torch.bool else grown, expected) or (
        dtype.is_floating_point
        and torch.equal(grown.isnan(), expected.isnan())
        and torch.equal(grown.nan_to_num(), expected.nan_to_num())
    )
    if dtype.is_floating_point:  # -0.0 keeps its sign
        assert torch.equal(torch.signbit(grown), torch.signbit(expected))
    assert result.shape == base.shape and torch.equal(result, grown.narrow(dim % base.dim(), 0, rows))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.bool, torch.complex64])
def test_the_default_fill_is_answered_per_dtype_as_fill_bits_answers_it(dtype):
    # replay.padded answers the default fill (int 0) from a per-dtype cache: the same answer
    # as padding.fill_bits, refusal included (no fill is exact in a complex dtype)
    x = torch.zeros(2, dtype=dtype)
    expected = padding.fill_bits(0, dtype)
    for _ in range(2):  # the first call fills the cache, the second reads it
        if expected is None:
            with pytest.raises(ValueError, match="not exact"):
                replay.padded(x)
        else:
            assert replay.padded(x).bits == expected == replay.padded(x, fill=0).bits


def test_the_same_fill_is_judged_by_its_type_and_sign_each_time():
    # the exactness answers are cached: 0.0 and -0.0, 1 and 1.0 and True must stay apart
    x = torch.zeros(2, dtype=torch.int32)
    for _ in range(2):
        replay.padded(x, fill=0.0)
        with pytest.raises(ValueError, match="not exact"):
            replay.padded(x, fill=-0.0)
        with pytest.raises(ValueError, match="not exact"):
            replay.padded(torch.zeros(2, dtype=torch.uint8), fill=-1)
        replay.padded(torch.zeros(2, dtype=torch.float16), fill=-0.0)
        with pytest.raises(ValueError, match="not exact"):
            replay.padded(torch.zeros(2, dtype=torch.float16), fill=0.1)
        replay.padded(torch.zeros(2, dtype=torch.float16), fill=math.nan)
        with pytest.raises(ValueError, match="not exact"):
            replay.padded(x, fill=math.nan)
        with pytest.raises(ValueError, match="not exact"):
            replay.padded(x, fill=10**400)  # beyond any float: no overflow escapes
