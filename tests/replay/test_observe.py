"""The torch-op observer: which watched inputs non-view torch ops read and write."""

from __future__ import annotations

import torch

from replay.observe import TorchOpObserver
from replay.region_keys import byte_range


def watch(*tensors):
    return TorchOpObserver([byte_range(t) for t in tensors])


def test_reads_writes_and_views():
    x, y, z = torch.randn(8), torch.randn(8), torch.randn(8)
    observer = watch(x, y, z)
    with observer:
        view = x[2:]  # a view: no read
        _ = view * 2  # reads x through the view
        y.add_(1)  # writes y
        torch.mul(x, 2, out=torch.empty(8))
    assert observer.read == {0, 1}
    assert observer.written == {1}
    assert 2 not in observer.read


def test_out_arguments_count_as_writes():
    x, out = torch.randn(4), torch.empty(4)
    observer = watch(x, out)
    with observer:
        torch.add(x, 1, out=out)
    assert observer.written == {1} and observer.read == {0, 1}


def test_unwatched_and_empty_tensors_are_ignored():
    x = torch.randn(4)
    observer = watch(x, torch.empty(0))
    with observer:
        torch.randn(4) + 1
    assert observer.read == set() and observer.written == set()


def test_metadata_only_ops_do_not_count_as_reads():
    x = torch.randn(4)
    observer = watch(x)
    with observer:
        torch.empty_like(x)
        torch.zeros_like(x)
        x.new_empty(3)
    assert observer.read == set()


def test_an_op_reading_a_tensor_that_holds_a_watched_range_is_noted():
    """``cache`` read by an op while ``cache[1]`` is the watched argument: noted (the capture
    refuses the key); views inside a watched range, and overlapping watched ranges each
    holding the tensor read, are not."""
    cache = torch.randn(4, 8)
    observer = watch(cache[1], torch.randn(3))
    with observer:
        cache[1][2:5] * 2  # inside the argument
    assert observer.read == {0} and observer.reached_beyond == set()
    with observer:
        cache.sum()  # the whole global: reaches beyond the argument
    assert observer.reached_beyond == {0}

    base = torch.randn(16)
    x, y = base[:10], base[6:]
    observer = watch(x, y)
    with observer:
        x * 2  # overlaps y too, but x holds it whole
        y + 1
    assert observer.read == {0, 1} and observer.reached_beyond == set()
    with observer:
        base[4:12].sum()  # held by neither
    assert observer.reached_beyond == {0, 1}
