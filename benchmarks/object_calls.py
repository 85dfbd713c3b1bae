"""A region call passing an object: host time per call on the CPU, the graph's replay a no-op.

A call ``(ids, hidden, cache)`` where ``cache`` is a six-layer stand-in for a Hugging Face
``StaticCache`` (tests/replay/cache_standin.py: layers holding key and value tensors, plain
values, a length tensor; 20 tensors and 39 other values walked), through a session whose
recordings are the CPU tests' double (tests/replay/test_session.py's ``DoubleSession``) with a
replay that returns at once, so that what is timed is the session's path to the replay:

- ``memo``: the same cache every call (a decode loop), served from the memo of its last
  replayed call (replay.object_calls: the watch over what the walk read, the other arguments'
  part of the key computed and compared);
- ``full path``: the same calls with the memos off: the walk of the objects, admission's
  count, the full key and the entry lookup, on every call;
- the three steps of the full path timed alone (``flat_call`` with the walk,
  ``counted_shapes``, ``region_key``);
- for scale, a flat call of two tensors served by its pre-key.

Round robin, medians of repeated loops. Nothing here captures or launches: the graph's own
replay is the GPU's (benchmarks/hf.py times a real model's loop).
"""

from __future__ import annotations

import torch

from benchmarks import common
from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import instrumentation
from tests.replay.cache_standin import StandInCache, attention_step, attention_weights
from tests.replay.test_session import DoubleSession, FakeGraph

LAYERS, WIDTH, CACHE_LENGTH = 6, 8, 64
MEMO, FULL, FLAT = "memo", "full path", "flat call of two tensors"
WALK, COUNT, KEY = "the walk (flat_call)", "admission's count", "the full key"  # instrumentation.full_key_steps


class _InstantGraph(FakeGraph):
    """A recorded graph whose replay returns at once."""

    def replay(self, *leaves):
        self.replays += 1


class _InstantSession(DoubleSession):
    build_graph = _InstantGraph


def measure(calls: int, repeats: int) -> dict:
    """Median microseconds per call, by path."""
    weights = attention_weights(LAYERS, WIDTH)
    with use_backend(NullBackend()), torch.no_grad():
        session = _InstantSession(record_after=1)
        DoubleSession.current = session
        region = session.region(lambda ids, hidden, cache: attention_step(weights, cache, hidden))
        args = (torch.tensor([[3]]), torch.ones(1, 1, WIDTH), StandInCache(LAYERS, CACHE_LENGTH))
        flat = session.region(lambda x, y: x + y)
        pair = (torch.ones(4), torch.ones(4))
        for _ in range(8):  # warmed, recorded, replaying
            region(*args)
            flat(*pair)
        if not region.object_memos:
            raise RuntimeError("the repeated object call made no memo")
        switch = instrumentation.ObjectMemos(region)
        paths = {MEMO: lambda: region(*args), FULL: lambda: region(*args), FLAT: lambda: flat(*pair)}
        paths |= instrumentation.full_key_steps(region, args)
        setups = {name: switch.on for name in paths} | {FULL: switch.off}
        try:
            timed = common.compare(paths, calls=calls, repeats=repeats, setups=setups)
        finally:
            switch.on()
    return {name: row["median_us"] for name, row in timed.items()}


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    calls, repeats = (200, 5) if args.quick else (2000, 9)
    us = measure(calls, repeats)
    rows = [[name, f"{us[name]:.1f}"] for name in (MEMO, FULL, WALK, COUNT, KEY, FLAT)]
    body = common.markdown_table(["path, per call", "us"], rows)
    notes = (
        f"A call `(ids, hidden, cache)` with a {LAYERS}-layer stand-in cache; medians of {repeats} loops of "
        f"{calls} calls, round robin. The memo's path is what a decode loop passing its cache pays per step "
        f"besides the replay: {us[FULL] / us[MEMO]:.1f}x less than the full path's."
    )
    results = {"us_per_call": us, "layers": LAYERS, "calls": calls, "repeats": repeats}
    common.write(args.out, "object-calls-cpu", "An object argument's call, host time (CPU)", results, body, notes)


if __name__ == "__main__":
    main()
