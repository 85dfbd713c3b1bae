"""Host time per repeated object call through a session, on the CPU (the recording double, a
graph whose replay returns at once): the memo's path (replay.object_calls) against the full
path (walk, count, full key, lookup), and a flat call of two tensors for scale. Median of
several rounds of many calls each.

    PYTHONPATH=. python notes/object_calls_bench.py [--quick]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import object_calls
from tests.replay.cache_standin import StandInCache, attention_step, attention_weights
from tests.replay.test_session import DoubleSession, FakeGraph


class InstantGraph(FakeGraph):
    """Replays by returning at once: what is timed is the session's path to the replay."""

    def replay(self, *leaves):
        self.replays += 1
        return None


class InstantSession(DoubleSession):
    build_graph = InstantGraph


def per_call(region, args, calls: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            region(*args)
        samples.append((time.perf_counter() - started) / calls)
    return statistics.median(samples) * 1e6


def main() -> None:
    quick = "--quick" in sys.argv
    calls, rounds = (200, 5) if quick else (2000, 9)
    weights = attention_weights(6, 8)
    with use_backend(NullBackend()), torch.no_grad():
        session = InstantSession(record_after=1)
        DoubleSession.current = session
        region = session.region(lambda ids, positions, cache: attention_step(weights, cache, positions.float()))
        cache = StandInCache(6, 64)
        args = (torch.tensor([[3]]), torch.ones(1, 1, 8), cache)
        for _ in range(8):
            region(*args)
        fast = per_call(region, args, calls, rounds)
        real = object_calls.serve, object_calls.remember
        object_calls.serve = lambda region, args, kwargs, miss: miss  # the full path alone, as before memos
        object_calls.remember = lambda *memo: None
        try:
            region.object_memos = ()
            full = per_call(region, args, calls, rounds)
        finally:
            object_calls.serve, object_calls.remember = real
        flat = session.region(lambda x, y: x + y)
        pair = (torch.ones(4), torch.ones(4))
        for _ in range(8):
            flat(*pair)
        plain = per_call(flat, pair, calls, rounds)
    print(f"six-layer stand-in cache (ids, hidden, cache): memo {fast:.1f} us, full path {full:.1f} us per call")
    print(f"flat call of two tensors (pre-key hit): {plain:.1f} us per call")


if __name__ == "__main__":
    main()
