"""A region's padded calls routed (replay.routing) on the CPU, with the session's doubles: what
a call pads to, the bucket's graph learned, and sizes below it served by a variant (a double
of replay.polymorphic's; the real ones run on the GPU in test_polymorphic_gpu.py)."""

from __future__ import annotations

import pytest
import torch

import replay
from replay import lifecycle, polymorphic, region_keys, routing

from .test_session import session_factory  # noqa: F401  (a fixture)


class _Variant(polymorphic.VariantGraph):
    """Stands for a size variant of the bucket's graph: its replay runs the region eagerly."""

    def __init__(self, base, key, entry) -> None:  # (none of a real variant's making)
        self.base, self.key, self.entry = base, key, entry
        self.replays, self.released = 0, False

    def replay(self, *leaves):
        self.replays += 1
        args, kwargs = region_keys.unflatten(self.key[1], region_keys.plain_leaves(leaves))
        return self.base.region.fn(*args, **kwargs)


def _observed_sizes(monkeypatch, refuse: bool) -> list:
    """make_variant replaced: a variant double for each observed size, or the refusal."""
    made = []

    def make_variant(base, key, entry, spec, leaves, paths, observation, forget):
        assert all(leaf.__class__ is not replay.buckets.Padded for leaf in leaves)  # the unpadded call
        made.append((key, [tuple(leaf.shape) for leaf in leaves if isinstance(leaf, torch.Tensor)]))
        if refuse:
            raise polymorphic.Unmatched("a double's refusal")
        return _Variant(base, key, entry)

    monkeypatch.setattr(polymorphic, "make_variant", make_variant)
    return made


@pytest.mark.parametrize("refuse", [False, True], ids=["served", "refused"])
def test_sizes_below_the_bucket_are_observed_against_its_graph_once_it_replays(
    session_factory,  # noqa: F811
    monkeypatch,
    refuse,
):
    made = _observed_sizes(monkeypatch, refuse)
    session = session_factory(record_after=1, buckets=[4, 8], polymorphic=True)
    step = session.region(lambda x, scale: x * scale)
    for _ in range(6):
        x = torch.randn(3, 2)
        assert torch.equal(step(replay.padded(x), 2.0), x * 2.0)
    ((key, shapes),) = made  # observed once, at its own size, after the bucket's graph replayed
    assert shapes == [(3, 2)] and key[1] == (region_keys.FLAT, 2)
    base = step.bucket_bases[(4, (region_keys.FLAT, 2))]
    assert base.state is lifecycle.REPLAYING and base.key[region_keys.LEAVES_START][1] == (4, 2)
    stats = session.stats()
    if refuse:
        assert step.variants[key] == "a double's refusal" and stats.variants == 0 and stats.not_polymorphic == 1
    else:
        variant = step.variants[key]
        assert isinstance(variant, _Variant) and variant.replays >= 1 and stats.variants == 1
    assert lifecycle.problems(session) == []


def test_a_call_that_needs_no_padding_is_not_observed(session_factory, monkeypatch):  # noqa: F811
    made = _observed_sizes(monkeypatch, refuse=False)
    session = session_factory(record_after=1, buckets=[4, 8], polymorphic=True)
    step = session.region(lambda x: x + 1)
    for rows in (4, 8, 9, 4, 8, 9):  # a bucket's own size, or beyond the largest
        x = torch.randn(rows, 2)
        assert torch.equal(step(replay.padded(x)), x + 1)
    assert made == [] and step.bucket_bases == {} and step.router.padded_calls == 6


def test_what_a_call_pads_to_and_where_its_markers_lie():
    x, y = torch.randn(3, 2), torch.randn(3, 5)
    args, kwargs = (1, [x, 2], replay.padded(x)), {"k": (4,), "y": replay.padded(y)}
    marked = routing.marked_call(args, kwargs, [2, 4, 8], "r")
    assert (marked.dim, marked.rows, marked.target, marked.positions, marked.names) == (0, 3, 4, [2], ["y"])
    unpadded_args, unpadded_kwargs = marked.arguments([x, y])
    assert unpadded_args == (1, args[1], x) and unpadded_kwargs == {"k": (4,), "y": y}
    call = marked.unpadded()  # flattened once, its markers' leaves replaced
    assert call.leaves[3] is x and call.leaves[5] is y and marked.flat_call() is marked.flat_call()
    assert call.spec == region_keys.flat_call(args, kwargs).spec
    assert region_keys.flat_call(unpadded_args, unpadded_kwargs).leaves == call.leaves
    flat = (replay.padded(x), 7)
    assert routing.marked_call(flat, {}, [8], "r").unpadded().leaves == [x, 7]
    with pytest.raises(ValueError, match=r"region r: argument args\[0\] is replay.padded\(\), but the session has no"):
        routing.marked_call(flat, {}, None, "r")
