"""Drive HipBackend through hip-python against the fake libamdhip64/libhiprtc (fake_hip.c).

Run by test_hip_fake_driver.py in a fresh interpreter whose ROCM_PATH and LD_LIBRARY_PATH point
at the fake (the dynamic loader reads them at start-up). ``argv[1]`` is the fake library. Every
check is an assert; "ok" on the last line means all passed. What this proves: each hip-python
call hip.py makes accepts the arguments hip.py gives it and hands C the values intended, and
the ctypes graph calls read and write HIP's struct layouts. What it cannot prove: anything
about a real ROCm runtime or GPU.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

import pytest

from jitcore import compiler
from jitcore.backends import abi, get_backend
from jitcore.backends.hip import HipBackend, hip
from jitcore.errors import CompileError, DriverError

fake = ctypes.CDLL(sys.argv[1])


def value(name: str, ctype: type = ctypes.c_int) -> int:
    return ctype.in_dll(fake, name).value


def array(name: str, ctype: type, count: int) -> list[int]:
    return list((ctype * count).in_dll(fake, name))


backend = get_backend("hip")
assert isinstance(backend, HipBackend)
include_dir = os.path.join(os.environ["ROCM_PATH"], "include")

# --- compilation ---------------------------------------------------------------------------
assert backend.compiler_version() == "hiprtc-6.2"
assert backend.device_arch(0) == "gfx942"
binary = backend.compile("__global__ void k() {}", ["add<float>", "k"], ["-O3"], "gfx942")
options = ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(fake, "fake_options"))).decode()
assert options == f"--offload-arch=gfx942\n-std=c++17\n-I{include_dir}\n-O3\n", options
assert binary.image == b"CODE:" + options.encode()
assert binary.lowered_names == {"add<float>": "_lowered_add<float>", "k": "_lowered_k"}
assert binary.compiler == "hiprtc-6.2" and binary.arch == "gfx942" and binary.log == ""
assert value("fake_destroyed") == 1 and value("fake_destroy_bad") == 0

os.environ["JITCORE_CACHE"] = "0"
with pytest.raises(CompileError) as failure:
    compiler.compile_cached(backend, "__global__ void k() {}\n#error x\n", ["k"], [], "gfx942")
assert "boom" in failure.value.log and ">2 | #error x" in failure.value.source_excerpt
assert value("fake_destroyed") == 2 and value("fake_destroy_bad") == 0

# --- modules, limits, launches -------------------------------------------------------------
function = backend.load(binary, "add<float>", device=1)
assert ctypes.string_at(ctypes.addressof(ctypes.c_char.in_dll(fake, "fake_function_name"))) == b"_lowered_add<float>"
assert ctypes.string_at(value("fake_loaded_image", ctypes.c_void_p), len(binary.image)) == binary.image
attr = hip.hipFunction_attribute
assert function.address == int(function.handle) == 0x6000 and function.device == 1
assert function.max_threads_per_block == 2000 + attr.HIP_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK.value
assert function.static_shared_bytes == 2000 + attr.HIP_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES.value
assert function.dynamic_shared_limit == 2000 + attr.HIP_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES.value
assert value("fake_current_device") == 0 and value("fake_set_device_calls") == 2  # to 1 and back

a = hip.hipDeviceAttribute_t
limits = backend.device_limits(0)
assert limits.max_block == tuple(
    1000 + x.value
    for x in (a.hipDeviceAttributeMaxBlockDimX, a.hipDeviceAttributeMaxBlockDimY, a.hipDeviceAttributeMaxBlockDimZ)
)
assert limits.max_grid[2] == 1000 + a.hipDeviceAttributeMaxGridDimZ.value
assert limits.max_threads_per_block == 1000 + a.hipDeviceAttributeMaxThreadsPerBlock.value
assert limits.max_shared_per_block == 1000 + a.hipDeviceAttributeMaxSharedMemoryPerBlock.value
assert limits.max_shared_per_block_optin == 1000 + a.hipDeviceAttributeSharedMemPerBlockOptin.value

backend.set_dynamic_shared_limit(function, 100)
assert function.dynamic_shared_limit == 100
with pytest.raises(DriverError, match="hipErrorInvalidValue"):
    backend.set_dynamic_shared_limit(function, 10**6)

layout = abi.ParamLayout.of(abi.parse_signature("unsigned long long a, int b"))
params = abi.PackedParams(layout, struct.pack("<Qi", 0x0102030405060708, 9))
for stream in (0x4242, 0):
    backend.launch(function, (3, 2, 1), (64, 1, 1), 128, stream, params)
    launch = array("fake_launch", ctypes.c_ulonglong, 12)
    assert launch[:11] == [0x6000, 3, 2, 1, 64, 1, 1, 128, stream, params.address, 0], launch
assert bytes(array("fake_launch_param0", ctypes.c_ubyte, 8)) == struct.pack("<Q", 0x0102030405060708)

namespace = dict(backend.hot_namespace, _f0=function.handle, stream=backend.stream_object(0x77), _params=params.address)
source = backend.launch_template.format(
    function="_f0",
    gx=5,
    gy=1,
    gz=1,
    bx=32,
    by=2,
    bz=1,
    shared=0,
    stream="stream",
    params="_params",
    label="'add<float>'",
)
exec(source, namespace)
assert array("fake_launch", ctypes.c_ulonglong, 12)[:11] == [0x6000, 5, 1, 1, 32, 2, 1, 0, 0x77, params.address, 0]
with pytest.raises(
    DriverError, match=r"hipModuleLaunchKernel\(add<float>\).*hipErrorInvalidValue.*fake: invalid value"
):
    exec(source.replace("5, 1, 1, 32", "999, 1, 1, 32"), namespace)
backend.synchronize(0)

# --- graphs --------------------------------------------------------------------------------
nodes = backend.graph_nodes(0x7000)
assert [n.kind for n in nodes] == ["kernel", "memcpy", "memset", "kernel", "other"]
first, _, memset, extra_node, _ = nodes
assert (first.function, first.grid, first.block, first.shared_bytes) == (0x6000, (4, 2, 1), (128, 1, 1), 256)
assert first.params_address and not extra_node.params_address and extra_node.function == 0x6100
assert memset.pointers == (0xDEAD0000,)
assert backend.read_kernel_params(first, [8, 4]) == [struct.pack("<Q", 0x1122334455667788), struct.pack("<i", -5)]
assert backend.read_kernel_params(extra_node, [4, 8]) == [struct.pack("<i", 7), struct.pack("<Q", 0xABC)]
assert backend.kernel_param_sizes(first.function) is None

updater = backend.node_updater(0x8000, first, layout, params.bytes())
struct.pack_into("<i", updater.params.buffer, 8, -77)
assert updater.set_call(*updater.set_args) == (0,)
updater.apply()
assert (value("fake_set_exec", ctypes.c_ulonglong), value("fake_set_node", ctypes.c_ulonglong)) == (
    0x8000,
    first.handle,
)
sent = (ctypes.c_ubyte * ctypes.sizeof(updater.node_params)).in_dll(fake, "fake_set_params")
assert bytes(sent) == bytes(updater.node_params)
assert bytes(array("fake_set_param_bytes", ctypes.c_ubyte, 12)) == struct.pack("<Qi", 0x0102030405060708, -77)

backend.graph_launch(0x8000, 0x4242)
assert array("fake_graph_launch", ctypes.c_ulonglong, 3) == [0x8000, 0x4242, 1]
namespace["_exec"] = backend.graph_exec_object(0x8000)
exec(backend.graph_launch_template.format(exec="_exec", stream="stream"), namespace)
assert array("fake_graph_launch", ctypes.c_ulonglong, 3) == [0x8000, 0x77, 2]
with pytest.raises(DriverError, match="hipGraphLaunch"):
    backend.graph_launch(0x999, 0)
print("ok")
