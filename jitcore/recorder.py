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
import threading
from collections.abc import Callable, Iterator
from typing import Protocol

import attrs

from jitcore.backends.abi import ParamLayout

#: Number of recorders installed across all threads; call states read ACTIVE[0].
ACTIVE = [0]
_local = threading.local()
_count_lock = threading.Lock()


@attrs.frozen
class ParamRecord:
    """Where one kernel parameter's value came from.

    kind is one of:

    - ``"pointer"``: the data pointer of jit argument ``arg_index`` plus ``byte_offset``
      (a view's offset); ``read_only`` when the kernel declares it pointer-to-const;
    - ``"scalar"``: computed from the runtime scalar arguments ``scalar_args`` (jit argument
      indices) and sizes fixed for this call state; ``evaluate`` recomputes it from new values
      of those arguments (a dict ``{arg_index: value}``) and ``encode`` turns a value into the
      parameter's bytes. ``expression`` is the same computation as Python source, with
      ``{k}`` standing for jit argument ``k`` (for callers that generate code), and
      ``convert`` (or None) maps a value to what ``struct`` packs with ``fmt``;
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
    evaluate: Callable[[dict[int, object]], object] | None = None
    encode: Callable[[object], bytes] | None = None
    expression: str | None = None
    convert: Callable[[object], object] | None = None


@attrs.frozen
class LaunchRecord:
    """One kernel launch made by a call state while a recorder was installed."""

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


class Recorder(Protocol):
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
