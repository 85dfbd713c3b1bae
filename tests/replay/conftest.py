"""Fixtures shared by the replay tests."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest

from jitcore import torch_native


@contextlib.contextmanager
def _checks_made(kind, request, monkeypatch):
    if kind == "python":
        monkeypatch.setenv("JITCORE_NATIVE", "0")
        with torch_native.using(None):
            yield kind
        return
    if importlib.util.find_spec("replay._checks") is None:
        pytest.skip("replay._checks is not built here")
    monkeypatch.delenv("JITCORE_NATIVE", raising=False)
    helper = request.getfixturevalue("torch_native_helper") if kind == "watch" else None
    with torch_native.using(helper):
        yield kind


@pytest.fixture(params=["watch", "c", "python"])
def checks_kind(request, monkeypatch):
    """A test of replay's settings check runs against each way it can be made:
    csrc/replay_checks.c answering from the torch-side helper's settings state ("watch": the
    helper built for real, see tests/conftest.py), csrc/replay_checks.c alone ("c", no helper;
    skipped where it was not built) and the generated Python check ("python": JITCORE_NATIVE=0).
    The check is chosen when a graph or a check is made, so inside the test."""
    with _checks_made(request.param, request, monkeypatch) as kind:
        yield kind


@pytest.fixture(params=["c", "python"])
def c_or_python(request, monkeypatch):
    """A test of a replay check that csrc/replay_checks.c makes ("c") or generated Python does
    ("python": JITCORE_NATIVE=0), without the torch-side helper in either."""
    with _checks_made(request.param, request, monkeypatch) as kind:
        yield kind


@pytest.fixture(params=["c", "python"])
def replay_step(request, monkeypatch):
    """A test of replaying a recorded graph runs against both ways it replays: csrc/replay_step.c
    in front of the generated function ("c": the torch-side helper built for real; skipped
    where replay._step was not built) and the generated function alone ("python": no helper,
    so no graph gets a C step). Chosen when a graph is made, so inside the test."""
    if request.param == "python":
        with torch_native.using(None):
            yield request.param
        return
    if importlib.util.find_spec("replay._step") is None:
        pytest.skip("replay._step is not built here")
    monkeypatch.delenv("JITCORE_NATIVE", raising=False)
    with torch_native.using(request.getfixturevalue("torch_native_helper")):
        yield request.param


@pytest.fixture(params=["helper", "no helper"])
def with_and_without_helper(request):
    """A GPU test of what torch ops do inside a region runs with the torch-side helper (its
    torch-op observer, guards and settings watch) and without it (the dispatch-mode observer,
    as on a machine without a compiler): the two must be equally exact."""
    helper = request.getfixturevalue("torch_native_helper") if request.param == "helper" else None
    with torch_native.using(helper):
        yield request.param
