"""A recording call in a process that holds many blocks, against the whole allocator's snapshot (GPU).

Every recording measures its private memory pool by torch's one-pool snapshot (torch 2.11's
takes a reference from each number of the pool id it is given, so the recording asks it with
copies of the id's numbers and gives back what they lost). torch still walks every block of the
allocator to pick the pool's, and the whole-allocator snapshot lists every block of the process,
so both grow with what the process holds (a model's weights and caches). This times, with 0,
2,000 and 8,000 other blocks alive, a new shape's recording call of a 4-kernel region in a
running session (the public path, wait included) beside one whole-allocator snapshot (what a
recording that filtered the whole snapshot would pay on top), round robin.
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


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    repeats = 3 if args.quick else 15
    rows_of_new_shape = itertools.count(2)  # every recording a shape not seen before
    REGION(torch.randn(1, WIDTH, device="cuda"))  # the jit compiled before any timing
    torch.cuda.synchronize()
    results: dict[str, object] = {}
    table = []
    with replay.capture(record_after=0, record_budget=1.0) as session:
        step = session.region(REGION)
        for _ in range(2):  # the session's pool made, its first recording's one-time costs paid
            x = torch.randn(1, WIDTH, device="cuda")
            step(x)
            step(x)
        for count in BLOCK_COUNTS:
            blocks = _other_blocks(count)
            recording_us, snapshot_us = [], []
            for _ in range(repeats):
                x = torch.randn(next(rows_of_new_shape), WIDTH, device="cuda")
                torch.cuda.synchronize()
                start = time.perf_counter()
                out = step(x)
                torch.cuda.synchronize()
                recording_us.append((time.perf_counter() - start) * 1e6)
                assert torch.equal(out, REGION(x))
                step(x)  # its analysis, so that the next shape's call is a recording again
                snapshot_us.append(_whole_snapshot_us())
            results[f"{count} other blocks"] = {
                "recording_call_us": statistics.median(recording_us),
                "whole_snapshot_us": statistics.median(snapshot_us),
                "recordings": len(recording_us),
            }
            table.append((count, statistics.median(recording_us), statistics.median(snapshot_us)))
            del blocks
            torch.cuda.empty_cache()
        records = session.stats().records
    assert records >= len(BLOCK_COUNTS) * repeats, session.report()
    body = common.markdown_table(
        ["other live blocks", "a new shape's recording call (us)", "one whole-allocator snapshot (us)"], table
    )
    body += (
        f"\n\nMedians of {repeats} new shapes per row, each recording call timed with its wait, in one session "
        "(4 jit kernels a call). A recording measures its pool by the pool's own snapshot, for which torch "
        "still walks every block of the allocator: the call grows with the blocks the process holds, far less "
        "than by a whole snapshot."
    )
    common.write(args.out, "pool_snapshot", "A recording call in a process holding many blocks", results, body)


if __name__ == "__main__":
    main()
