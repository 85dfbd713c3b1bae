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
unpadded, eagerly, and compares (see :func:`verify`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from replay import padding, region_keys
from replay.errors import ReplayMismatchError
from replay.graph import bitwise_equal, clone_preserving_sharing


class Padded:
    """A region argument to pad to the session's bucket sizes (see :func:`padded`). Only a
    top-level argument of a region call (positional or keyword) may be one; it is unhashable,
    so anywhere else keying the call refuses it."""

    __slots__ = ("tensor", "dim", "fill", "written", "bits")
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, tensor: torch.Tensor, dim: int, fill: bool | int | float, written: bool, bits: int):
        self.tensor, self.dim, self.fill, self.written = tensor, dim, fill, written
        self.bits = bits  # the fill's bytes in the tensor's dtype (replay.padding.fill_bits)

    def __repr__(self) -> str:
        return f"padded(<{tuple(self.tensor.shape)} {self.tensor.dtype}>, dim={self.dim}, fill={self.fill!r})"


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


def markers(args: tuple, kwargs: dict) -> list[Padded]:
    """The ``replay.padded`` markers among a call's arguments, positional ones first."""
    found = [a for a in args if a.__class__ is Padded]
    if kwargs:
        found += [v for v in kwargs.values() if v.__class__ is Padded]
    return found


def unwrapped(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The call's arguments with each marker replaced by its tensor (the unpadded call)."""
    return tuple(map(_unwrapped, args)), {k: _unwrapped(v) for k, v in kwargs.items()}


def agreed_size(marked: Sequence[Padded]) -> tuple[int, int] | None:
    """(dim, size) that every marker pads, or None where they disagree (:func:`call` says
    how, in its error)."""
    dim = marked[0].dim
    rows = marked[0].tensor.shape[dim]
    if any(m.dim != dim or m.tensor.shape[dim] != rows for m in marked):
        return None
    return dim, rows


def bucket_for(size: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``size`` (None beyond the largest: no padding); the
    buckets are sorted (the policy sorts them)."""
    at = bisect.bisect_left(buckets, size)
    return buckets[at] if at < len(buckets) else None


def call(
    run: Callable,
    args: tuple,
    kwargs: dict,
    buckets: Sequence[int] | None,
    name: str,
    *,
    run_eagerly: Callable | None = None,
    replay_writes: Callable[[torch.Tensor], bool] | None = None,
    in_place: Callable[[tuple, int, int], tuple[object, list] | None] | None = None,
) -> tuple[object, int, int, list[tuple[Padded, torch.Tensor]]]:
    """Pad, run, copy back, slice: (result, rows of the call, bucket, [(marker, padded)]).

    A padded argument that is copied is not what the graph sees, so the graph cannot tell
    that it lies in memory its replay writes (``replay_writes``: a previous output of the
    region fed back, ``h = step(replay.padded(h))``); the replay would overwrite it and hand
    out outputs sharing its memory. Such a call is run by ``run_eagerly`` instead.

    ``in_place(args, dim, bucket)``: the session's replay that pads straight into a graph's
    staged buffers (replay.routing.Router._pad_in_place), tried first for positional calls: (result,
    [(marker, padded)]), or None where it does not serve the call."""
    marked = markers(args, kwargs)
    if buckets is None:
        raise ValueError(
            f"region {name}: argument {_where(args, kwargs)[0]} is replay.padded(), but the session has no "
            "buckets: capture(buckets=[...]) lists the sizes to pad to"
        )
    dim, rows = _agreed_or_refused(marked, args, kwargs, name)
    bucket = bucket_for(rows, buckets)
    target = rows if bucket is None else bucket
    if target == rows:
        plain_args, plain_kwargs = unwrapped(args, kwargs)
        return run(*plain_args, **plain_kwargs), rows, target, [(marker, marker.tensor) for marker in marked]
    if _may_share_memory(args, kwargs):
        _refuse_shared_memory(name, args, kwargs)
    if replay_writes is not None and run_eagerly is not None and _any_replay_writes(replay_writes, marked):
        run = run_eagerly
    elif in_place is not None and not kwargs:
        served = in_place(args, dim, target)
        if served is not None:
            result, pads = served
            return _copied_back_and_sliced(result, pads, dim, target, rows), rows, target, pads
    pads: list[tuple[Padded, torch.Tensor]] = []

    def pad(value: object) -> object:
        if value.__class__ is not Padded:
            return value
        grown = padding.pad(value.tensor, dim, target, value.fill, value.bits)
        pads.append((value, grown))
        return grown

    result = run(*[pad(a) for a in args], **{k: pad(v) for k, v in kwargs.items()})
    return _copied_back_and_sliced(result, pads, dim, target, rows), rows, target, pads


def _agreed_or_refused(marked: list[Padded], args: tuple, kwargs: dict, name: str) -> tuple[int, int]:
    """(dim, size) every marker pads, or the ValueError saying how they disagree."""
    first = marked[0]
    dim = first.dim
    rows = first.tensor.shape[dim]
    for marker in marked[1:]:
        if marker.dim != dim:
            listed = ", ".join(f"{where} dim {m.dim}" for where, m in zip(_where(args, kwargs), marked))
            raise ValueError(
                f"region {name}: padded arguments must pad the same dimension (outputs are sliced along it), "
                f"got {listed}"
            )
        if marker.tensor.shape[dim] != rows:
            listed = ", ".join(f"{where} {m.tensor.shape[m.dim]}" for where, m in zip(_where(args, kwargs), marked))
            raise ValueError(f"region {name}: padded arguments must agree on the size they pad, got {listed}")
    return dim, rows


def _any_replay_writes(replay_writes: Callable[[torch.Tensor], bool], marked: list[Padded]) -> bool:
    for marker in marked:  # (a loop: a generator in any() costs every padded call more)
        if replay_writes(marker.tensor):
            return True
    return False


def _copied_back_and_sliced(result: object, pads: list, dim: int, bucket: int, rows: int) -> object:
    """After the padded run: the call's rows of each ``written`` argument copied back into
    it, and the outputs sliced to the call's rows."""
    for marker, grown in pads:
        if marker.written:
            marker.tensor.copy_(grown.narrow(dim, 0, rows))
    return slice_outputs(result, dim, bucket, rows)


def _unwrapped(value: object) -> object:
    return value.tensor if value.__class__ is Padded else value


def _where(args: tuple, kwargs: dict) -> list[str]:
    """Where each padded argument is, in the order :func:`call` lists them (for errors)."""
    return [f"args[{i}]" for i, a in enumerate(args) if a.__class__ is Padded] + [
        f"{k}=" for k, v in kwargs.items() if v.__class__ is Padded
    ]


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


def _refuse_shared_memory(name: str, args: tuple, kwargs: dict) -> None:
    """A padded argument is copied: memory it shares with another argument (the same tensor
    passed twice, a view of it) would stop being shared, and the region would see writes
    through one but not the other. Refused, before anything runs."""
    _spec, leaves, paths = region_keys.flatten(args, kwargs)  # a Padded marker is a leaf of its own
    tensors = []  # (path, tensor, padded)
    for path, leaf in zip(paths, leaves):
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


def verify(fn: Callable, args: tuple, kwargs: dict, padded_call: Callable[[], object], name: str) -> object:
    """Run ``fn`` unpadded and eagerly on copies of the arguments (every tensor, nested ones
    too, copied so that arguments sharing memory still share it), then the padded call on the
    real ones, and compare the outputs and every tensor argument afterwards. Equal bit for
    bit passes; otherwise within torch's default tolerance for the dtype passes (a padded
    matmul may use another kernel and round differently); anything else raises
    ReplayMismatchError: the region's rows are not independent, and padding changes its
    results."""
    spec, leaves, paths = region_keys.flatten(*unwrapped(args, kwargs))
    copies = clone_preserving_sharing(region_keys.plain_leaves(leaves))
    copy_args, copy_kwargs = region_keys.unflatten(spec, copies)
    expected = fn(*copy_args, **copy_kwargs)
    got = padded_call()
    _compare(name, "output", expected, got)
    for path, real, copy in zip(paths, leaves, copies):
        if isinstance(real, torch.Tensor):
            _compare(name, f"argument {path} after the call", copy, real)
    return got


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
