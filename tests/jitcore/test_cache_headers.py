"""The disk cache never serves a binary built from an older version of a user header.

Compiles go through the real NVRTC (it runs on the CPU) to PTX, where a constant from the
header shows up as an immediate; each test has its own cache directory (conftest).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda extra (cuda-bindings, nvidia-cuda-nvrtc) is not installed")

import jitcore as jc
from jitcore.backends import cache, get_backend

ARCH = "compute_90"  # PTX: the header's constant is readable in the image
SOURCE = '#include "consts.h"\nextern "C" __global__ void k(int* out) { out[0] = HEADER_VALUE; }\n'


@pytest.fixture
def cuda():
    return get_backend("cuda")


class CompileCounter:
    def __init__(self, backend, monkeypatch):
        self.count = 0
        original = backend.compile

        def counting(*args, **kwargs):
            self.count += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(backend, "compile", counting)


def ptx(source: str, options=()) -> str:
    # A fresh Kernel each time, as a new process would make it; compile_for always asks the
    # disk cache first.
    return jc.Kernel(source, "k", options=list(options)).instantiate().compile_for(ARCH).image.decode()


def entries(tmp_path: Path) -> list[Path]:
    root = Path(os.environ["JITCORE_CACHE_DIR"])
    return sorted(root.rglob("*.bin")) if root.exists() else []


@pytest.mark.parametrize("spelling", ["-I{}", "--include-path={}", "-I", "--include-path"])
def test_editing_a_header_on_the_include_path_recompiles(cuda, monkeypatch, tmp_path, spelling):
    include = tmp_path / "include"
    include.mkdir()
    header = include / "consts.h"
    header.write_text("#define HEADER_VALUE 1234567\n")
    options = [spelling.format(include)] if "{}" in spelling else [spelling, str(include)]
    counter = CompileCounter(cuda, monkeypatch)
    assert "1234567" in ptx(SOURCE, options)
    assert "1234567" in ptx(SOURCE, options) and counter.count == 1  # unchanged header: a cache hit
    header.write_text("#define HEADER_VALUE 7654321\n")
    text = ptx(SOURCE, options)
    assert counter.count == 2 and "7654321" in text and "1234567" not in text
    header.write_text("#define HEADER_VALUE 1234567\n")  # back to the first contents: its entry again
    assert "1234567" in ptx(SOURCE, options) and counter.count == 2


def test_a_header_next_to_the_working_directory_is_keyed(cuda, monkeypatch, tmp_path):
    """NVRTC resolves a quoted include of the main source against the working directory."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "consts.h").write_text("#define HEADER_VALUE 1111111\n")
    assert "1111111" in ptx(SOURCE)
    (tmp_path / "consts.h").write_text("#define HEADER_VALUE 2222222\n")
    assert "2222222" in ptx(SOURCE)


def test_headers_included_by_headers_and_angle_includes_are_keyed(cuda, monkeypatch, tmp_path):
    include = tmp_path / "include"
    (include / "detail").mkdir(parents=True)
    (include / "consts.h").write_text('#include "detail/inner.h"\n#include <outer.h>\n')
    (include / "detail" / "inner.h").write_text("#define INNER 300000\n")
    (include / "outer.h").write_text("#define HEADER_VALUE (INNER + 1)\n")
    options = [f"-I{include}"]
    counter = CompileCounter(cuda, monkeypatch)
    assert "300001" in ptx(SOURCE, options)
    (include / "detail" / "inner.h").write_text("#define INNER 400000\n")
    assert "400001" in ptx(SOURCE, options)
    (include / "outer.h").write_text("#define HEADER_VALUE (INNER + 2)\n")
    assert "400002" in ptx(SOURCE, options)
    assert counter.count == 3


def test_a_header_shadowing_another_changes_the_key(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    (second / "consts.h").write_text("#define HEADER_VALUE 1\n")
    options = [f"-I{first}", f"-I{second}"]
    before = cache.header_digest(SOURCE, options, cwd=str(tmp_path))
    (first / "consts.h").write_text("#define HEADER_VALUE 2\n")  # now found first
    assert cache.header_digest(SOURCE, options, cwd=str(tmp_path)) not in (before, None, "")


def test_a_header_free_source_keeps_its_key(tmp_path):
    source = "#include <cuda_fp16.h>\n__global__ void k(float* x) {}\n"
    assert cache.header_digest(source, ["-DX=1"], cwd=str(tmp_path)) == ""
    assert cache.entry_key("cuda", "c", "sm_90", source, ["k"], []) == cache.entry_key(
        "cuda", "c", "sm_90", source, ["k"], [], ""
    )


def test_pre_included_headers_are_keyed(tmp_path):
    (tmp_path / "pre.h").write_text("#define A 1\n")
    spellings = (["-include", "pre.h"], ["--pre-include=pre.h"], [f"-include{tmp_path / 'pre.h'}"])
    for number, options in enumerate(spellings, start=2):
        before = cache.header_digest("int x;\n", options, cwd=str(tmp_path))
        assert before
        (tmp_path / "pre.h").write_text(f"#define A {number}\n")
        assert cache.header_digest("int x;\n", options, cwd=str(tmp_path)) != before


def test_a_computed_include_is_never_cached(cuda, monkeypatch, tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    (include / "consts.h").write_text("#define HEADER_VALUE 5555555\n")
    source = '#define WHICH "consts.h"\n#include WHICH\n' + SOURCE.split("\n", 1)[1]
    assert cache.header_digest(source, [f"-I{include}"]) is None
    counter = CompileCounter(cuda, monkeypatch)
    assert "5555555" in ptx(source, [f"-I{include}"])
    (include / "consts.h").write_text("#define HEADER_VALUE 6666666\n")
    assert "6666666" in ptx(source, [f"-I{include}"])
    assert counter.count == 2 and entries(tmp_path) == []


def test_a_header_edited_during_the_compile_is_not_stored(cuda, monkeypatch, tmp_path):
    include = tmp_path / "include"
    include.mkdir()
    header = include / "consts.h"
    header.write_text("#define HEADER_VALUE 1212121\n")
    original = cuda.compile

    def compile_then_edit(*args, **kwargs):
        binary = original(*args, **kwargs)
        header.write_text("#define HEADER_VALUE 3434343\n")  # lands after the compiler read it
        return binary

    monkeypatch.setattr(cuda, "compile", compile_then_edit)
    assert "1212121" in ptx(SOURCE, [f"-I{include}"])
    assert entries(tmp_path) == []  # the key was computed from contents the binary may not match


def test_the_next_process_sees_the_edited_header(tmp_path):
    """The hazard as filed: a second process, same disk cache, edited header."""
    include = tmp_path / "include"
    include.mkdir()
    header = include / "consts.h"
    script = textwrap.dedent(
        f"""
        import jitcore as jc
        source = {SOURCE!r}
        kernel = jc.Kernel(source, "k", options=["-I{include}"])
        print(kernel.instantiate().compile_for({ARCH!r}).image.decode())
        """
    )
    env = dict(os.environ, JITCORE_CACHE_DIR=str(tmp_path / "shared-cache"))
    outputs = []
    for value in (8080801, 9090901):
        header.write_text(f"#define HEADER_VALUE {value}\n")
        result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        outputs.append(result.stdout)
    assert "8080801" in outputs[0] and "9090901" in outputs[1] and "8080801" not in outputs[1]
