"""Shared test setup: GPU tests are marked ``gpu`` and skip cleanly without a GPU."""

from __future__ import annotations

import os

import pytest
import torch


def gpu_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from jitcore.backends import get_backend

        get_backend()
    except Exception:
        return False
    return True


def pytest_collection_modifyitems(config, items):
    has_gpu = gpu_available()
    gpus = torch.cuda.device_count() if has_gpu else 0
    skip_gpu = pytest.mark.skip(reason="needs a CUDA/HIP GPU and its jitreplay backend extra")
    skip_multi = pytest.mark.skip(reason="needs two or more GPUs")
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(skip_gpu)
        elif "multigpu" in item.keywords and gpus < 2:
            item.add_marker(skip_multi)


@pytest.fixture(autouse=True)
def _private_kernel_cache(tmp_path, monkeypatch):
    """Every test gets its own on-disk kernel cache, so tests never see each other's entries."""
    if "JITCORE_TEST_SHARED_CACHE" not in os.environ:
        monkeypatch.setenv("JITCORE_CACHE_DIR", str(tmp_path / "kernel-cache"))


@pytest.fixture
def load(tmp_path):
    """``load(name=source, ...)``: write modules into a temporary directory and import them
    (tests/modules.py); they are forgotten after the test."""
    from tests.modules import ModuleLoader

    loader = ModuleLoader(tmp_path / "modules")
    yield loader
    loader.close()


@pytest.fixture(autouse=True)
def _recording_budget_out_of_the_way_on_gpus(request, monkeypatch):
    """GPU tests count replays; the recording budget depends on wall-clock time (a cold first
    capture can postpone the next key's recording for a second), so on the GPU it starts with
    an hour of grace. The budget itself is tested on the CPU with a controlled clock
    (tests/replay/test_admission.py, test_session.py)."""
    if "gpu" in request.keywords or "multigpu" in request.keywords:
        from replay import admission

        monkeypatch.setattr(admission, "GRACE_SECONDS", 3600.0)
