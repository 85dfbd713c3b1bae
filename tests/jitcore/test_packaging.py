"""The distribution as pip builds it: a wheel of this checkout carries what an installed
jitcore needs at run time (the torch-side helper's source and headers, under jitcore/_csrc/),
the license, and metadata whose version is the packages' ``__version__``.

The wheel is built for real from a copy of the checkout's sources (the checkout is left as it
was), with the C extensions' compiler turned off: they are optional, and what is tested here
is what the wheel carries besides them."""

from __future__ import annotations

import email
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import jitcore
import replay
from jitcore import _version, torch_native

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "LICENSE", "README.md", "csrc", "jitcore", "replay")


def _setuptools_reads_the_license_expression() -> bool:
    try:
        major = int(importlib.metadata.version("setuptools").split(".")[0])
    except (importlib.metadata.PackageNotFoundError, ValueError):
        return False
    return major >= 77


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    if not _setuptools_reads_the_license_expression():
        pytest.skip("the wheel's build needs setuptools >= 77 (pyproject's SPDX license), not installed here")
    source = tmp_path_factory.mktemp("source")
    ignore = shutil.ignore_patterns("*.so", "__pycache__", "*.egg-info", "_csrc")
    for name in SOURCES:
        origin = ROOT / name
        if origin.is_dir():
            shutil.copytree(origin, source / name, ignore=ignore)
        else:
            shutil.copy2(origin, source / name)
    out = tmp_path_factory.mktemp("wheel")
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(source),
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(out),
    ]
    env = dict(os.environ, CC="false", PIP_NO_INDEX="1")  # no compiled extension, nothing fetched
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("jitreplay-*.whl")
    return built


def test_the_wheel_carries_the_helpers_source_and_headers(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        "jitcore/_csrc/jitcore_torch_native.cpp",
        *(f"jitcore/_csrc/{h.name}" for h in (ROOT / "csrc").glob("*.h")),
    }
    assert expected <= names
    assert not any(name.endswith(".so") for name in names)  # the compiler was off: nothing stale came along


def test_the_wheels_metadata_has_one_version_the_license_and_authors(wheel):
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        fields = email.message_from_bytes(archive.read(metadata))
        licensed = archive.read(metadata.replace("METADATA", "licenses/LICENSE"))
    assert fields["Version"] == _version.__version__ == jitcore.__version__ == replay.__version__
    assert fields["License-Expression"] == "Apache-2.0" and fields["License-File"] == "LICENSE"
    assert fields["Author"] == "jitreplay developers"
    assert licensed == (ROOT / "LICENSE").read_bytes() and b"Apache License" in licensed


def test_an_installed_copy_finds_the_packaged_source(wheel, tmp_path):
    """jitcore.torch_native in the unpacked wheel names the packaged source, with the same
    build name as the checkout's (same bytes, same torch): `python -m jitcore.torch_native`
    there builds what the checkout builds."""
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    probe = "import jitcore.torch_native as t; print(t.SOURCE); print(t.artifact_name())"
    env = dict(os.environ, PYTHONPATH=str(tmp_path / "site"), JITCORE_NATIVE="0")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    source, name = done.stdout.split()
    assert Path(source) == tmp_path / "site" / "jitcore" / "_csrc" / "jitcore_torch_native.cpp"
    assert name == torch_native.artifact_name()
