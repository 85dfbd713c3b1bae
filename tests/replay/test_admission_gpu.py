"""The cache policy on a real GPU, with the costs the session measures (the bookkeeping and the
policy over modelled call streams: test_admission.py)."""

from __future__ import annotations

import pytest
import torch

import replay
from replay import admission

from .test_replay_gpu import relu, scaled

pytestmark = pytest.mark.gpu

#: The grace as the module sets it (tests/conftest.py gives GPU tests an hour of it; these
#: tests run the policy as a user's session does).
DEFAULT_GRACE_SECONDS = admission.GRACE_SECONDS

DIM, LAYERS = 256, 6
SIZES, STEPS = (8, 16, 32), 300


def make_layers():
    """Six layers of a matmul, a scale and a ReLU jit kernel: an eager call of a few hundred
    microseconds of host time, a recording of a few milliseconds (the finding's loop)."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = [torch.randn(DIM, DIM, device="cuda", generator=generator) / DIM**0.5 for _ in range(LAYERS)]

    def layers(x):
        h = x
        for w in weights:
            t = h @ w
            y = torch.empty_like(t)
            scaled(t, y, 0.5)
            h = torch.empty_like(y)
            relu(y, h)
        return h

    return layers


def run_three_sizes(step, layers, inputs: dict[int, torch.Tensor]) -> None:
    """``STEPS`` calls going round ``SIZES``, each checked against eager bit for bit."""
    for number in range(STEPS):
        x = inputs[SIZES[number % len(SIZES)]]
        assert torch.equal(step(x), layers(x)), number


def measured(session) -> str:
    """What the payback rule read, for a failure's message."""
    budget, region = session.admission.budget, session.regions[0]
    return (
        f"{session.report()}\nspent {budget.spent * 1e3:.2f} ms, saved {session.admission.saved() * 1e3:.2f} ms, "
        f"a recording {budget.usual * 1e3:.2f} ms, eager call {region.cost.seconds * 1e6:.1f} us, "
        f"replay {region.cost.replay.seconds} s ({region.cost.replay.runs} replays counted)"
    )


def test_a_loop_over_three_sizes_replays_at_least_250_of_300_calls(monkeypatch):
    # the finding: 300 steps over 3 sizes, each repaying a recording after about 16 calls,
    # recorded only 1 or 2 of them (99 and 198 replays): a fresh session with the default
    # policy records each size on its first calls
    monkeypatch.setattr(admission, "GRACE_SECONDS", DEFAULT_GRACE_SECONDS)
    layers = make_layers()
    inputs = {n: torch.randn(n, DIM, device="cuda") for n in SIZES}
    with replay.capture() as session:
        step = session.region(layers)
        run_three_sizes(step, layers, inputs)
        stats = session.stats()
        assert stats.records == 3 and stats.replays >= 250, measured(session)


def test_three_sizes_after_the_first_recordings_record_by_the_rule_and_replay_at_least_250_of_300(monkeypatch):
    # the session's first recordings spent on sixteen other sizes, whose graphs replayed since:
    # the three sizes record when the payback rule, reading the costs the session measured (its
    # recordings, the region's eager calls and steady replays), says they repay a recording. (A
    # graph's first replay, cold, cost more than an eager call: taken as what a replay costs,
    # nothing repaid a recording and the three sizes never recorded.)
    monkeypatch.setattr(admission, "GRACE_SECONDS", DEFAULT_GRACE_SECONDS)
    layers = make_layers()
    others = {n: torch.randn(n, DIM, device="cuda") for n in range(40, 56)}
    inputs = {n: torch.randn(n, DIM, device="cuda") for n in SIZES}
    with replay.capture() as session:
        step = session.region(layers)
        for _ in range(30):
            for x in others.values():
                step(x)
        assert not session.admission.budget.first_recordings(), measured(session)
        before = session.stats().replays
        run_three_sizes(step, layers, inputs)
        stats = session.stats()
        assert stats.replays - before >= 250, measured(session)
        cost = session.regions[0].cost
        assert cost.replay.seconds is not None and cost.replay.seconds < cost.seconds, measured(session)  # steady
