"""A recording call in a process that holds many blocks, against the whole allocator's snapshot (GPU).

A recording needs its private memory pool's segments (which outputs it made, the pool's
growth). torch's one-pool snapshot walks every block of the allocator to pick the pool's, and
the whole-allocator snapshot lists every block of the process, so both grow with what the
process holds (a model's weights and caches). A recording takes the snapshot only where the
allocator's counts of device allocations and frees moved since the pool was last measured (a
segment came or went somewhere), else the segments it knows. This times, with 0, 2,000 and
8,000 other blocks alive, a new shape's recording call of a 4-kernel region in a running
session (the public path, wait included) beside one whole-allocator snapshot (what a recording
that filtered the whole snapshot would pay on top), round robin, and counts the snapshots the
recordings took.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

import replay
from benchmarks import common
from benchmarks.replay import WIDTH, chain

#: Other live blocks in the process, as a model's weights and caches would be.
BLOCK_COUNTS = (0, 2000, 8000)
REGION = chain(4)


def _other_blocks(count: int) -> list[torch.Tensor]:
    """``count`` live allocations of 4 KiB to 4.4 MiB (most under the allocator's 1 MiB
    small-block line, some over it), about 2 GiB per 1,000."""
    return [
        torch.empty((k % 97 + 1) * 4096 + (k % 3) * (1 << 21), dtype=torch.uint8, device="cuda") for k in range(count)
    ]


def _whole_snapshot_us() -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda.memory_snapshot(include_traces=False)  # as a filter of the whole snapshot would ask for it
    return (time.perf_counter() - start) * 1e6


class _CountedSnapshots:
    """torch.cuda.memory_snapshot, counted while on (the recordings' walks of the allocator)."""

    def __init__(self) -> None:
        self.taken, self.on, self._real = 0, False, torch.cuda.memory_snapshot

    def __call__(self, *args, **kwargs):
        self.taken += self.on
        return self._real(*args, **kwargs)


def _row(step, count: int, repeats: int, new_rows, snapshots: _CountedSnapshots) -> dict[str, float]:
    """``repeats`` new shapes recorded with ``count`` other blocks alive."""
    blocks = _other_blocks(count)
    recording_us, snapshot_us, taken = [], [], snapshots.taken
    for _ in range(repeats):
        x = torch.randn(next(new_rows), WIDTH, device="cuda")
        torch.cuda.synchronize()
        snapshots.on, start = True, time.perf_counter()
        out = step(x)
        torch.cuda.synchronize()
        recording_us.append((time.perf_counter() - start) * 1e6)
        snapshots.on = False
        assert torch.equal(out, REGION(x))
        step(x)  # its analysis, so that the next shape's call is a recording again
        snapshot_us.append(_whole_snapshot_us())
    del blocks
    torch.cuda.empty_cache()
    return {
        "recording_call_us": statistics.median(recording_us),
        "whole_snapshot_us": statistics.median(snapshot_us),
        "recordings": len(recording_us),
        "pool_snapshots_taken": snapshots.taken - taken,
    }


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats = 3 if args.quick else 15
    rows_of_new_shape = itertools.count(2)  # every recording a shape not seen before
    REGION(torch.randn(1, WIDTH, device="cuda"))  # the jit compiled before any timing
    torch.cuda.synchronize()
    snapshots = _CountedSnapshots()
    torch.cuda.memory_snapshot = snapshots
    results: dict[str, object] = {}
    with replay.capture(record_after=0, record_budget=1.0) as session:
        step = session.region(REGION)
        for _ in range(2):  # the session's pool made, its first recording's one-time costs paid
            x = torch.randn(1, WIDTH, device="cuda")
            step(x)
            step(x)
        for count in BLOCK_COUNTS:
            results[f"{count} other blocks"] = _row(step, count, repeats, rows_of_new_shape, snapshots)
        records = session.stats().records
    torch.cuda.memory_snapshot = snapshots._real
    assert records >= len(BLOCK_COUNTS) * repeats, session.report()
    table = [
        (count, r["recording_call_us"], r["whole_snapshot_us"], r["pool_snapshots_taken"])
        for count, r in zip(BLOCK_COUNTS, results.values())
    ]
    body = common.markdown_table(
        [
            "other live blocks",
            "a new shape's recording call (us)",
            "one whole-allocator snapshot (us)",
            "snapshots the recordings took",
        ],
        table,
    )
    body += (
        f"\n\nMedians of {repeats} new shapes per row, each recording call timed with its wait, in one session "
        "(4 jit kernels a call). A recording walks the allocator (the pool's own snapshot) only where a segment "
        "came or went since the pool was last measured (the other blocks of a row are made before its first "
        "recording), so the call no longer grows with the blocks the process holds."
    )
    common.write(args.out, "pool_snapshot", "A recording call in a process holding many blocks", results, body)


if __name__ == "__main__":
    main()
