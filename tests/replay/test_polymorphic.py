"""The matching of polymorphic replay (replay.polymorphic) on plain data, and the observer on
CPU tensors; the whole path runs on the GPU in test_polymorphic_gpu.py."""

from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import replay
from replay.policy import Policy
from replay.polymorphic import Launch, LaunchFreeObserver, Unmatched, match, output_place, plain_outputs
from replay.recording import StorageUse

INPUT = (0x1000, 0x2000)  # the observed call's one argument


def launch(pointers, *, function=7, grid=(1, 1, 1), block=(128, 1, 1), scalars=b"", fixed=True):
    """A launch of pointers (address, storage or None) followed by ``scalars``."""
    data = b"".join(struct.pack("<Q", address) for address, _ in pointers) + scalars
    described = tuple((index, index * 8, use) for index, (_, use) in enumerate(pointers))
    return Launch(function, grid, block, 0, data, described, fixed_grid=fixed)


def made(base, nbytes=4096):
    return StorageUse(base, nbytes, True)


def pointers_of(data: bytes, count: int) -> list[int]:
    return [struct.unpack_from("<Q", data, 8 * i)[0] for i in range(count)]


def test_memory_the_run_made_moves_into_the_graphs_and_arguments_and_scalars_stay():
    graph = [
        launch([(0x9000, None), (0x50000, made(0x50000))], scalars=struct.pack("<q", 64), grid=(64, 1, 1)),
        launch([(0x50000 + 256, made(0x50000)), (0x60000, made(0x60000))], grid=(64, 1, 1)),
    ]
    observed = [
        launch([(0x1000, None), (0x70000, made(0x70000, 1024))], scalars=struct.pack("<q", 5), grid=(5, 1, 1)),
        launch([(0x70000 + 256, made(0x70000, 1024)), (0x80000, made(0x80000, 512))], grid=(5, 1, 1)),
    ]
    moved = match(graph, observed, [INPUT])
    assert pointers_of(moved.param_bytes[0], 2) == [0x1000, 0x50000]  # the argument left to the plan
    assert moved.param_bytes[0][16:] == struct.pack("<q", 5)  # the call's own size
    assert pointers_of(moved.param_bytes[1], 2) == [0x50000 + 256, 0x60000]
    assert moved.grids == ((5, 1, 1), (5, 1, 1))
    assert moved.translation == {0x70000: 0x50000, 0x80000: 0x60000}


def test_storages_must_correspond_one_to_one():
    graph = [launch([(0x50000, made(0x50000)), (0x60000, made(0x60000))])]
    merged = [launch([(0x70000, made(0x70000)), (0x70000, made(0x70000))])]  # one storage for two
    with pytest.raises(Unmatched, match="shared otherwise"):
        match(graph, merged, [INPUT])
    graph_merged = [launch([(0x50000, made(0x50000)), (0x50000, made(0x50000))])]
    split = [launch([(0x70000, made(0x70000)), (0x80000, made(0x80000))])]
    with pytest.raises(Unmatched, match="shared otherwise"):
        match(graph_merged, split, [INPUT])


def test_a_storage_larger_than_the_graphs_is_refused():
    graph = [launch([(0x50000, made(0x50000, 1024))])]
    with pytest.raises(Unmatched, match="2048 bytes, where the graph holds 1024"):
        match(graph, [launch([(0x70000, made(0x70000, 2048))])], [INPUT])


def test_memory_not_made_by_the_run_must_be_the_graphs():
    weight = StorageUse(0xA000, 4096, False)
    graph = [launch([(0xA000, weight)])]
    assert match(graph, [launch([(0xA000, weight)])], [INPUT]).param_bytes[0] == graph[0].param_bytes
    with pytest.raises(Unmatched, match="did not make"):
        match(graph, [launch([(0xB000, StorageUse(0xB000, 4096, False))])], [INPUT])
    with pytest.raises(Unmatched, match="points into memory it did not make"):
        match(graph, [launch([(0x70000, made(0x70000))])], [INPUT])


@pytest.mark.parametrize(
    ("observed", "message"),
    [
        ([launch([], function=8)], "another kernel"),
        ([launch([], block=(64, 1, 1))], "another block"),
        ([launch([], scalars=b"\0" * 8)], "other parameters"),
        ([launch([], fixed=False)], "empty grid"),
        ([launch([]), launch([])], "2 launches at this size, 1 in the graph"),
    ],
)
def test_launches_that_differ_in_kind_are_refused(observed, message):
    with pytest.raises(Unmatched, match=message):
        match([launch([])], observed, [INPUT])


@given(st.lists(st.integers(0, 3), min_size=1, max_size=12), st.lists(st.integers(0, 3), min_size=1, max_size=12))
def test_property_a_match_exists_exactly_when_the_sharing_is_the_same(graph_ids, observed_ids):
    """Each launch points into storage ``id``; the two runs match when they have the same
    number of launches and the same pattern of which launches share a storage."""
    graph = [launch([(0x50000 + 0x10000 * i, made(0x50000 + 0x10000 * i))]) for i in graph_ids]
    observed = [launch([(0x90000 + 0x10000 * i, made(0x90000 + 0x10000 * i))]) for i in observed_ids]

    def pattern(ids):
        return [ids.index(i) for i in ids]

    same = len(graph_ids) == len(observed_ids) and pattern(graph_ids) == pattern(observed_ids)
    if same:
        moved = match(graph, observed, [INPUT])
        assert [pointers_of(data, 1)[0] for data in moved.param_bytes] == [0x50000 + 0x10000 * i for i in graph_ids]
    else:
        with pytest.raises(Unmatched):
            match(graph, observed, [INPUT])


def test_outputs_are_found_in_the_lanes_the_graph_copies_out():
    translation = {0x70000: 0x50000}
    lanes = [(0x50000 + 512, 4096), (0x60000, 64)]
    assert output_place(0x70000, 0x70000 + 1024, 256, translation, lanes) == (0, 512)
    assert output_place(0x70000, 0x70000, 256, translation, lanes) is None  # before the copied bytes
    assert output_place(0x70000, 0x70000 + 4096, 1024, translation, lanes) is None  # beyond them
    assert output_place(0x80000, 0x80000, 4, translation, lanes) is None  # memory no launch saw


def test_the_observer_sees_allocations_views_and_anything_that_may_launch():
    observer = LaunchFreeObserver(device_types=("cpu",))
    with observer:
        x = torch.empty(4, 8)
        y = torch.empty_like(x)
        x[1:].transpose(0, 1)
        _ = x.shape, x.stride(), x.numel()
    assert observer.made == {x.untyped_storage().data_ptr(), y.untyped_storage().data_ptr()}
    assert observer.launching is None
    with observer:
        torch.zeros(3)
        torch.empty(3).add_(1)
    assert "zeros" in observer.launching  # the first one that may launch a kernel


def test_under_inference_mode_the_observer_sees_what_a_composite_op_launches_and_makes():
    """``contiguous`` of a transpose is a composite op marked as a view: under inference mode
    it reaches the dispatch mode whole, and would hide the copy inside it, as it does not
    outside inference mode."""
    for mode in (torch.inference_mode, torch.no_grad):
        with mode():
            x = torch.randn(4, 8)
            observer = LaunchFreeObserver(device_types=("cpu",))
            with observer:
                x.t().contiguous()
            assert observer.launching == "aten.clone.default"
    with torch.inference_mode():
        observer = LaunchFreeObserver(device_types=("cpu",))
        with observer:
            z = x.contiguous().reshape(-1)  # already contiguous: views alone
        assert observer.launching is None and z.data_ptr() == x.data_ptr()


def test_the_observer_lets_ops_on_other_devices_pass():
    observer = LaunchFreeObserver(device_types=("cuda",))
    with observer:
        torch.ones(3).add_(1)  # CPU work launches no kernel
    assert observer.launching is None


def test_dynamic_scalars_in_outputs_become_their_values():
    from replay.dynamic import DynamicScalar

    value = DynamicScalar("_d0", 3.5, "args[0]")
    assert plain_outputs((torch.ones(1), value, [value])) == plain_outputs((torch.ones(1), 3.5, [3.5]))
    assert plain_outputs((1, [3.5]))[1] == [3.5]


def test_polymorphic_needs_buckets():
    with pytest.raises(ValueError, match="polymorphic=True serves the sizes below each bucket"):
        Policy(polymorphic=True)
    with pytest.raises(ValueError, match="polymorphic must be True or False"):
        Policy(buckets=[4], polymorphic=1)
    assert Policy(buckets=[4], polymorphic=True).polymorphic


def test_without_a_gpu_polymorphic_sessions_run_eagerly():
    if torch.cuda.is_available():
        pytest.skip("the GPU path is tested in test_polymorphic_gpu.py")
    with pytest.warns(replay.ReplayWarning), replay.capture(buckets=[8], polymorphic=True) as session:
        step = session.region(lambda x: x * 2)
        assert torch.equal(step(replay.padded(torch.ones(3, 2))), torch.full((3, 2), 2.0))
