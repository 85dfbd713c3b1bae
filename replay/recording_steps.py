"""A recording's host work, each step runnable on its own: for the CPU benchmark of what a
recording costs besides the driver (benchmarks/recording_cpu.py) and the sample-shaped capture
of the tests (tests/replay/sample_capture.py).

Why apart from :mod:`replay.recording`: nothing on the call path needs it, and it reaches into
the recording's steps one by one, which the recording itself never does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from jitcore import for_replay
from jitcore.for_replay import get_backend
from replay import rebinding, recording


class RecordingSteps:
    """The host work of a recording of ``fn(*args)``, each step runnable on its own under the
    current backend (the null one on a CPU, where nothing captures): for the CPU benchmark of
    what a recording costs besides the driver.

    - :meth:`region`: the region with the recorder a capture installs (every launch reported);
    - :meth:`keep`: what the capture keeps of those records (the pointers' extents, the records
      without their tensors);
    - :meth:`views`: the launch views the analysis makes of the kept records;
    - :meth:`plan`: the rebinding plan over kernel nodes holding exactly those launches, each
      launch's node known by its handle, as a capture reports it.

    ``args``: the region's arguments as one flat tuple of tensors and plain values."""

    def __init__(self, fn: Callable, args: tuple) -> None:
        self.fn, self.args, self.backend = fn, args, get_backend()
        paths = [f"args[{i}]" for i in range(len(args))]
        tensors = {i: a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        self.inputs = recording.input_ranges(tensors, paths)
        self.tensors, self.doubts = tensors, recording.input_doubts(tensors)
        self.records = self.region()
        self.kept = self.keep()
        self.nodes = [_node_holding(number, record) for number, record in enumerate(self.kept[0])]
        self.handles = [node.handle for node in self.nodes]
        self.launch_views = self.views()

    def region(self) -> list:
        recorder = recording.Recorder(self.backend)
        with for_replay.recording(recorder):
            self.fn(*self.args)
        return recorder.records

    def keep(self) -> tuple[list, list]:
        """(records without their tensors, extents per record)."""
        extents = recording.pointer_extents(self.records, self.inputs, self.tensors.values(), self.doubts)
        return recording.records_without_tensors(self.records), extents

    def views(self) -> list:
        records, extents = self.kept
        return recording.launch_views(records, self.handles, {}, extents)

    def plan(self, nodes: list | None = None) -> object:
        """The plan over ``nodes`` (by default a kernel node per launch), every input rebound."""
        none: set[int] = set()
        return rebinding.build_plan(
            self.inputs,
            self.launch_views,
            self.nodes if nodes is None else nodes,
            staged=none,
            copied_back=none,
            torch_read=none,
            torch_written=none,
        )


def _node_holding(number: int, record) -> rebinding.NodeView:
    """The kernel node a launch record would be in a captured graph (its handle made up)."""
    spans = zip(record.layout.offsets, record.layout.types)
    params = tuple(record.param_bytes[offset : offset + t.size] for offset, t in spans)
    return rebinding.NodeView(number, "kernel", record.function, params, handle=0x10000 + number)
