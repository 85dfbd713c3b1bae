"""Bucketing: a call whose batch size varies runs the graph of the next bucket size.

A region argument wrapped in :func:`padded` is filled up along one dimension to the smallest
size in the session's ``buckets`` that holds it (the rows beyond the call's own are ``fill``),
the region runs on the padded arguments (replaying the bucket's graph once it is recorded),
and every tensor output whose size along that dimension is the bucket size is sliced back to
the call's size. A loop over batch sizes 1..256 then needs nine graphs (1, 2, 4, ..., 256)
instead of 256, each replayed often (vLLM and SGLang pad to a fixed list of captured sizes the
same way).

Padding is exact only for regions whose rows are independent: row ``i`` of every output
depends on row ``i`` of the padded arguments alone (and on the other arguments), as in
elementwise kernels, matmuls against weights, per-token attention over a cache. A region that
mixes rows (a softmax or mean over the batch, a sort) gives other results when padded: say so
by not padding it. ``verify_every`` catches it: every Nth padded call also runs the region
unpadded, eagerly, and compares (see :func:`call`).

replay.routing finds what a padded call pads to (:class:`Marked`) and which graph serves it;
this module pads, runs, copies back, slices, and verifies.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from replay import padding, region_keys
from replay.errors import ReplayMismatchError
from replay.graph import bitwise_equal, clone_preserving_sharing
from replay.padding import Padded
from replay.region_keys import FlatCall


def padded(tensor: torch.Tensor, dim: int = 0, fill: bool | int | float = 0, *, written: bool = False) -> Padded:
    """Mark a tensor argument of a region as padded along ``dim`` to the session's buckets
    (``capture(buckets=[...])``). ``fill``: the value of the rows added (it must be exact in
    the tensor's dtype). ``written=True``: the region writes this argument, and the rows of
    the call are copied back into ``tensor`` after it (without it, the region must only read
    it: writes would land in the padded copy)."""
    if tensor.__class__ is not torch.Tensor and not isinstance(tensor, torch.Tensor):
        raise TypeError(f"replay.padded() takes a tensor, got {type(tensor).__qualname__}")
    ndim = tensor.dim()
    if (dim.__class__ is not int and (isinstance(dim, bool) or not isinstance(dim, int))) or not -ndim <= dim < ndim:
        raise ValueError(f"replay.padded(): dim must be an int in [-{ndim}, {ndim}), got {dim!r}")
    if written is not False and written is not True:
        raise TypeError(f"replay.padded(): written must be True or False, got {written!r}")
    if fill.__class__ is int and fill == 0:  # the default
        bits = padding.zero_fill_bits(tensor.dtype)
    elif isinstance(fill, (bool, int, float)):
        bits = padding.fill_bits(fill, tensor.dtype)
    else:
        raise TypeError(f"replay.padded(): fill must be a bool, int or float, got {type(fill).__qualname__}")
    if bits is None:
        raise ValueError(f"replay.padded(): fill {fill!r} is not exact in {tensor.dtype}")
    return Padded(tensor, dim % ndim, fill, written, bits)


def has_padded(args: tuple, kwargs: dict) -> bool:
    return Padded in map(type, args) or (bool(kwargs) and Padded in map(type, kwargs.values()))


@attrs.define
class Marked:
    """A call with ``replay.padded`` markers: where they are, the size they agree on and what
    it pads to (replay.routing finds them). The padded path reads it, and flattens the call
    once, where a step needs its leaves (:meth:`flat_call`): the unpadded and the padded call
    are then its leaves replaced. Never changed once made (but for that one flattening)."""

    args: tuple
    kwargs: dict
    markers: list[Padded]  # positional ones first
    positions: list[int]  # the positional markers' places among ``args``
    names: list[str]  # the keyword markers' names
    dim: int
    rows: int  # the call's own size along ``dim``
    target: int  # what it pads to: its bucket, or ``rows`` beyond the largest bucket
    _call: FlatCall | None = attrs.field(default=None, init=False)
    _places: list[int] = attrs.field(factory=list, init=False)  # each marker's leaf

    @property
    def pads(self) -> bool:
        """Whether the call is smaller than its bucket (else it runs as it is)."""
        return self.target != self.rows

    def arguments(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple, dict]:
        """(args, kwargs) with each marker replaced by its tensor in ``tensors`` (its own: the
        unpadded call; grown: the padded one)."""
        args = list(self.args)
        for position, tensor in zip(self.positions, tensors):
            args[position] = tensor
        kwargs = self.kwargs
        if self.names:
            kwargs = dict(kwargs)
            kwargs.update(zip(self.names, tensors[len(self.positions) :]))
        return tuple(args), kwargs

    def flat_call(self) -> FlatCall:
        """The call flattened, each marker a leaf of its own: made on first use, once. Why not
        up front: a padded call that replays its bucket's graph needs no leaves (only a
        verification, a shared-memory check, a size observed, a declined call or the bucket's
        graph learned do)."""
        if self._call is None:
            call = region_keys.flat_call(self.args, self.kwargs)
            starts = call.starts  # (None: a flat call, argument i is leaf i)
            places = [i if starts is None else starts[i] for i in self.positions]
            if self.names:
                order = {name: j for j, name in enumerate(self.kwargs, len(self.args))}
                places += [starts[order[name]] for name in self.names]
            self._call, self._places = call, places
        return self._call

    def flat(self, tensors: Sequence[torch.Tensor]) -> FlatCall:
        """:meth:`flat_call` with each marker replaced by its tensor in ``tensors``."""
        call = self.flat_call()
        leaves = list(call.leaves)
        for place, tensor in zip(self._places, tensors):
            leaves[place] = tensor
        return FlatCall(call.spec, leaves, call.paths, call.starts)

    def unpadded(self) -> FlatCall:
        """:meth:`flat` of the markers' own tensors: the call as if it had no markers."""
        return self.flat([marker.tensor for marker in self.markers])


def call(
    run: Callable,
    marked: Marked,
    name: str,
    *,
    verify: Callable | None = None,
    run_declined: Callable[[FlatCall], object] | None = None,
    replay_writes: Callable[[torch.Tensor], bool] | None = None,
    in_place: Callable[[Marked], tuple[object, list] | None] | None = None,
) -> tuple[object, list[torch.Tensor]]:
    """Pad, run, copy back, slice: (result, the tensors the markers became). ``verify``: the
    region's function, which runs first, unpadded, on copies of the arguments, its outputs
    and arguments then compared with the padded call's (:func:`_compare_with`).

    A call that needs no padding runs ``run`` on the markers' tensors. A padded argument that
    is copied is not what the graph sees, so the graph cannot tell that it lies in memory its
    replay writes (``replay_writes``: a previous output of the region fed back,
    ``h = step(replay.padded(h))``); the replay would overwrite it and hand out outputs
    sharing its memory. Such a call is run by ``run_declined`` instead, on the padded call.

    ``in_place(marked)``: the session's replay that pads straight into a graph's staged
    buffers (replay.routing.Router._pad_in_place), tried first for positional calls: (result,
    the padded tensors), or None where it does not serve the call."""
    expected = _unpadded_run(verify, marked) if verify is not None else None
    if not marked.pads:
        pads = [marker.tensor for marker in marked.markers]
        args, kwargs = marked.arguments(pads)
        result = run(*args, **kwargs)
    else:
        result, pads = _padded_run(run, marked, name, run_declined, replay_writes, in_place)
    if expected is not None:
        _compare_with(name, expected, result)
    return result, pads


def _padded_run(
    run: Callable, marked: Marked, name: str, run_declined, replay_writes, in_place
) -> tuple[object, list[torch.Tensor]]:
    """:func:`call` of a call smaller than its bucket."""
    found = marked.markers
    if _may_share_memory(marked.args, marked.kwargs):
        _refuse_shared_memory(name, marked)
    declined = replay_writes is not None and run_declined is not None and _any_replay_writes(replay_writes, found)
    if not declined and in_place is not None and not marked.kwargs:
        served = in_place(marked)
        if served is not None:
            result, pads = served
            return _copied_back_and_sliced(result, marked, pads), pads
    dim, target = marked.dim, marked.target
    pads = [padding.pad(marker.tensor, dim, target, marker.fill, marker.bits) for marker in found]
    if declined:
        result = run_declined(marked.flat(pads))
    else:
        args, kwargs = marked.arguments(pads)
        result = run(*args, **kwargs)
    return _copied_back_and_sliced(result, marked, pads), pads


def _any_replay_writes(replay_writes: Callable[[torch.Tensor], bool], marked: list[Padded]) -> bool:
    for marker in marked:  # (a loop: a generator in any() costs every padded call more)
        if replay_writes(marker.tensor):
            return True
    return False


def _copied_back_and_sliced(result: object, marked: Marked, pads: list) -> object:
    """After the padded run: the call's rows of each ``written`` argument copied back into
    it, and the outputs sliced to the call's rows."""
    dim, rows = marked.dim, marked.rows
    for marker, grown in zip(marked.markers, pads):
        if marker.written:
            marker.tensor.copy_(grown.narrow(dim, 0, rows))
    return slice_outputs(result, dim, marked.target, rows)


def _may_share_memory(args: tuple, kwargs: dict) -> bool:
    """Whether the call holds a tensor besides one padded argument (or a container that may
    hold one): only then can a padded argument share memory with another."""
    tensors = 0
    for value in (*args, *kwargs.values()):
        kind = value.__class__
        if kind is Padded or kind is torch.Tensor:
            tensors += 1
        elif kind not in region_keys.PLAIN_CONSTANTS:
            return True
    return tensors > 1


def _refuse_shared_memory(name: str, marked: Marked) -> None:
    """A padded argument is copied: memory it shares with another argument (the same tensor
    passed twice, a view of it) would stop being shared, and the region would see writes
    through one but not the other. Refused, before anything runs."""
    tensors = []  # (path, tensor, padded); a Padded marker is a leaf of its own
    call = marked.flat_call()
    for path, leaf in zip(call.paths, call.leaves):
        if type(leaf) is Padded:
            tensors.append((path, leaf.tensor, True))
        elif isinstance(leaf, torch.Tensor):
            tensors.append((path, leaf, False))
    for i, j in region_keys.pattern_of([(n, *region_keys.byte_range(t)) for n, (_, t, _) in enumerate(tensors)]):
        if tensors[j][2] and not tensors[i][2]:
            i, j = j, i
        if tensors[i][2]:
            raise ValueError(
                f"region {name}: padded argument {tensors[i][0]} shares memory with {tensors[j][0]}; a padded "
                "argument is copied, so that sharing would be lost (pass separate tensors, or do not pad it)"
            )


def slice_outputs(result: object, dim: int, bucket: int, rows: int) -> object:
    """Every tensor of ``result`` whose size along ``dim`` is ``bucket``, narrowed to ``rows``."""
    if result.__class__ is torch.Tensor:  # the usual result, without a walk of a container
        return _narrowed(result, dim, rows) if result.dim() > dim and result.shape[dim] == bucket else result
    spec, leaves, _ = region_keys.flatten((result,), {}, walk_dataclasses=True)
    sliced = [
        _narrowed(leaf, dim, rows)
        if isinstance(leaf, torch.Tensor) and leaf.dim() > dim and leaf.shape[dim] == bucket
        else leaf
        for leaf in leaves
    ]
    return region_keys.unflatten(spec, sliced)[0][0]


def _narrowed(tensor: torch.Tensor, dim: int, rows: int) -> torch.Tensor:
    """``tensor.narrow(dim, 0, rows)``; along the first dimension as ``tensor[:rows]``, the
    same view made in less of the host's time."""
    return tensor[:rows] if dim == 0 else tensor.narrow(dim, 0, rows)


def _unpadded_run(fn: Callable, marked: Marked) -> tuple:
    """What a verified padded call is compared with: ``fn`` run unpadded and eagerly on copies
    of the arguments (every tensor, nested ones too, copied so that arguments sharing memory
    still share it): (its outputs, the copies, the real leaves and their paths)."""
    unpadded = marked.unpadded()
    copies = clone_preserving_sharing(region_keys.plain_leaves(unpadded.leaves))
    copy_args, copy_kwargs = region_keys.unflatten(unpadded.spec, copies)
    return fn(*copy_args, **copy_kwargs), copies, unpadded.leaves, unpadded.paths


def _compare_with(name: str, expected: tuple, got: object) -> None:
    """The padded call's outputs and its tensor arguments afterwards against the unpadded
    run's (:func:`_unpadded_run`). Equal bit for bit passes; otherwise within torch's default
    tolerance for the dtype passes (a padded matmul may use another kernel and round
    differently); anything else raises ReplayMismatchError: the region's rows are not
    independent, and padding changes its results."""
    outputs, copies, leaves, paths = expected
    _compare(name, "output", outputs, got)
    for path, real, copy in zip(paths, leaves, copies):
        if isinstance(real, torch.Tensor):
            _compare(name, f"argument {path} after the call", copy, real)


def _compare(name: str, what: str, expected: object, got: object) -> None:
    expected_spec, expected_leaves, paths = region_keys.flatten((expected,), {}, walk_dataclasses=True)
    got_spec, got_leaves, _ = region_keys.flatten((got,), {}, walk_dataclasses=True)
    if expected_spec != got_spec:
        raise ReplayMismatchError(f"region {name}: the padded call's {what} has another structure than unpadded")
    for path, want, have in zip(paths, expected_leaves, got_leaves):
        if bitwise_equal(want, have):
            continue
        if not isinstance(want, torch.Tensor):
            raise ReplayMismatchError(f"region {name}: padded, {what} {path} is {have!r}, unpadded {want!r}")
        try:
            torch.testing.assert_close(have, want, equal_nan=True)
        except AssertionError as error:
            raise ReplayMismatchError(
                f"region {name}: padding changed {what} {path}: its rows are not independent, so it "
                f"must not be padded ({str(error).splitlines()[0]})"
            ) from None
