"""Padded calls routed: to the bucket's graph (padded, or padded in place into its staged
buffers), or, in a polymorphic session, to a variant of it at the call's own size.

replay.buckets pads, runs and slices; replay.polymorphic observes a size and makes a variant;
this module decides, for a region's padded call, which of them serves it and learns what the
next call needs (the bucket's base graph, the sizes its graph cannot serve).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable, Sequence

import torch

from jitcore import GlobalDriftError
from jitcore.for_replay import current_stream_reader
from replay import buckets, padding, polymorphic, recording, region_keys
from replay.dispatch import MISS, SHARED_CAPTURE_EXCLUSION
from replay.dynamic import Dynamic
from replay.errors import DynamicScalarError, RefusedKey, ReplayError
from replay.graph import MISMATCH, RecordedGraph
from replay.keying import DYNAMIC_MARK, KeyText, counted_shapes
from replay.lifecycle import REPLAYING, Entry
from replay.region_keys import FlatCall, grad_leaves

log = logging.getLogger("replay")

#: Marks a size's count in admission's sketch, apart from its key's (see Router._polymorphic).
_VARIANT = "variant"


def holds_a_pad_of(buffer: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether a graph's staged ``buffer`` may take ``tensor`` padded (Router._pad_in_place).
    The pre-key that found the graph holds shapes only, and its guard sees the buffer in the
    argument's place, so the buffer stands for the padded tensor and must be what a pad of it
    would be: of its dtype and device (the padded shape by the pre-key; contiguity, plain
    type and no grad by padding.pad_into). A call of the same shapes in int32 or float64 has
    a graph of its own, or none: never a float32 graph's buffer."""
    return buffer.dtype is tensor.dtype and buffer.device == tensor.device


def bucket_for(size: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``size`` (None beyond the largest: no padding); the
    buckets are sorted (the policy sorts them)."""
    at = bisect.bisect_left(sizes, size)
    return sizes[at] if at < len(sizes) else None


def marked_call(args: tuple, kwargs: dict, sizes: Sequence[int] | None, name: str) -> buckets.Marked:
    """A region call with markers as :class:`replay.buckets.Marked`: the size they agree on
    and the bucket it pads to, or the ValueError of a call that cannot pad (a session without
    buckets, markers that disagree on the dimension or the size they pad), raised before
    anything runs."""
    if sizes is None:
        raise ValueError(
            f"region {name}: argument {_where(args, kwargs)[0]} is replay.padded(), but the session has no "
            "buckets: capture(buckets=[...]) lists the sizes to pad to"
        )
    found, positions, names = [], [], []
    for i, a in enumerate(args):
        if a.__class__ is buckets.Padded:
            found.append(a)
            positions.append(i)
    if kwargs:
        for k, v in kwargs.items():
            if v.__class__ is buckets.Padded:
                found.append(v)
                names.append(k)
    dim, rows = _agreed_or_refused(found, args, kwargs, name)
    bucket = bucket_for(rows, sizes)
    return buckets.Marked(args, kwargs, found, positions, names, dim, rows, rows if bucket is None else bucket)


def _agreed_or_refused(found: list[buckets.Padded], args: tuple, kwargs: dict, name: str) -> tuple[int, int]:
    """(dim, size) every marker pads, or the ValueError saying how they disagree."""
    first = found[0]
    dim = first.dim
    rows = first.tensor.shape[dim]
    for marker in found[1:]:
        if marker.dim != dim:
            listed = ", ".join(f"{where} dim {m.dim}" for where, m in zip(_where(args, kwargs), found))
            raise ValueError(
                f"region {name}: padded arguments must pad the same dimension (outputs are sliced along it), "
                f"got {listed}"
            )
        if marker.tensor.shape[dim] != rows:
            listed = ", ".join(f"{where} {m.tensor.shape[m.dim]}" for where, m in zip(_where(args, kwargs), found))
            raise ValueError(f"region {name}: padded arguments must agree on the size they pad, got {listed}")
    return dim, rows


def _where(args: tuple, kwargs: dict) -> list[str]:
    """Where each padded argument is, positional ones first (for errors)."""
    return [f"args[{i}]" for i, a in enumerate(args) if a.__class__ is buckets.Padded] + [
        f"{k}=" for k, v in kwargs.items() if v.__class__ is buckets.Padded
    ]


class Router:
    """A region's padded calls."""

    def __init__(self, region) -> None:
        self.region = region
        self.padded_calls = 0  # calls that took the padded path (for verify_every)
        # the output memory of the region's graphs and unanalysed captures, merged (see
        # replay_writes); None when a graph, capture or output slot came or went since
        self._output_ranges: region_keys.MergedRanges | None = None
        self._stream_now: Callable[[int], int] | None = None  # the current stream's handle (_pad_into)

    def call_padded(self, args: tuple, kwargs: dict):
        """Pad to the bucket, call (the bucket's key replays like any other), slice back; every
        ``verify_every``-th padded call is also run unpadded and compared (replay.buckets). In a
        polymorphic session a size the bucket's graph serves at its own size is not padded
        (:meth:`_polymorphic`), and the padded call tells which graph serves its bucket."""
        region = self.region
        policy = region.session.policy
        marked = marked_call(args, kwargs, policy.buckets, region.name)
        unseen = None
        if policy.polymorphic:
            result, unseen = self._polymorphic(marked)
            if result is not MISS:
                return result
        self.padded_calls += 1
        verify = None
        if policy.verify_every and self.padded_calls % policy.verify_every == 0:
            region.session.counters.verifications += 1
            verify = region.fn
        result, pads = buckets.call(
            region,
            marked,
            region.name,
            verify=verify,
            run_declined=region.run_declined,
            replay_writes=self.replay_writes,
            in_place=self._pad_in_place,
        )
        if unseen is not None and marked.pads:
            self._learn_base(unseen, marked.flat(pads))
        return result

    # --- padding straight into a graph's staged buffers ------------------------------------------
    def _pad_in_place(self, marked: buckets.Marked) -> tuple[object, list] | None:
        """A positional padded call whose bucket's graph stages a padded argument (a torch op
        or a foreign kernel reads it): pad it straight into the graph's staged buffer and
        replay with that buffer as the argument, so the graph skips its copy in and back
        (RecordedGraph.in_place_buffer). Returns (result, the padded tensors), or None: the
        usual path then pads into temporaries (and this call may have written the buffer,
        which every replay writes before reading it).

        The buffer is the graph's own, so it goes to nothing but that graph's replay: not
        with ``verify_every`` (a verified or declined call runs the region on its
        arguments), nor before the key's guard passed, nor from a stream other than the one
        the session replayed on last (a replay there may still read it: the stream switch of
        the replay comes after the pad); a replay that declines leaves the call to the usual
        path. Outputs never view it (those inputs are not taken in place)."""
        region = self.region
        if not region.by_pre_key or region.session.policy.verify_every:  # (verified runs never replay in place)
            return None
        args, dim, bucket = marked.args, marked.dim, marked.target
        padded, pre = [], []  # the markers' places; the padded call's pre-key (dispatch.pre_key)
        try:
            for i, arg in enumerate(args):
                kind = arg.__class__
                if kind is buckets.Padded:
                    shape = [*arg.tensor.shape]  # (cheaper than slicing a torch.Size)
                    shape[dim] = bucket
                    pre.append(tuple(shape))  # equal to the torch.Size the key holds, and hashed alike
                    padded.append(i)
                elif kind is torch.Tensor:
                    pre.append(arg.shape)
                else:
                    pre.append(DYNAMIC_MARK if isinstance(arg, Dynamic) else arg)
            candidates = region.by_pre_key.get(tuple(pre))
        except (TypeError, RuntimeError):  # an unhashable constant; a strided nested tensor's shape
            return None  # the usual path refuses them
        temporaries: dict[int, torch.Tensor] = {}  # padded arguments no graph takes in place, padded once
        for guard, run, entry in candidates or ():
            leaves, buffers = self._in_place_leaves(args, padded, entry, run)
            if not buffers:
                continue
            for i in padded:
                if leaves[i] is args[i]:  # not taken in place: padded into a temporary
                    if i not in temporaries:
                        marker = args[i]
                        temporaries[i] = padding.pad(marker.tensor, dim, bucket, marker.fill, marker.bits)
                    leaves[i] = temporaries[i]
            if guard(*leaves):
                return self._pad_into(entry, run, args, leaves, buffers, padded, dim)
        return None

    @staticmethod
    def _in_place_leaves(args: tuple, padded: list, entry: Entry, run: Callable) -> tuple[list, list]:
        """The call's leaves with ``entry``'s staged buffers in the places its graph takes in
        place, and [(place, buffer)]; no buffers where the graph takes none of them, or a
        buffer is of another dtype or device (another key's graph)."""
        graph = entry.graph
        if graph is None or not graph.in_place or run is not graph.replay:
            return [], []
        taken = graph.in_place  # input -> (buffer, its copy nodes)
        leaves, buffers = list(args), []
        for i in padded:
            held = taken.get(i)
            if held is not None:
                if not holds_a_pad_of(held[0], args[i].tensor):
                    return [], []
                leaves[i] = held[0]
                buffers.append((i, held[0]))
        return leaves, buffers

    def _pad_into(self, entry: Entry, run: Callable, args: tuple, leaves: list, buffers: list, padded: list, dim: int):
        """:meth:`_pad_in_place` once ``entry``'s guard passed: pad into its buffers and
        replay, or None (the usual path takes the call)."""
        region = self.region
        session = region.session
        if region.snapshot is not None:
            try:
                region.snapshot.check()
            except GlobalDriftError:
                return None  # the usual path drops the graphs
        stream_now = self._stream_now
        if stream_now is None:  # the backend's, read once (get_backend reads the environment)
            stream_now = self._stream_now = current_stream_reader()
        if stream_now(entry.key[0]) != session.last_stream[0]:
            return None
        for i, buffer in buffers:
            marker = args[i]
            if not padding.pad_into(marker.tensor, dim, marker.bits, buffer):
                return None
        session.keys.touch(entry)
        result = run(*leaves)
        if result is MISMATCH:
            return None
        session.counters.padded_in_place += len(buffers)
        return result, [leaves[i] for i in padded]

    # --- polymorphic replay (replay.polymorphic) -----------------------------------------------
    def _polymorphic(self, marked: buckets.Marked) -> tuple[object, tuple | None]:
        """A padded call smaller than its bucket, at its own size: replayed by its variant of
        the bucket's graph, or observed (an eager run, this call's result) to make one once
        the bucket's graph is known. Returns (result or ``MISS``: pad it, the call's unpadded
        key when the padded call should tell which graph serves its bucket)."""
        region = self.region
        session = region.session
        if not marked.pads or not session.can_record():
            return MISS, None
        call = marked.unpadded()
        if region.snapshot is not None:
            try:
                region.snapshot.check()
            except GlobalDriftError:
                return region.rekey(marked.args, marked.kwargs), None
        try:
            key = region_keys.region_key(session.current_device(), call.spec, call.leaves, call.paths)
        except RefusedKey as refused:
            return region.refused(refused, call), None
        if grad_leaves(key) and torch.is_grad_enabled():
            return MISS, None  # padded: its key runs eagerly (replay.keying.CallKeys.needs_autograd)
        state = region.variants.get(key)
        if isinstance(state, polymorphic.VariantGraph):
            return region.run_graph(state, call, None), None
        if state is not None:
            return MISS, None  # the bucket's graph cannot serve this size: padded
        entry = region.bucket_bases.get((marked.target, call.spec))
        if entry is None or entry.state is not REPLAYING or entry.graph is None:
            return MISS, (marked.target, call.spec)
        return self._observed_when_admitted(entry.graph, key, call), None

    def _observed_when_admitted(self, base: RecordedGraph, key: tuple, call: FlatCall):
        """An observation costs several eager calls (replay.polymorphic), so sizes are
        admitted to one as keys are to a recording: called more than ``record_after`` times
        recently, within the recording budget (which it is charged to). A size that never
        comes back, or comes while the budget is spent, is padded (MISS): a replay, cheaper
        than eager."""
        region = self.region
        admission = region.session.admission
        shapes = counted_shapes(region.session.current_device, call.spec, call.leaves, call.paths)
        count = admission.called((region, _VARIANT, shapes))  # (counted apart from the key's calls)
        if count <= admission.record_after or not admission.may_record():
            return MISS
        started = time.perf_counter()
        try:
            return self._observe_variant(base, key, call)
        finally:
            admission.recorded(time.perf_counter() - started)

    def _learn_base(self, bucket: tuple, padded: FlatCall) -> None:
        """After a padded call: the graph of its bucket, once recorded, is the one the sizes of
        that bucket are observed against from then on (``bucket``: (size, argument structure))."""
        region = self.region
        try:
            entry = region.entries.get(
                region_keys.region_key(region.session.current_device(), padded.spec, padded.leaves, padded.paths)
            )
        except RefusedKey:
            return  # its calls run eagerly
        if entry is not None and entry.state is REPLAYING and entry.graph is not None:
            region.session.keys.learn_base(region, bucket, entry)

    def _observe_variant(self, base: RecordedGraph, key: tuple, call: FlatCall):
        """Run the call eagerly under observation (its result is this call's) and make the
        size a variant of ``base``, or remember why it cannot be one."""
        region = self.region
        session = region.session
        region.count_eager(None)
        with SHARED_CAPTURE_EXCLUSION:
            try:
                held = region.recorder.tensors_held_by_name()
                observation = polymorphic.observe(region.fn, call.spec, call.leaves, call.paths, held)
            except DynamicScalarError as error:
                raise ReplayError(
                    f"region {region.name}: at this size it uses a dynamic() value where the bucket's graph does not "
                    f"({error}); the call stopped part way, so its arguments may be changed. Its Python takes "
                    "another path at this size: polymorphic=False pads it instead"
                ) from error
        result = polymorphic.plain_outputs(observation.outputs)
        with session.lock:
            if base.released:
                return result
            entry = Entry(region, key, (region, key))
            try:
                variant = polymorphic.make_variant(
                    base, key, entry, call.spec, call.leaves, call.paths, observation, session.keys.drop_variant
                )
            except polymorphic.Unmatched as why:
                session.keys.not_a_variant(region, key, str(why))
                session.counters.not_polymorphic += 1
                log.info("region %s, key %s: padded, not served at its size: %s", region.name, KeyText(key), why)
                return result
            session.keys.vary(entry, variant)
            session.counters.variants += 1
            log.info("region %s, key %s: served by its bucket's graph at its own size", region.name, KeyText(key))
        return result

    def report(self) -> list[str]:
        """Which sizes of this region its buckets' graphs serve at their own size, and why the
        others are padded (the first reason of each kind)."""
        variants = self.region.variants
        served = sum(isinstance(v, polymorphic.VariantGraph) for v in variants.values())
        reasons: dict[str, int] = {}
        for value in variants.values():
            if isinstance(value, str):
                reasons[value] = reasons.get(value, 0) + 1
        lines = [f"region {self.region.name}: {served} sizes served at their own size, {sum(reasons.values())} padded"]
        lines += [f"  padded ({count}): {reason}" for reason, count in sorted(reasons.items(), key=lambda r: -r[1])]
        return lines

    # --- the memory replays write ------------------------------------------------------------------
    def replay_writes(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` overlaps the output memory of one of this region's graphs (asked
        on every padded call that copies an argument: a search of the merged ranges, rebuilt
        only when a graph or a capture of the region came or went)."""
        ranges = self._output_ranges
        if ranges is None:
            region = self.region
            spans = []
            for entry in region.entries.values():
                if entry.graph is not None:
                    memory = entry.graph.output_memory
                elif entry.unanalysed is not None:  # its next call analyses it, then replays
                    memory = recording.owned_output_memory(entry.unanalysed)
                else:
                    continue
                spans += [(start, start + size) for start, size in memory.items()]
            spans += region.session.output_slot_ranges(region)
            ranges = self._output_ranges = region_keys.MergedRanges(spans)
        return ranges.overlaps(*region_keys.byte_range(tensor))

    def outputs_changed(self) -> None:
        self._output_ranges = None
