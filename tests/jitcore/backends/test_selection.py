"""Backend selection and the error a missing binding gives."""

from __future__ import annotations

import sys

import pytest
import torch

from jitcore import backends
from jitcore.errors import BackendUnavailableError


def test_follows_torch_and_the_environment(monkeypatch):
    monkeypatch.delenv("JITCORE_BACKEND", raising=False)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert backends.selected_name() == "cuda"
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    assert backends.selected_name() == "hip"
    monkeypatch.setenv("JITCORE_BACKEND", "CUDA")
    assert backends.selected_name() == "cuda"
    monkeypatch.setenv("JITCORE_BACKEND", "metal")
    with pytest.raises(ValueError, match="JITCORE_BACKEND='metal'"):
        backends.selected_name()


def test_missing_cuda_binding_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    monkeypatch.delitem(sys.modules, "jitcore.backends.cuda", raising=False)
    monkeypatch.setattr(backends, "_instances", {})
    with pytest.raises(BackendUnavailableError, match=r"pip install 'jitreplay\[cuda\]'"):
        backends.get_backend("cuda")


def test_missing_hip_binding_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "hip", None)
    monkeypatch.delitem(sys.modules, "jitcore.backends.hip", raising=False)
    monkeypatch.setattr(backends, "_instances", {})
    with pytest.raises(BackendUnavailableError, match=r"jitreplay\[rocm\]"):
        backends.get_backend("hip")


def test_vendor_bindings_are_imported_only_by_backend_modules():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[3]
    pattern = re.compile(r"^\s*(from|import)\s+(cuda|hip)\b", re.M)
    offenders = [
        str(path.relative_to(root))
        for package in ("jitcore", "replay", "samples", "benchmarks")
        for path in (root / package).rglob("*.py")
        if pattern.search(path.read_text()) and path.name not in ("cuda.py", "hip.py")
    ]
    assert offenders == []
