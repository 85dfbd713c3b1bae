"""Output memory shared by the graphs of a region: slots.

Why: a graph's replay copies its outputs out of the shared pool (another graph's scratch may
lie there) into memory outside it. With that memory owned by each graph, N recorded shapes
would hold N output sets: a region ending in a wide logits matmul, recorded for many batch
sizes, would hold several times the memory of its largest shape alone. vLLM shares one output
buffer and declares every output valid only until the next replay of any graph; here that
would make ``a = step(x4); b = step(x8)`` overwrite ``a``, silently.

So a region keeps a few *slots* per device, each big enough for the outputs of the graphs that
use it (one buffer, a *lane*, per group of outputs sharing memory), and a graph's output
copies write whichever slot its replay was given (the copies' destinations are patched when
it changes):

- the slot it wrote last, when no other graph wrote it since (a graph's next replay
  overwrites its own previous outputs: the documented lifetime rule, unchanged);
- else a slot whose last outputs nobody refers to any more;
- else a new slot (a loop that keeps every output gets memory as eager would).

``out = step(x)`` over changing shapes alternates between two slots (one held by ``out``, the
other free), so N shapes hold about two output sets instead of N.

"Nobody refers to it" is exact: a slotted graph hands out fresh tensors at every replay (a
``detach()`` of a template view the slot keeps: about a third of what ``as_strided`` costs)
and keeps none of them, so anything that still reaches an output (the tensor, a view of it,
its storage, a DLPack capsule, a C++ holder) holds a reference to the lane's storage, and
torch's use count of that storage exceeds what the slot holds itself (its buffer, its storage
object, one typed view per dtype, its templates); a caller holding only the storage's Python
object (there is one per storage) shows in that object's reference count.

Replay's C step (csrc/replay_step.c) answers ``held()`` for the slot it is bound to from C with
the same two counts: the use count through the torch-side helper, and the storage object's
references against ``Lane.own_storage_refs_c``, the count its own read saw when the lane was
made (where either is missing it calls :meth:`Slot.held`).

What else reaches a slot's memory after its outputs were handed out, and what keeps it exact:

- *Inference tensors*: a slot's buffers are tensors of the mode they were allocated in (an
  inference tensor under ``torch.inference_mode``), and so is everything handed out of them;
  such an output given to a call under ``no_grad`` fails where eager's works ("Inference
  tensors cannot be saved for backward"). So a slot serves only the mode it was allocated in.
- *Another stream reading an output* (the caller's ``out.record_stream(s)``): eagerly the
  allocator then keeps the memory until ``s`` is done with it; a slot is written again as soon
  as nobody holds its outputs. So :func:`watch_record_stream` wraps torch's
  ``Tensor.record_stream``: called on a tensor whose storage lies in a lane's memory (found by
  address: :func:`watched_lane`), it notes the stream on the lane's owner (the slot), and the
  next replay writing the slot first makes its stream wait for what was enqueued on it
  (:meth:`Slot.wait_for_readers`, a check of an empty list when nobody called it; the replay's
  raw stream handle made torch's stream object by :func:`torch_stream`, the default stream's
  handle 0 included). The wrapper is the only place torch tells of such a read; the allocator
  keeps its own list of a block's streams where nothing can read it, and waiting on every
  stream would wait for streams nobody named.
- *Streams the replays wrote it from*: the allocator is told of each (``record_stream`` on the
  lane's buffer, once per stream, :meth:`Slot.written_from`), so the memory, freed by the slot
  or by the last output a caller drops, is reused only after those writes are done.
- *A resized storage* (``out.resize_(n)``, ``out.untyped_storage().resize_(n)``): the storage a
  caller's output shares with the lane moves to new memory, its old block goes back to the
  allocator, and the graph's copies would write it there. So a lane knows where its memory
  is (``address``, ``size``) and a slot whose storage moved (:meth:`Slot.moved`) is never
  written again: the replay checks the lanes it writes (one pointer and size compare each)
  and :meth:`OutputSlots.choose` drops such a slot, leaving its memory to the storage.

This module is bookkeeping over tensors (and torch's stream bookkeeping of their memory), with
no driver call: pointing the copies at a slot is the graph's (replay.graph).
"""

from __future__ import annotations

import bisect
import functools
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import torch

try:  # the replay step in C answers held() too (csrc/replay_step.c; optional, built by setup.py)
    from replay._step import storage_references as _storage_references
except ImportError:
    _storage_references = None

#: Slots nobody holds outputs of that a region keeps besides the one just chosen, for the
#: next change of shape (the alternation of ``out = step(x)`` needs one).
SPARE_SLOTS = 1

#: Lane sizes are rounded up to this many bytes (lanes are separate allocations, each as
#: aligned as torch's allocator makes them).
SLOT_ALIGNMENT = 512


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


# --- streams reading or writing output memory -------------------------------------------------
#: torch's own ``Tensor.record_stream`` (the wrapper calls it first, and the slots record their
#: own writing streams through it, which are not readers).
_RECORD_STREAM = torch._C.TensorBase.record_stream

#: first byte -> (a weak reference to) the lane there, for the lanes whose readers are watched
#: (see :func:`watch_record_stream`); ``_STARTS`` holds the same first bytes, sorted.
_WATCHED: dict[int, weakref.ref] = {}
_STARTS: list[int] = []


def torch_stream(stream: int, device: torch.device | int | None) -> torch.cuda.Stream:
    """torch's stream object for raw handle ``stream`` on ``device`` (None: the current one), to
    record an event or a memory use on, or to make wait.

    Not ``torch.cuda.ExternalStream(stream)`` alone: torch's constructor takes a handle of 0 for
    "no handle given" and returns a new stream of its pool, so a wait or a use recorded there
    orders nothing on the default stream (whose handle is 0), where most replays run."""
    default = torch.cuda.default_stream(device)
    if stream == default.cuda_stream:
        return default
    if not stream:
        raise RuntimeError(f"raw stream handle 0 is not device {device}'s default stream: torch has no object for it")
    return torch.cuda.ExternalStream(stream, device=device)


def _cuda_stream(stream: torch.Stream | torch.cuda.Stream) -> torch.cuda.Stream:
    """A stream a caller gave ``record_stream`` as the CUDA stream object torch's events take
    (``torch.Stream``, the generic kind, is rebuilt from its ids)."""
    if isinstance(stream, torch.cuda.Stream):
        return stream
    ids = {"stream_id": stream.stream_id, "device_index": stream.device_index, "device_type": stream.device_type}
    return torch.cuda.Stream(**ids)


def watched_lane(start: int, nbytes: int) -> Lane | None:
    """The watched lane whose memory holds the ``nbytes`` bytes from ``start`` (a storage's
    span), else None; never a lane whose storage moved (its old memory is the allocator's).

    By address, not by the storage's Python object: torch need not hand out one object per
    storage (``untyped_storage()`` may wrap it anew, and a DLPack round trip makes another
    storage over the same memory), while the memory a live lane holds is its alone."""
    if nbytes <= 0:
        return None
    ref = _WATCHED.get(start)
    if ref is None:  # a storage starting inside a lane: the lane starting last at or before it
        at = bisect.bisect_right(_STARTS, start) - 1
        if at < 0:
            return None
        ref = _WATCHED.get(_STARTS[at])
    lane = ref() if ref is not None else None
    if lane is None or lane.storage is None or lane.moved() or start + nbytes > lane.address + lane.size:
        return None
    return lane


def note_reader(tensor: torch.Tensor, stream: object) -> None:
    """``tensor.record_stream(stream)`` was called: where ``tensor``'s storage lies in a watched
    lane's memory (:func:`watched_lane`), the lane's owner notes ``stream`` as a reader of it."""
    try:
        storage = tensor.untyped_storage()
        start, nbytes = storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return  # no storage of its own (a wrapper subclass): not output memory
    lane = watched_lane(start, nbytes)
    owner = lane.owner() if lane is not None and lane.owner is not None else None
    if owner is not None and stream not in owner.readers:
        owner.readers.append(stream)


@functools.wraps(_RECORD_STREAM)
def _record_stream(self: torch.Tensor, *args, **kwargs) -> None:
    _RECORD_STREAM(self, *args, **kwargs)
    if _WATCHED:
        note_reader(self, args[0] if args else next(iter(kwargs.values())))


def watch_record_stream() -> None:
    """Wrap ``torch.Tensor.record_stream`` (once) so that output memory learns of the streams a
    caller reads it on: torch's own call first, then :func:`note_reader`."""
    if torch.Tensor.record_stream is not _record_stream:
        torch.Tensor.record_stream = _record_stream


def _watch(lane: Lane) -> None:
    address = lane.address
    watch_record_stream()

    def forget(ref: weakref.ref) -> None:
        if _WATCHED.get(address) is ref:
            _forget(address)

    if address not in _WATCHED:
        bisect.insort(_STARTS, address)
    _WATCHED[address] = weakref.ref(lane, forget)


def _unwatch(lane: Lane) -> None:
    ref = _WATCHED.get(lane.address)
    if ref is not None and ref() is lane:
        _forget(lane.address)


def _forget(address: int) -> None:
    del _WATCHED[address]
    del _STARTS[bisect.bisect_left(_STARTS, address)]


def wait_for_readers(readers: list, stream: int, device: torch.device | int) -> None:
    """Make raw ``stream`` wait for the work enqueued so far on each of ``readers`` (the
    streams a caller named with ``record_stream``), then forget them: the memory they read is
    about to be written on ``stream``. Enqueued before the write, their reads see what eager's
    output held; the caller's later work on them is the next output's business."""
    target = torch_stream(stream, device)
    for reader in readers:
        if getattr(reader, "cuda_stream", None) != stream:
            event = torch.cuda.Event()
            event.record(_cuda_stream(reader))
            target.wait_event(event)
    readers.clear()


def record_on(tensors: Iterable[torch.Tensor], stream: int | None) -> None:
    """Tell the allocator that ``tensors``' memory is used by work enqueued on raw ``stream`` (a
    replay's; for a released graph its last one, which waited for every replay before it):
    freed, it is reused only once that work is done."""
    if stream is None:
        return
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor) and tensor.is_cuda:
            _RECORD_STREAM(tensor, torch_stream(stream, tensor.device))


@attrs.define(eq=False)
class Lane:
    """One buffer of a slot: a graph's outputs that share memory (one storage eagerly) are
    copied into one lane, so outputs keep their storages apart and their storage offsets as
    eagerly (a slot packing every output into one buffer would not)."""

    buffer: torch.Tensor | None  # uint8, ``size`` bytes; None once freed
    size: int
    address: int
    storage: torch.UntypedStorage | None  # held, so its own reference to itself is constant
    own: int = 0  # the storage's use count with only the lane's own references
    own_storage_refs: int = 0  # references to the storage's Python object, the lane's alone
    # the same as csrc/replay_step.c counts them (its own read's reference included); -1: not known,
    # so the C step asks held() of Python
    own_storage_refs_c: int = -1
    bases: dict[torch.dtype, torch.Tensor] = attrs.Factory(dict)  # one typed view per dtype
    owner: weakref.ref | None = None  # what notes the streams callers read it on (its slot)

    @classmethod
    def allocate(cls, allocate: Callable[[int], torch.Tensor], size: int, use_count) -> Lane:
        buffer = allocate(size)
        storage = buffer.untyped_storage()
        lane = cls(buffer, size, buffer.data_ptr(), storage)
        lane.own = use_count(storage)
        lane.own_storage_refs = sys.getrefcount(storage)  # counted as in held(): the same references
        del storage  # (the C step reads the storage with only the lane's own references left)
        if _storage_references is not None:
            lane.own_storage_refs_c = _storage_references(lane)
        return lane

    @classmethod
    def over(cls, tensor: torch.Tensor, address: int, size: int, owner: object) -> Lane:
        """A lane over memory ``owner`` keeps (a graph's own output buffer, reached through one
        of its tensors), which was at ``address``, ``size`` bytes, when it was made: its readers
        and its moves are watched like a slot's."""
        lane = cls(tensor, size, address, tensor.untyped_storage(), owner=weakref.ref(owner))
        if tensor.is_cuda:
            _watch(lane)
        return lane

    def moved(self) -> bool:
        """Whether its storage no longer is the memory the lane was made over (a caller resized
        it: the old memory went back to the allocator, and must not be written)."""
        storage = self.storage
        return storage is not None and (storage.data_ptr() != self.address or storage.nbytes() != self.size)

    def held(self, use_count) -> bool:
        storage = self.storage
        if storage is None:
            return False
        # the storage's Python object is one per storage: a caller holding out.untyped_storage()
        # holds the lane's own object, which the use count does not see
        return use_count(storage) > self.own or sys.getrefcount(storage) > self.own_storage_refs

    def base(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole lane as a flat tensor of ``dtype``: outputs are ``as_strided`` views of it."""
        base = self.bases.get(dtype)
        if base is None:
            assert self.buffer is not None, "a freed lane has no views"
            usable = self.size - self.size % dtype.itemsize
            base = self.buffer[:usable].view(dtype)
            self.bases[dtype] = base
            self.own += 1  # one more tensor of the lane's own on its storage
        return base

    def view(self, dtype: torch.dtype, size: tuple, stride: tuple, offset: int) -> torch.Tensor:
        """A view of the lane the slot keeps (a template: replays hand out ``detach()``-ed
        copies of it, each a fresh tensor on the lane's storage)."""
        view = torch.as_strided(self.base(dtype), size, stride, offset)
        self.own += 1
        return view

    def free(self) -> None:
        """Give the memory back to torch's allocator (which was told of every stream replays
        wrote it from: :meth:`Slot.written_from`)."""
        _unwatch(self)
        self.buffer = self.storage = None
        self.bases.clear()


@attrs.define(eq=False)
class Slot:
    """One set of output buffers of a region on a device: lane ``i`` takes the ``i``-th
    largest group of outputs sharing memory, of whichever graph writes the slot."""

    lanes: list[Lane]
    use_count: Callable[[torch.UntypedStorage], int]
    writer: object | None = None  # the graph whose replay wrote it last
    streams: set[int] = attrs.Factory(set)  # raw streams replays wrote it from (written_from adds each)
    freed: bool = False  # its memory went back to the allocator (or to a storage that moved): never written again
    # graph -> ((lane, template view), ...): the views of its outputs in this slot
    templates: dict[Any, tuple[tuple[int, torch.Tensor], ...]] = attrs.Factory(dict)
    inference: bool = False  # its buffers are inference tensors: it serves inference-mode replays only
    readers: list = attrs.Factory(list)  # streams callers read its outputs on since its last write

    def __attrs_post_init__(self) -> None:
        buffer = self.lanes[0].buffer if self.lanes else None
        self.inference = buffer is not None and buffer.is_inference()
        for lane in self.lanes:
            lane.owner = weakref.ref(self)
            if lane.buffer is not None and lane.buffer.is_cuda:
                _watch(lane)

    def views_for(self, graph: Any, outputs: Sequence[tuple]) -> tuple[torch.Tensor, ...]:
        """``graph``'s output templates in this slot, made on its first use of the slot;
        ``outputs`` holds (lane, dtype, size, stride, storage offset) per output."""
        made = self.templates.get(graph)
        if made is None:
            made = self.templates[graph] = tuple(
                (lane, self.lanes[lane].view(dtype, size, stride, offset))
                for lane, dtype, size, stride, offset in outputs
            )
        return tuple(view for _lane, view in made)

    def drop_views(self, graph: Any) -> None:
        for lane, _view in self.templates.pop(graph, ()):
            self.lanes[lane].own -= 1  # the template goes with the last reference to it: ours

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(lane.size for lane in self.lanes)

    def fits(self, need: tuple[int, ...]) -> bool:
        # plain loops, not all()/any() over generators: asked on most replays of a region
        # whose graphs take turns, where a generator's frame costs more than the test
        lanes = self.lanes
        if len(need) > len(lanes):
            return False
        for size, lane in zip(need, lanes):
            if size > lane.size:
                return False
        return True

    def held(self) -> bool:
        """Whether anything besides the slot itself still refers to its memory (an output a
        replay handed out, or anything made from one)."""
        use_count = self.use_count
        for lane in self.lanes:
            if lane.held(use_count):
                return True
        return False

    def moved(self) -> bool:
        """Whether a caller resized the storage of any of its lanes (see the module docstring)."""
        for lane in self.lanes:
            if lane.moved():
                return True
        return False

    def written_from(self, stream: int) -> None:
        """A replay on raw ``stream`` (not one before it) wrote the slot: the allocator is told, so
        the memory, whoever frees it last, is reused only after that write is done."""
        self.streams.add(stream)
        record_on((lane.buffer for lane in self.lanes), stream)

    def wait_for_readers(self, stream: int) -> None:
        """Before a replay on raw ``stream`` writes the slot: see :func:`wait_for_readers`."""
        wait_for_readers(self.readers, stream, self.lanes[0].buffer.device)

    def free(self) -> None:
        self._unbind()
        for lane in self.lanes:
            lane.free()

    def abandon(self) -> None:
        """A caller resized a lane's storage: the memory is the storage's now. The slot lets go
        of it without writing or freeing anything, and is never chosen again."""
        self._unbind()
        for lane in self.lanes:
            _unwatch(lane)
            lane.buffer = lane.storage = None
            lane.bases.clear()

    def _unbind(self) -> None:
        for graph in self.templates:  # a graph whose copies point here sets them again first
            if getattr(graph, "bound_slot", None) is self:
                graph.bound_slot = graph.views = None
        self.templates.clear()
        self.writer = None
        self.freed = True
        self.readers.clear()


class OutputSlots:
    """The output slots of one region on one device (see the module docstring).

    ``allocate(size)`` makes a uint8 tensor of ``size`` bytes; ``use_count(storage)`` is
    torch's use count of a storage (both replaceable for tests of the bookkeeping alone);
    ``changed()`` is called whenever a slot comes or goes (the region's index of output
    memory is rebuilt from :meth:`ranges`). A graph's ``need`` is the sizes of its groups of
    outputs sharing memory, largest first (lane ``i`` holds group ``i``)."""

    def __init__(
        self,
        allocate: Callable[[int], torch.Tensor],
        *,
        use_count: Callable[[torch.UntypedStorage], int] = _use_count,
        changed: Callable[[], None] = lambda: None,
    ):
        self._allocate = allocate
        self._use_count = use_count
        self._changed = changed
        self.slots: list[Slot] = []

    def choose(self, graph: Any, need: tuple[int, ...]) -> Slot:
        """The slot a replay of ``graph`` writes: the one it wrote last if no other graph
        wrote it since, else one nobody holds outputs in (the one its copies point at first:
        no node update; a spare beyond ``SPARE_SLOTS`` is freed then), else a new one; only
        slots of the current mode (inference or not: a replay runs in its graph's), never
        one whose storage a caller moved (those are dropped here first).
        Changes nothing else but the slots' list: the caller marks the slot written
        (:meth:`wrote`) once its replay cannot decline any more."""
        self._drop_moved()
        last = getattr(graph, "slot", None)
        if last is not None and last.writer is graph and not last.freed:
            return last
        bound = getattr(graph, "bound_slot", None)  # the slot its copies write now: no node update
        if bound is not None and not bound.freed and bound.fits(need) and not bound.held():
            return bound
        inference = torch.is_inference_mode_enabled()
        free = [slot for slot in self.slots if slot.inference == inference and not slot.held()]
        chosen = next((slot for slot in free if slot.fits(need)), None)
        if chosen is None:
            chosen = self._new(need, free)
        else:
            spare = [slot for slot in free if slot is not chosen]
            self._free(spare[SPARE_SLOTS:])
        return chosen

    def wrote(self, graph: Any, slot: Slot) -> None:
        slot.writer = graph
        graph.slot = slot

    def forget(self, graph: Any) -> None:
        """``graph`` is released: it writes no slot any more (what it handed out stays held)."""
        for slot in self.slots:
            if slot.writer is graph:
                slot.writer = None
            slot.drop_views(graph)

    def release(self) -> None:
        """Free every slot nobody holds outputs in; the held ones go when their outputs go."""
        self._free([slot for slot in self.slots if not slot.held()])
        if self.slots:
            self.slots = []
            self._changed()  # held slots left too: the region's index of output memory forgets them

    def nbytes(self) -> int:
        return sum(sum(slot.sizes) for slot in self.slots)

    def ranges(self) -> list[tuple[int, int]]:
        """(first byte, one past the last) of every lane: memory the region's replays write."""
        return [(lane.address, lane.address + lane.size) for slot in self.slots for lane in slot.lanes]

    def _drop_moved(self) -> None:
        """Let go of every slot whose storage a caller moved (:meth:`Slot.abandon`)."""
        moved = [slot for slot in self.slots if slot.moved()]
        if moved:
            for slot in moved:
                slot.abandon()
            self.slots = [slot for slot in self.slots if not slot.freed]
            self._changed()

    def _new(self, need: tuple[int, ...], free: list[Slot]) -> Slot:
        """A new slot at least as large, lane by lane, as every slot so far (a region's
        graphs then all fit in any slot once its largest shape was recorded); free slots it
        outgrows go."""
        sizes = list(need)
        for slot in self.slots:
            for i, size in enumerate(slot.sizes):
                if i < len(sizes):
                    sizes[i] = max(sizes[i], size)
                else:
                    sizes.append(size)
        sizes = [-(-max(size, 1) // SLOT_ALIGNMENT) * SLOT_ALIGNMENT for size in sizes]
        self._free([slot for slot in free if slot.sizes != tuple(sizes)])
        lanes = [Lane.allocate(self._allocate, size, self._use_count) for size in sizes]
        slot = Slot(lanes, self._use_count)
        self.slots.append(slot)
        self._changed()
        return slot

    def _free(self, slots: list[Slot]) -> None:
        if not slots:
            return
        for slot in slots:
            slot.free()
        self.slots = [slot for slot in self.slots if not slot.freed]
        self._changed()
