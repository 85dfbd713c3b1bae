"""The hook through which the replay layer sees jit launches (and nothing else of jitcore).

While a recorder is installed on a thread (:func:`recording`), every launch a call state makes
on that thread is reported as a :class:`LaunchRecord`: the function handle, launch geometry,
the exact parameter bytes, and for every parameter where its value came from. A jit cache
miss on that thread is reported first through :meth:`Recorder.miss`, which may refuse it (the
replay layer does, because compiling inside a graph capture is not allowed).

Cost when no recorder is installed anywhere: one list read per call-state call.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from threading import get_ident
from typing import NamedTuple, Protocol

import attrs

from jitcore.backends import compiled_helpers_enabled
from jitcore.backends.abi import ParamLayout

#: Number of recorders installed across all threads; call states read ACTIVE[0].
ACTIVE = [0]
_local = threading.local()
_count_lock = threading.Lock()


@attrs.frozen
class ParamRecord:
    """Where one kernel parameter's value came from.

    Every ``evaluate``-style callable here takes ``scalars``, anything indexable with
    ``scalars[k]`` giving the value of jit argument ``k`` (a list or tuple of all the
    arguments, or a dict holding at least the indices it depends on); sizes and strides stay
    as recorded (replay keys are shape-exact).

    kind is one of:

    - ``"pointer"``: the data pointer of jit argument ``arg_index`` plus ``byte_offset``
      (a view's offset, in bytes, as recorded); ``read_only`` when the kernel declares it
      pointer-to-const. When the offset depends on runtime scalar arguments (``x[pos]`` with
      ``pos`` a runtime int), ``offset_scalar_args`` lists them (jit argument indices) and
      ``offset_evaluate(scalars)`` returns the byte offset from the tensor's data pointer for
      new values of them; otherwise ``offset_scalar_args`` is ``()`` and ``offset_evaluate``
      None;
    - ``"scalar"``: computed from the runtime scalar arguments ``scalar_args`` (jit argument
      indices) and sizes fixed for this call state; ``evaluate(scalars)`` recomputes it and
      ``encode`` turns a value into the parameter's bytes (raising
      :class:`~jitcore.backends.abi.ScalarError`, a ValueError, for a value the C type cannot
      hold unchanged). ``expression`` shows the computation for messages only, with ``{k}``
      standing for jit argument ``k`` (it is not code: constants appear by their ``repr``),
      and ``convert`` (or None) maps a value to what ``struct`` packs with ``fmt``;
    - ``"constant"``: fixed for the call state.
    """

    index: int
    name: str | None
    offset: int
    size: int
    fmt: str
    kind: str
    arg_index: int | None = None
    byte_offset: int = 0
    read_only: bool = False
    scalar_args: tuple[int, ...] = ()
    evaluate: Callable[[Sequence | Mapping], object] | None = None
    encode: Callable[[object], bytes] | None = None
    expression: str | None = None
    convert: Callable[[object], object] | None = None
    offset_scalar_args: tuple[int, ...] = ()
    offset_evaluate: Callable[[Sequence | Mapping], int] | None = None


#: The launch-configuration values a :class:`ConfigRecord` may describe.
CONFIG_FIELDS = ("grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared")


@attrs.frozen
class ConfigRecord:
    """A launch-configuration value computed from runtime scalar arguments.

    ``field`` is one of :data:`CONFIG_FIELDS` (``"shared"``: dynamic shared memory bytes);
    ``scalar_args`` are the jit argument indices it depends on; ``evaluate(scalars)`` returns
    the int for new values of them (same convention as :class:`ParamRecord`, sizes and
    strides fixed as recorded); ``expression`` shows it for messages, ``{k}`` standing for
    jit argument ``k``. Values that depend only on sizes and strides get no record.
    """

    field: str
    scalar_args: tuple[int, ...]
    evaluate: Callable[[Sequence | Mapping], int]
    expression: str = ""


@attrs.frozen
class CheckRecord:
    """An index bounds check the call state makes before its launches, computed from
    runtime scalar arguments (``x[i]`` with ``i`` a runtime int): ``value(scalars)`` and
    ``size(scalars)`` recompute the index and the size (same convention as
    :class:`ParamRecord`); the check passes when ``-size <= value < size``. A replay of the
    launch must fail where the call state would have raised IndexError."""

    scalar_args: tuple[int, ...]
    value: Callable[[Sequence | Mapping], int]
    size: Callable[[Sequence | Mapping], int]
    expression: str = ""


class LaunchRecord(NamedTuple):
    """One kernel launch made by a call state while a recorder was installed.

    ``launched`` is False for a launch over an empty grid (a grid dimension of 0, e.g.
    ``cdiv(n, 256)`` with ``n == 0``): nothing reached the driver, but the launch is reported
    so that a recording sees every launch of the launcher. ``dynamic_config`` holds a
    :class:`ConfigRecord` for each of grid, block and shared size that depends on runtime
    scalar arguments.

    A named tuple rather than an attrs class, for the first recording's sake: every launch of
    a recording makes one, and a capture makes each again without its tensors
    (:meth:`with_args`). A frozen attrs class of these sixteen fields costs several times a
    named tuple's making, and the making is most of what a recorder adds to a launch.
    Immutable all the same.
    """

    jit_function: str
    kernel: str  # the name expression, e.g. "axpy<float>"
    function: int  # raw function handle, as graph nodes report it
    device: int
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    layout: ParamLayout
    param_bytes: bytes
    params: tuple[ParamRecord, ...]
    args: tuple  # the jit call's arguments as passed (dynamic scalars included)
    stream: int
    check_globals: Callable[[], None] | None = None  # the launcher's drift check (raises on drift)
    launched: bool = True
    dynamic_config: tuple[ConfigRecord, ...] = ()
    #: the call state's index checks that depend on runtime scalars (on every launch record)
    checks: tuple[CheckRecord, ...] = ()

    def with_args(self, args: tuple) -> LaunchRecord:
        """This record with ``args`` replaced (a recorder that keeps records past the capture
        drops the tensors this way); every other field is the same object."""
        return tuple.__new__(LaunchRecord, (*self[:_ARGS], args, *self[_ARGS + 1 :]))

    def replace(self, **changes: object) -> LaunchRecord:
        """This record with the named fields replaced (``attrs.evolve`` for records)."""
        return self._replace(**changes)


#: where ``args`` sits among a record's fields
_ARGS = LaunchRecord._fields.index("args")


class Recorder(Protocol):
    """What a recorder is. It may also have ``launch_sink``, a tuple ``(records, nodes, tail)``:
    a call state whose launches make their records in C (the C helper's packed launch) then
    appends each record to the list ``records`` instead of calling :meth:`launch`, and, where
    ``nodes`` is a list, appends to it what a recorder would note of the graph node the launch
    became: the only item of ``tail(stream)``, else None (None for a launch over an empty grid,
    and where ``tail`` is None). Such a recorder's :meth:`launch` must do exactly the same."""

    def launch(self, record: LaunchRecord) -> None: ...

    def miss(self, description: str) -> None:
        """Called before a jit cache miss compiles; raise to refuse it."""


def current() -> Recorder | None:
    return getattr(_local, "recorder", None)


@contextlib.contextmanager
def recording(recorder: Recorder) -> Iterator[Recorder]:
    """Install ``recorder`` on this thread for the duration of the block."""
    previous = getattr(_local, "recorder", None)
    _local.recorder = recorder
    with _count_lock:
        ACTIVE[0] += 1
    try:
        yield recorder
    finally:
        with _count_lock:
            ACTIVE[0] -= 1
        _local.recorder = previous


#: The longest a thread taking :class:`CaptureExclusion` shared lets a waiting capture go first.
SHARED_PATIENCE = 0.05


class CaptureBusy(RuntimeError):
    """An exclusive section was asked for by a thread that holds the exclusion shared (a
    region recorded from inside another region's eager run): waiting would never end, so the
    caller gives up on that capture for now."""


class _ExclusionFlags:
    """A capture exclusion's ``owner`` and ``waiting`` where its shared side is Python's (the C
    side keeps them in its own memory: csrc/jitcore_exclusion.c)."""

    __slots__ = ("owner", "waiting")

    def __init__(self) -> None:
        self.owner: int | None = None
        self.waiting = 0


class _Flag:
    """``CaptureExclusion._owner`` and ``_waiting``: read and written in the exclusion's flags
    (``_flags``), where its shared side reads them on every eager run."""

    def __set_name__(self, cls: type, name: str) -> None:
        self.field = name.lstrip("_")

    def __get__(self, exclusion: CaptureExclusion | None, owner: type | None = None) -> object:
        return self if exclusion is None else getattr(exclusion._flags, self.field)

    def __set__(self, exclusion: CaptureExclusion, value: object) -> None:
        setattr(exclusion._flags, self.field, value)


class CaptureExclusion:
    """Keeps stream captures apart from work in other threads that would break them.

    While one thread captures a graph, another thread must not load a module (a jit compile,
    or the lazy loading of a kernel's first launch, torch's included), synchronize the device
    or empty torch's allocator cache: the driver answers "operation not permitted when stream
    is capturing" and the capture is lost. Captures hold this exclusively; work that may do
    any of those (a jit miss, an eager run of a replay region) holds it shared, so such work
    runs concurrently with itself but never during another thread's capture. A thread that
    holds it exclusively may take it shared (a no-op); a thread that holds it shared and asks
    for it exclusively gets :class:`CaptureBusy` at once. Jit cache hits take nothing.

    Captures are preferred: once one waits, threads that do not hold it shared yet wait for
    it too (for at most ``SHARED_PATIENCE``), so a capture is not held back for long by a
    stream of eager runs in other threads. Threads already inside enter again at once (they
    would otherwise wait for themselves), and the patience's limit keeps shared work that
    waits for another thread's shared work from deadlocking with a waiting capture.
    """

    def __init__(self, *, lock_free: bool | None = None, native: bool | None = None) -> None:
        """``lock_free``: the shared side without a lock (the default where the GIL orders
        every read and write, see :class:`_Shared`); False takes the lock each way.
        ``native``: the lock-free side in C (csrc/jitcore_exclusion.c, the same protocol; the
        default where it was built and ``JITCORE_NATIVE`` is not 0)."""
        self._lock = threading.Lock()
        self._condition = threading.Condition(self._lock)  # the same mutex, for the waits
        #: thread id -> how deeply that thread holds it shared. The shared side writes its
        #: entry without the lock (see _Shared); the exclusive side reads it under the lock.
        self._holders: dict[int, int] = {}
        self._depth = 0
        lock_free = _ORDERED_BY_THE_GIL if lock_free is None else lock_free
        native_side = _native_shared_side()
        native = native_side is not None if native is None else native
        if native and (not lock_free or native_side is None):
            raise ValueError("the native shared side is lock-free only, and needs jitcore._exclusion built")
        # _owner and _waiting (the _Flag descriptors below) live in the C side where it runs
        self._flags = native_side(self) if native else _ExclusionFlags()
        self._shared = self._flags if native else _Shared(self) if lock_free else _LockedShared(self)

    #: the thread that holds it exclusively, or None
    _owner = _Flag()
    #: threads waiting to take it exclusively
    _waiting = _Flag()

    def shared(self) -> _Shared | _LockedShared:
        """Hold the exclusion shared for a ``with`` block (reentrant; a no-op in the thread that
        holds it exclusively). A plain context object, not a generator: region calls take it
        on every eager run."""
        return self._shared

    def holds_shared(self) -> bool:
        """Whether this thread holds the exclusion shared (so it cannot take it exclusively)."""
        return threading.get_ident() in self._holders

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        me = threading.get_ident()
        if me in self._holders:
            raise CaptureBusy("a capture was asked for inside work that holds the capture exclusion shared")
        with self._condition:
            if self._owner != me:
                self._waiting += 1
                try:
                    while self._owner is not None or self._holders:
                        self._condition.wait()
                    # owner set before waiting drops: a shared holder entering without the
                    # lock sees one of the two at every moment from here on (see _Shared)
                    self._owner = me
                finally:
                    self._waiting -= 1
            self._depth += 1
        try:
            yield
        finally:
            with self._condition:
                self._depth -= 1
                if not self._depth:
                    self._owner = None
                    self._condition.notify_all()

    def enter_shared_waiting(self, me: int) -> None:
        """The shared side's way in while a capture runs or waits (the usual case, nothing
        under way, never comes here): wait for the capture, unless this thread is inside
        already. A waiting capture is let first for at most SHARED_PATIENCE, so that work
        holding it shared which waits for this thread cannot deadlock with it."""
        holders = self._holders
        with self._condition:
            if self._owner == me:
                return  # inside this thread's own capture: nothing to hold
            deadline = None
            while me not in holders:
                if self._owner is not None:
                    self._condition.wait()
                    continue
                if not self._waiting:
                    break
                now = time.monotonic()
                deadline = deadline or now + SHARED_PATIENCE
                if now >= deadline:
                    break
                self._condition.wait(deadline - now)
            holders[me] = holders.get(me, 0) + 1

    def wake_waiting_capture(self) -> None:
        with self._condition:
            self._condition.notify_all()


#: Whether one thread's plain reads and writes of Python objects are seen by every other thread
#: in the order they were made (the global interpreter lock runs one bytecode at a time). A
#: free-threaded build gives no such order across objects: its shared side takes the lock.
_ORDERED_BY_THE_GIL = getattr(sys, "_is_gil_enabled", lambda: True)()


def _native_shared_side() -> type | None:
    """jitcore._exclusion.SharedSide (the lock-free shared side in C), or None where it was
    not built, the build has no GIL, or ``JITCORE_NATIVE=0`` turns the compiled helpers off."""
    if not _ORDERED_BY_THE_GIL or not compiled_helpers_enabled():
        return None
    try:
        from jitcore._exclusion import SharedSide
    except ImportError:
        return None
    return SharedSide


class _Shared:
    """``with exclusion.shared():`` (see :meth:`CaptureExclusion.shared`), without a lock in
    the usual case: every eager run of a region takes it, and a lock would cost more than
    the rest of the call's bookkeeping.

    Why no lock is needed (Dekker's argument, under the GIL's one order of all reads and
    writes): a thread entering writes its entry in ``_holders`` first, then reads ``_owner``
    and ``_waiting``; a capture writes ``_waiting`` first (under the lock), then reads
    ``_holders``, and sets ``_owner`` before ``_waiting`` drops. Whichever writes first, the
    other reads it: either the entering thread sees a capture (it takes its entry back and
    waits in :meth:`CaptureExclusion.enter_shared_waiting`), or the capture sees the entry
    (and waits for it to go). Leaving deletes the entry, then reads ``_waiting``: a capture
    that saw the entry has written ``_waiting`` before, so it is woken (under the lock, so
    the wake cannot fall between its check and its wait)."""

    __slots__ = ("_exclusion", "_holders", "_flags")

    def __init__(self, exclusion: CaptureExclusion):
        self._exclusion = exclusion
        self._holders = exclusion._holders
        self._flags = exclusion._flags

    def __enter__(self) -> None:
        holders = self._holders
        me = get_ident()
        depth = holders.get(me, 0)
        holders[me] = depth + 1
        if depth:
            return  # inside already: enter again at once (waiting would be for itself)
        flags = self._flags
        if flags.owner is None and not flags.waiting:
            return
        # a capture runs or waits (maybe this thread's own): take the entry back, the way in
        # while a capture is under way decides
        del holders[me]
        exclusion = self._exclusion
        if flags.waiting:
            exclusion.wake_waiting_capture()  # it may have seen the entry and gone to wait
        exclusion.enter_shared_waiting(me)

    def __exit__(self, kind: object, value: object, traceback: object) -> None:  # no *args: no tuple a call
        holders = self._holders
        me = get_ident()
        depth = holders.get(me, 0)
        if depth > 1:
            holders[me] = depth - 1
        elif depth:
            del holders[me]
            if self._flags.waiting:
                self._exclusion.wake_waiting_capture()
        # no entry: taken inside this thread's own capture, which held nothing


class _LockedShared:
    """The shared side where the interpreter gives no one order of reads and writes across
    threads (a free-threaded build): the same steps, each under the exclusion's lock."""

    __slots__ = ("_exclusion",)

    def __init__(self, exclusion: CaptureExclusion):
        self._exclusion = exclusion

    def __enter__(self) -> None:
        exclusion = self._exclusion
        me = get_ident()
        holders = exclusion._holders
        with exclusion._lock:
            depth = holders.get(me, 0)
            if depth or (exclusion._owner is None and not exclusion._waiting):
                holders[me] = depth + 1
                return
        exclusion.enter_shared_waiting(me)

    def __exit__(self, *exc: object) -> None:
        exclusion = self._exclusion
        me = get_ident()
        holders = exclusion._holders
        with exclusion._lock:
            depth = holders.get(me, 0)
            if depth > 1:
                holders[me] = depth - 1
                return
            if not depth:
                return
            del holders[me]
            if exclusion._waiting:
                exclusion._condition.notify_all()


#: The process's one capture exclusion (see :class:`CaptureExclusion`).
CAPTURES = CaptureExclusion()
