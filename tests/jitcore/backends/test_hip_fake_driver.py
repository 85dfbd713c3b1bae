"""HipBackend through the real hip-python against a fake HIP runtime (no ROCm, no GPU).

Skipped unless hip-python and a C compiler are installed. hip-python must not share an
environment with cuda-bindings (its CUDA interop package installs a clashing ``cuda``
namespace), so this runs in a separate environment; see docs/hip.md for the command.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent / "fake_hip"
ROOT = pathlib.Path(__file__).resolve().parents[3]

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("hip") is None, reason="hip-python is not installed"),
    pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to build the fake HIP runtime"),
]


def test_backend_against_fake_runtime(tmp_path):
    lib = tmp_path / "lib"
    (tmp_path / "include" / "hip").mkdir(parents=True)
    (tmp_path / "include" / "hip" / "hip_bf16.h").write_text("")  # so the backend finds an include dir
    lib.mkdir()
    library = lib / "libamdhip64.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-o", str(library), str(HERE / "fake_hip.c")], check=True)
    (lib / "libhiprtc.so").symlink_to(library.name)
    env = dict(os.environ, ROCM_PATH=str(tmp_path), LD_LIBRARY_PATH=str(lib), JITCORE_BACKEND="hip")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.pop("ROCM_HOME", None)
    env.pop("HIP_PATH", None)
    done = subprocess.run(
        [sys.executable, str(HERE / "scenario.py"), str(library)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stdout + done.stderr
