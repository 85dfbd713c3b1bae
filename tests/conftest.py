"""Shared test setup: GPU tests are marked ``gpu`` and skip cleanly without a GPU."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

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


@pytest.fixture(autouse=True)
def _gpu_tests_run_with_the_helper(request):
    """A GPU test runs as a user's loop does once the README's commands built the torch-side
    helper: with it loaded, where it can be built here (jitcore.torch_native.module() loads
    once per process, and each test has its own cache directory, so without this the helper
    a GPU test met depended on which test first asked for it). Replay's GPU hazard and replay
    tests run without it too (``with_and_without_helper``); ``JITCORE_NATIVE=0`` runs them
    all without."""
    if "gpu" not in request.keywords and "multigpu" not in request.keywords:
        yield
        return
    from jitcore import torch_native

    try:
        helper = request.getfixturevalue("torch_native_helper")
    except pytest.skip.Exception:  # no compiler, or JITCORE_NATIVE=0: the fallback's own run
        helper = None
    with torch_native.using(helper):
        yield


@pytest.fixture(scope="session")
def torch_native_cache(tmp_path_factory):
    """A cache directory holding the torch-side helper (csrc/jitcore_torch_native.cpp) built for
    this torch, for real, once per test session (about 20 s); skipped without a C++ compiler
    or under ``JITCORE_NATIVE=0`` (the fallback's own run)."""
    from jitcore import torch_native
    from jitcore.backends import compiled_helpers_enabled

    if not compiled_helpers_enabled():
        pytest.skip("JITCORE_NATIVE=0: no compiled helper is loaded (the fallback's own run)")
    if shutil.which(os.environ.get("CXX", "c++").split()[0]) is None:
        pytest.skip("no C++ compiler on this machine")
    directory = tmp_path_factory.mktemp("jitcore-cache")
    os.chmod(directory, 0o700)
    with pytest.MonkeyPatch.context() as patch:  # session-scoped: the environment put back here
        patch.setenv("JITCORE_CACHE_DIR", str(directory))
        path = torch_native.build()
    assert path.is_file() and path.parent == Path(os.path.realpath(directory)) / "torch-native"
    return directory


@pytest.fixture(scope="session")
def torch_native_helper(torch_native_cache):
    """The helper built by :func:`torch_native_cache`, loaded (not installed process-wide:
    a test that wants it installs it with ``jitcore.torch_native.using``)."""
    from jitcore import torch_native

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JITCORE_CACHE_DIR", str(torch_native_cache))
        found, reason = torch_native.load()
    assert found is not None, reason
    return found
