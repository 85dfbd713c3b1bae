"""Runtime compilation on the CPU: real NVRTC, cubins for sm_90, errors with source lines."""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

pytest.importorskip("cuda.bindings.nvrtc", reason="the cuda extra (cuda-bindings, nvidia-cuda-nvrtc) is not installed")

import jitcore as jc
from jitcore import compiler
from jitcore.backends import get_backend
from jitcore.errors import CompileError

SOURCE = r"""
template <typename T, int SCALE>
__global__ void scale(const T* __restrict__ x, T* __restrict__ y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = x[i] * (T)(float)SCALE;
}
"""
ELF = b"\x7fELF"


@pytest.fixture
def cuda():
    return get_backend("cuda")


def test_compiles_a_template_to_a_cubin_for_sm90(cuda):
    spec = jc.Kernel(SOURCE, "scale").instantiate(torch.float32, 3)
    assert spec.name_expression == "scale<float, 3>"
    binary = spec.compile_for("sm_90")
    assert binary.image.startswith(ELF)
    assert binary.lowered_names["scale<float, 3>"].startswith("_Z5scaleIfLi3EEv")
    assert binary.arch == "sm_90"


@pytest.mark.parametrize(
    "dtype",
    [
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    ],
)
def test_every_template_dtype_compiles(cuda, dtype):
    source = (
        "template <typename T> __global__ void copy(const T* x, T* y, int n) "
        "{ int i = threadIdx.x; if (i < n) y[i] = x[i]; }"
    )
    spec = jc.Kernel(source, "copy").instantiate(dtype)
    assert spec.compile_for("sm_90").image.startswith(ELF)
    assert spec.param_types[0].accepts_dtype(str(dtype).removeprefix("torch."))


def test_extern_c_and_options_pass_through(cuda, tmp_path):
    header = tmp_path / "inc" / "factor.h"
    header.parent.mkdir()
    header.write_text("#define FACTOR 7\n")
    source = '#include "factor.h"\nextern "C" __global__ void k(int* out) { out[0] = FACTOR * OFFSET; }'
    kernel = jc.Kernel(source, "k", options=[f"-I{header.parent}", "-DOFFSET=3", "-lineinfo"])
    binary = kernel.instantiate().compile_for("sm_90")
    assert binary.lowered_names["k"] == "k"
    with pytest.raises(CompileError):  # without the define it does not compile
        jc.Kernel(source, "k", options=[f"-I{header.parent}"]).instantiate().compile_for("sm_90")


def test_compile_error_carries_log_and_numbered_source_lines(cuda):
    source = "\n".join(
        [
            "__global__ void broken(float* x) {",
            "    int i = threadIdx.x;",
            "    x[i] = undefined_name + 1.0f;",
            "}",
        ]
    )
    with pytest.raises(CompileError) as info:
        jc.Kernel(source, "broken").instantiate().compile_for("sm_90")
    error = info.value
    assert "undefined_name" in error.log
    assert "kernel.cu(3)" in error.log  # the user's line number, not the prelude's
    assert ">3 |     x[i] = undefined_name + 1.0f;" in error.source_excerpt
    assert " 2 |     int i = threadIdx.x;" in error.source_excerpt
    assert str(error).count("undefined_name") >= 2


def test_second_compile_is_a_disk_cache_hit(cuda, monkeypatch):
    spec = jc.Kernel(SOURCE, "scale").instantiate(torch.float32, 5)
    first = spec.compile_for("sm_90")

    def refuse(*args, **kwargs):
        raise AssertionError("recompiled despite a cache entry")

    monkeypatch.setattr(cuda, "compile", refuse)
    assert jc.Kernel(SOURCE, "scale").instantiate(torch.float32, 5).compile_for("sm_90") == first


def test_a_corrupted_entry_is_recompiled(cuda):
    from jitcore.backends import cache

    spec = jc.Kernel(SOURCE, "scale").instantiate(torch.float32, 6)
    spec.compile_for("sm_90")
    text = compiler.full_source(cuda, SOURCE, spec.template_args)
    key = cache.entry_key("cuda", cuda.compiler_version(), "sm_90", text, [spec.name_expression], ())
    path = cache.entry_path(key)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0x55
    path.write_bytes(bytes(data))
    assert cache.load(key) is None
    assert spec.compile_for("sm_90").image.startswith(ELF)
    assert cache.load(key) is not None


def test_prelude_includes_only_what_is_used(cuda):
    assert "cuda_fp16.h" not in cuda.prelude("__global__ void k(float* x) {}", ["float"])
    assert "cuda_fp16.h" in cuda.prelude("__global__ void k(__half* x) {}", [])
    assert "cuda_bf16.h" in cuda.prelude("", ["__nv_bfloat16"])
    assert "cuda_fp8.h" in cuda.prelude("", ["__nv_fp8_e4m3"])


def _one_byte_objects_intact() -> bool:
    # CPython shares one bytes object per single byte value: a C call that writes into one
    # changes that byte everywhere in the process (a kernel parameter read back as b" " then
    # reads as b"\0")
    return all(bytes([value])[0] == value for value in range(256))


@pytest.mark.parametrize("arch", ["sm_90", "compute_90"])
def test_compiling_never_writes_into_shared_bytes_objects(cuda, arch):
    # a clean compile has an empty log: one byte, its terminator, which NVRTC writes into
    # the buffer it is given
    assert _one_byte_objects_intact()
    binary = cuda.compile("__global__ void empty_log(int* x) { x[0] = 1; }", ["empty_log"], [], arch)
    assert binary.log == ""
    assert _one_byte_objects_intact()
    assert binary.image.startswith(ELF) if arch.startswith("sm_") else b".entry" in binary.image


def test_compiles_and_cache_hits_are_logged(cuda, caplog):
    caplog.set_level(logging.DEBUG, logger="jitcore")
    source = "__global__ void logged(int* x, int n) { x[0] = n; }  // " + str(uuid.uuid4())
    jc.Kernel(source, "logged").instantiate().compile_for("sm_90")
    jc.Kernel(source, "logged").instantiate().compile_for("sm_90")
    messages = [r.getMessage() for r in caplog.records if r.name == "jitcore"]
    assert any(m.startswith("logged for sm_90: compiled in") for m in messages), messages
    assert "logged for sm_90: from the disk cache" in messages
