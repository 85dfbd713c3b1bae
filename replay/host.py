"""Host (CPU) tensor arguments of a region, staged through pinned buffers the graph owns.

At recording, each CPU tensor argument is replaced by a pinned host buffer of the same shape,
strides and dtype (filled with the caller's values), so the region's own host-to-device copy
(``host.to("cuda", non_blocking=True)``, ``.cuda()``, ``dev.copy_(host)``) is captured as a
memcpy node reading that buffer. Every replay first copies the caller's bytes into the buffer
(a host memcpy), then launches the graph.

The synchronization rule: the host must not overwrite a buffer while a previous launch of the
graph may still read it. An event is recorded on the launch stream after every launch of a
graph with host inputs, and the next replay waits for it before writing (``cudaEventSynchronize``,
which returns at once when the launch is already done). One buffer per input, not two: a second
buffer would need the memcpy node's source patched every replay, and the wait covers the
whole previous launch anyway, since the buffer is read at some point inside it. It limits a
loop to one replay of that graph in flight ahead of the host, which a decode loop that samples
on the host does anyway. The buffers are freed only after the last launch that reads them is
done (torch's pinned allocator knows only the capture stream, not the replay streams).

What is refused (the key runs eagerly, with a ``ReplayWarning``): any torch op that touches a
staged host buffer other than a plain copy to a device tensor (see
:func:`host_use_refusal`: a CPU op would read the values at capture time and bake them in),
a copy into the host buffer (the region writing its host argument: copying that back exactly
needs a synchronize), a kernel or copy node other than a copy from the buffer that reaches its
memory, and host tensors with a lazy conjugate or negative bit.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterable

import torch

from replay.region_keys import byte_range, extent_bytes

_aten = torch.ops.aten
#: A memmove over the byte extent is used when the extent is at most this many times the
#: tensor's own bytes, or at most ``MEMMOVE_BYTES`` (a memmove that small costs no more than
#: torch's strided copy costs to start): the gaps of a sliced tensor are copied along,
#: harmlessly (they lie inside the caller's storage and the buffer's).
MEMMOVE_SLACK = 4
MEMMOVE_BYTES = 1 << 16

_memmove = ctypes.memmove
#: torch's event methods themselves (torch.cuda.Event wraps them in Python, and ``record``
#: without a stream looks the current one up); absent from CPU-only builds of torch
_EVENT_BASE = getattr(torch._C, "_CudaEventBase", None)
_record = getattr(_EVENT_BASE, "record", None)
_query = getattr(_EVENT_BASE, "query", None)
_synchronize = getattr(_EVENT_BASE, "synchronize", None)

#: Buffers and events of HostInputs collected while a stream captured (a synchronize there would
#: break the capture): released by the next HostInputs made, after their last launch is done.
_DEFERRED: list = []


def unsupported_reason(tensor: torch.Tensor) -> str | None:
    """Why a CPU tensor argument cannot be staged through a pinned buffer (None: it can)."""
    if tensor.layout is not torch.strided:
        return f"its layout is {tensor.layout}"
    if tensor.is_conj() or tensor.is_neg():
        return "it has a lazy conjugate or negative bit (call .resolve_conj() / .resolve_neg())"
    if type(tensor) is not torch.Tensor:
        return f"it is a {type(tensor).__qualname__}"
    return None


def pinned_buffer(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned host buffer with the tensor's exact shape, strides and dtype."""
    return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu", pin_memory=True)


def is_dense(tensor: torch.Tensor) -> bool:
    """Its bytes are a plain block (contiguous in some order of its dimensions)."""
    expected = 1
    for size, stride in sorted((p for p in zip(tensor.shape, tensor.stride()) if p[0] != 1), key=lambda p: p[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def overlaps_itself(tensor: torch.Tensor) -> bool:
    """Two elements may share bytes (an expanded tensor): torch refuses to copy into it."""
    reach = 0
    for size, stride in sorted((p for p in zip(tensor.shape, tensor.stride()) if p[0] != 1), key=lambda p: p[1]):
        if stride <= reach:
            return True
        reach += (size - 1) * stride
    return False


class HostInputs:
    """The pinned buffers of one graph's host inputs, and the event of its last launch."""

    def __init__(self, tensors: dict[int, torch.Tensor], paths: dict[int, str]):
        release_deferred()
        self.paths = paths
        self.buffers: dict[int, torch.Tensor] = {}
        for i, tensor in tensors.items():
            self.buffers[i] = pinned_buffer(tensor)
            self.fill(i, tensor)  # the values of the recording call, which the first launch reads
        self.event = torch.cuda.Event()
        self._streams: dict[int, object] = {}
        self.launches = 0

    def ranges(self) -> list[tuple[int, tuple[int, int]]]:
        """(leaf index, byte range of its buffer)."""
        return [(i, byte_range(b)) for i, b in self.buffers.items()]

    def owner(self, address: int) -> int | None:
        """The input whose buffer holds ``address``."""
        for i, buffer in self.buffers.items():
            lo, hi = byte_range(buffer)
            if lo <= address < max(hi, lo + 1):
                return i
        return None

    def launched(self) -> None:
        """A launch that reads the buffers was just enqueued on the current stream."""
        self.event.record()
        self.launches += 1

    def launched_on(self, stream: int, device: int) -> None:
        """:meth:`launched`, for generated replays, which know the current stream's handle:
        torch's event entry points without ``Event.record``'s lookup of the current stream,
        on every replay; the stream object is looked up once per handle."""
        self._record_on(stream, device)
        self.launches += 1

    def wait(self) -> None:
        """Until the last launch is done with the buffers (immediate before the first)."""
        if self.launches:
            self._wait_for_event()

    # the event itself (a test double replaces these two)
    def _record_on(self, stream: int, device: int) -> None:
        handle = self._streams.get(stream)
        if handle is None:
            # the current stream, whose handle the replay just read (not ExternalStream: a
            # handle of 0, the default stream, would make it a new stream of torch's pool)
            handle = torch.cuda.current_stream(device)
            if handle.cuda_stream != stream:
                raise RuntimeError(f"the current stream of device {device} is not the one the replay launched on")
            self._streams[stream] = handle
        _record(self.event, handle)

    def _wait_for_event(self) -> None:
        if not _query(self.event):
            _synchronize(self.event)

    def fill(self, i: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor`` (the buffer's layout) into input ``i``'s buffer, as a replay does."""
        kind, target, extent = self.copier(i)
        if kind == "memmove":
            _memmove(target, tensor.data_ptr(), extent)
        elif kind == "copy":
            target(tensor)

    def copier(self, i: int) -> tuple[str, object, int]:
        """How a replay fills input ``i``'s buffer: ``("memmove", None, (address, bytes))``
        over the byte extent (the caller's tensor has the buffer's exact layout: the key holds
        shape and strides), or ``("copy", buffer.copy_, 0)`` for a sparse layout whose extent
        is much larger than its elements; ``("none", None, 0)`` for an empty tensor."""
        buffer = self.buffers[i]
        extent = extent_bytes(buffer)
        if not extent:
            return "none", None, 0
        if extent <= max(MEMMOVE_SLACK * buffer.numel() * buffer.element_size(), MEMMOVE_BYTES) or overlaps_itself(
            buffer
        ):
            return "memmove", buffer.data_ptr(), extent
        return "copy", buffer.copy_, 0

    def __del__(self) -> None:
        # the buffers go with this object: not while a launch may still read them
        try:
            if self.launches and torch.cuda.is_current_stream_capturing():
                _DEFERRED.append((self.event, self.buffers))
                return
            self.wait()
        except Exception:
            pass


def release_deferred() -> None:
    """Free the buffers of HostInputs collected during a capture, once their launches are done."""
    while _DEFERRED:
        event, _buffers = _DEFERRED.pop()
        event.synchronize()


def _dense_same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """A copy between them is one memcpy: same shape and dtype, the same strides (or both
    contiguous), the source a plain block of bytes."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_contiguous() and b.is_contiguous():
        return True
    return a.stride() == b.stride() and is_dense(a)


class HostInputRefused(Exception):
    """Raised inside a capture by the observer, before a torch op would use a host input's
    values on the CPU: the capture ends and the key runs eagerly (recording turns it into a
    ``CaptureFailed`` with this message)."""


_NOT_RUN = object()


def host_use_refusal(func, named: dict, hits: dict[str, int], describe, result: object = _NOT_RUN) -> str | None:
    """Why a torch op touching a staged host buffer would bake host values into the graph
    (None: it is a plain copy from the buffer to a device tensor, captured as one memcpy node).

    Asked before the op runs (``result`` left out: anything the op would do on the CPU must not
    run inside a capture) and again with what it returned. ``named``: the op's arguments by
    schema name; ``hits``: argument name -> the host input it touches; ``describe(i)``: the
    input's path."""
    name = getattr(func, "__name__", str(func))
    first = describe(next(iter(hits.values())))
    packet = getattr(func, "overloadpacket", None)
    converts = (
        f"{name} of host input {first} converts its dtype or layout, which torch does on the CPU at capture "
        "time (copy a dense host tensor to the device as it is, then convert there)"
    )
    if packet is _aten.copy_ and "self" in hits:
        return f"{name} writes host input {describe(hits['self'])}: a graph cannot copy it back exactly"
    if packet is _aten._to_copy and set(hits) == {"self"}:
        source = named.get("self")
        device = named.get("device")
        if device is None or torch.device(device).type == "cpu":
            return _reads(name, first)
        if result is _NOT_RUN:
            dtype, memory_format = named.get("dtype"), named.get("memory_format")
            plain_format = memory_format in (None, torch.preserve_format) or (
                memory_format is torch.contiguous_format and source.is_contiguous()
            )
            if dtype not in (None, source.dtype) or not plain_format or not is_dense(source):
                return converts
            return None
        if isinstance(result, torch.Tensor) and result.device.type != "cpu" and _dense_same_layout(source, result):
            return None
        return converts
    if packet is _aten.copy_ and set(hits) == {"src"}:
        destination, source = named.get("self"), named.get("src")
        if isinstance(destination, torch.Tensor) and destination.device.type != "cpu":
            return None if _dense_same_layout(source, destination) else converts
    return _reads(name, first)


def _reads(name: str, path: str) -> str:
    return (
        f"{name} reads host input {path} on the CPU: its values would be baked into the graph "
        "(only copies of it to the device are replayed)"
    )


def blocking_rewrite(func, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A copy from a host buffer with ``non_blocking=False`` would synchronize the capturing
    stream (torch's ``memcpy_and_sync``), which invalidates the capture. Inside a graph the
    copy is ordered before everything after it either way, and the host touches the buffer
    only after the launch is done (:meth:`HostInputs.wait`): captured as non-blocking, it is
    exact."""
    packet = getattr(func, "overloadpacket", None)
    if packet is _aten._to_copy:
        return args, {**kwargs, "non_blocking": True}
    if packet is _aten.copy_:
        if len(args) >= 3:
            return (*args[:2], True, *args[3:]), kwargs
        return args, {**kwargs, "non_blocking": True}
    return args, kwargs


def named_host_ranges(tensors: Iterable[object]) -> list[tuple[tuple[int, int], bool]]:
    """(byte range of its storage, pinned) of each CPU tensor among ``tensors`` (those a region
    reaches by name: its globals, closures and module attributes), for the capture's observer.

    Why: a torch op reading such a tensor on the CPU (``x * scale`` with a 0-dim CPU ``scale``,
    ``scale.item()``, ``int(flags[0])``) runs once, at the capture, and the graph keeps the
    values it read; the watch sees the tensor's identity and layout, never its values, so a
    later ``scale.fill_(...)`` would leave every replay on the old value. The storage, not the
    tensor: a view the region makes may reach beyond the tensor itself."""
    ranges, seen = [], set()
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or tensor.layout is not torch.strided:
            continue
        storage = tensor.untyped_storage()
        span = (storage.data_ptr(), storage.data_ptr() + storage.nbytes())
        if span[0] and span not in seen:
            seen.add(span)
            ranges.append((span, tensor.is_pinned()))
    return ranges


def named_use_refusal(func, named: dict, hits: dict[str, int], pinned: set[int]) -> str | None:
    """Why a torch op touching a CPU tensor the region reaches by name cannot be captured (None:
    it can). Only a plain copy of a pinned one to the device, asked non-blocking by the region
    itself, is replayed: the graph's copy reads the tensor's memory when it runs, as the eager
    copy reads it asynchronously. Anything else reads the values on the CPU (baked into the
    graph), or copies pageable memory, which a replay would read later than eager does."""
    name = getattr(func, "__name__", str(func))
    copies = host_use_refusal(func, named, hits, str) is None
    non_blocking = named.get("non_blocking") is True
    if copies and non_blocking and set(hits.values()) <= pinned:
        return None
    return (
        f"{name} reads a CPU tensor the region reaches by name (a global, closure or module attribute) on the "
        "CPU: its values would be baked into the graph, and a later in-place write to it would not reach a "
        "replay (move it to the GPU, or pass it as an argument)"
    )
