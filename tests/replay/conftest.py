"""Fixtures shared by the replay tests."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture(params=["c", "python"])
def checks_kind(request, monkeypatch):
    """A test of a replay exactness check runs against replay/_checks.c ("c", skipped where it
    was not built) and against the generated Python check ("python": JITCORE_NATIVE=0); the
    check is chosen when a graph or a check is made, so inside the test."""
    if request.param == "c":
        if importlib.util.find_spec("replay._checks") is None:
            pytest.skip("replay._checks is not built here")
        monkeypatch.delenv("JITCORE_NATIVE", raising=False)
    else:
        monkeypatch.setenv("JITCORE_NATIVE", "0")
    return request.param
