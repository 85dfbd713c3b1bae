"""Triton launches as first-class launches: the pure mapping from a Python call to the kernel's
C parameters and their provenance, against real ``triton.jit`` kernels and Triton's own
binder and signature packing, without a GPU (the GPU tests launch them:
``test_triton_gpu.py``)."""

from __future__ import annotations

import struct

import attrs
import pytest
import torch

from replay import rebinding, triton_launches
from replay.dynamic import Dynamic, DynamicScalar
from replay.errors import DynamicScalarError
from replay.graph import MISMATCH
from replay.rebinding import CheckBinding, InputRange, LaunchView, ParamView, Plan, PointerBinding
from tests.replay.test_graph import build, node_pointer

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

BACKEND = make_backend(GPUTarget("cuda", 90, 32))


@triton.jit
def scaled_add(x_ptr, y_ptr, out_ptr, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * scale + tl.load(y_ptr + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["m"])
def flags(x_ptr, flag, m, k: tl.int64, f: tl.float32):
    tl.store(x_ptr, flag + m + k + f)


@attrs.define
class FakeKernel:
    """What map_launch reads of a CompiledKernel: the compiled signature and metadata."""

    src: object
    metadata: object


def compiled(fn, args, kwargs):
    """Triton's own binder and signature packing for this call (as JITFunction.run does)."""
    plain = [a.value if isinstance(a, DynamicScalar) else a for a in args]
    binder = create_function_from_signature(fn.signature, fn.params, BACKEND)
    bound, specialization, options = binder(*plain, **kwargs)
    _, signature, _, _ = fn._pack_args(BACKEND, dict(kwargs), bound, specialization, options)
    src = attrs.make_class("Src", ["signature"])(signature)
    metadata = attrs.make_class("Meta", ["num_ctas", "global_scratch_size", "profile_scratch_size"])(1, 0, 0)
    return FakeKernel(src, metadata), specialization


def mapped(fn, args, kwargs, sizes=None):
    kernel, specialization = compiled(fn, args, kwargs)
    return triton_launches.map_launch(fn, kernel, args, kwargs, specialization, BACKEND, sizes)


def dyn(value, i=4):
    return DynamicScalar(f"_d{i}", value, f"args[{i}]")


def test_parameters_follow_the_launcher_constexprs_vanish_and_scratch_pointers_follow():
    x, y, out = torch.zeros(64), torch.zeros(64), torch.zeros(64)
    layout, data, params, checks, _ = mapped(scaled_add, [x, y, out, dyn(48), 2.5], {"BLOCK": 64})
    assert [t.size for t in layout.types] == [8, 8, 8, 4, 4, 8, 8]
    assert list(layout.offsets) == [0, 8, 16, 24, 28, 32, 40]
    assert struct.unpack_from("<QQQifQQ", data) == (x.data_ptr(), y.data_ptr(), out.data_ptr(), 48, 2.5, 0, 0)
    assert [(p.kind, p.arg_index) for p in params[:3]] == [("pointer", 0), ("pointer", 1), ("pointer", 2)]
    assert params[3].kind == "scalar" and params[3].scalar_args == (3,) and params[3].evaluate([0, 0, 0, 7]) == 7
    assert params[4].kind == "constant" and [p.kind for p in params[5:]] == ["constant", "constant"]
    assert [c.scalar_args for c in checks] == [(3,)]


def test_the_driver_must_agree_on_the_parameter_sizes():
    x = torch.zeros(64)
    mapped(scaled_add, [x, x, x, 48, 2.5], {"BLOCK": 64}, sizes=[8, 8, 8, 4, 4, 8, 8])
    with pytest.raises(triton_launches.Unmappable):
        mapped(scaled_add, [x, x, x, 48, 2.5], {"BLOCK": 64}, sizes=[8, 8, 8, 4, 4, 8])


def test_a_dynamic_int_recorded_as_one_is_a_constant_and_declines_every_other_value():
    x = torch.zeros(64)
    layout, _, params, checks, _ = mapped(scaled_add, [x, x, x, dyn(1), 2.5], {"BLOCK": 64})
    assert len(layout.types) == 6  # n specialized away
    assert not any(p.kind == "scalar" for p in params)
    (check,) = checks
    assert [check.size([None, None, None, v]) for v in (1, 2, 16, 0)] == [1, 0, 0, 0]


def test_a_dynamic_int_keeps_its_divisibility_and_its_type_or_declines():
    x = torch.zeros(64)
    *_, checks, _ = mapped(scaled_add, [x, x, x, dyn(32), 2.5], {"BLOCK": 64})
    (check,) = checks
    ok = {v: check.size([None, None, None, v]) for v in (48, 0, -16, 33, 1, 2**31, 2**31 - 16)}
    assert ok == {48: 1, 0: 1, -16: 1, 33: 0, 1: 0, 2**31: 0, 2**31 - 16: 1}
    *_, checks, _ = mapped(scaled_add, [x, x, x, dyn(33), 2.5], {"BLOCK": 64})
    assert [checks[0].size([None, None, None, v]) for v in (35, 48, 2**40 + 3)] == [1, 0, 0]


def test_the_specializer_agrees_with_tritons_binder_for_every_kind_of_parameter():
    binder = create_function_from_signature(flags.signature, flags.params, BACKEND)
    values = [0, 1, 2, 15, 16, 17, 32, -1, -16, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**63, 2**64 - 16]
    values += [True, False, 0.0, -0.0, 1.0, 2.5, float("nan"), float("inf")]
    x = torch.zeros(4)
    for value in values:
        _, specialization, _ = binder(x, value, value, value, value)
        for k in (1, 2, 3, 4):
            assert tuple(triton_launches.specializer(flags.params[k], BACKEND)(value)) == tuple(specialization[k])


def test_pointer_alignment_is_recorded_as_the_kernel_was_specialized():
    x = torch.zeros(64)
    _, _, params, _, _ = mapped(scaled_add, [x, x[1:], x[4:], 48, 2.5], {"BLOCK": 64})
    assert [p.aligned for p in params[:3]] == [True, False, True]


def test_a_dynamic_scalar_into_a_constexpr_is_refused():
    x = torch.zeros(64)
    kernel, specialization = compiled(scaled_add, [x, x, x, 48, 2.5], {"BLOCK": 64})
    with pytest.raises(DynamicScalarError, match="constexpr"):
        triton_launches.map_launch(scaled_add, kernel, [x, x, x, 48, 2.5], {"BLOCK": dyn(64)}, specialization, BACKEND)


def test_cluster_launches_and_scratch_memory_are_left_foreign():
    x = torch.zeros(64)
    kernel, specialization = compiled(scaled_add, [x, x, x, 48, 2.5], {"BLOCK": 64})
    for change in ({"num_ctas": 2}, {"global_scratch_size": 128}):
        bad = attrs.evolve(kernel, metadata=attrs.evolve(kernel.metadata, **change))
        with pytest.raises(triton_launches.Unmappable):
            triton_launches.map_launch(scaled_add, bad, [x, x, x, 48, 2.5], {"BLOCK": 64}, specialization, BACKEND)


def test_the_plan_carries_the_alignment_to_the_pointer_binding():
    x = torch.zeros(64)
    param = ParamView(0, 0, 8, "Q", "pointer", aligned=False)
    launch = LaunchView(7, "k", struct.pack("<Q", x.data_ptr() + 4), (param,))
    node = rebinding.NodeView(0, "kernel", 7, (struct.pack("<Q", x.data_ptr() + 4),))
    inputs = [InputRange(0, "args[0]", x.data_ptr(), x.data_ptr() + 256)]
    empty: set[int] = set()
    plan = rebinding.build_plan(
        inputs, [launch], [node], staged=empty, copied_back=empty, torch_read=empty, torch_written=empty
    )
    assert plan.failure is None and plan.pointers[0].aligned is False and plan.pointers[0].delta == 4


def test_a_replay_declines_a_pointer_whose_alignment_changed():
    storage = torch.zeros(256)
    x = storage[4:68]  # 16-byte aligned
    graph, sim = build([x], Plan(pointers=[PointerBinding(0, 0, 0, 0, 0, 0, aligned=True)]))
    graph.replay(storage[8:72])
    assert node_pointer(sim) == storage[8:72].data_ptr()
    launches = len(sim.launched)
    assert graph.replay(storage[1:65]) is MISMATCH  # 4 bytes off: the binary assumed 16
    assert len(sim.launched) == launches
    graph, sim = build([storage[1:65]], Plan(pointers=[PointerBinding(0, 0, 0, 0, 0, 0, aligned=False)]))
    assert graph.replay(storage[4:68]) is MISMATCH  # eager would run the aligned binary
    graph.replay(storage[2:66])
    assert node_pointer(sim) == storage[2:66].data_ptr()


def test_a_replay_declines_a_dynamic_value_that_specializes_otherwise():
    x = torch.zeros(64)
    spec = triton_launches.specializer(scaled_add.params[3], BACKEND)
    check = triton_launches.SpecializationCheck(1, spec, tuple(spec(32)))
    plan = Plan(checks=[CheckBinding(0, check.value, check.size)], arguments={0: (None, "_d1")})
    graph, _sim = build([x, Dynamic(32)], plan)
    assert graph.replay(x, Dynamic(64)) is not MISMATCH
    for value in (1, 33, 2**31):
        assert graph.replay(x, Dynamic(value)) is MISMATCH
    assert graph.replay(x, Dynamic(0)) is not MISMATCH


def test_without_a_capture_triton_launches_are_untouched():
    original = triton.runtime.jit.JITFunction.run
    with triton_launches.recording(object()):
        assert triton.runtime.jit.JITFunction.run is not original
    assert triton.runtime.jit.JITFunction.run is original
    triton_launches.ENABLED[0] = False
    try:
        with triton_launches.recording(object()):
            assert triton.runtime.jit.JITFunction.run is original
    finally:
        triton_launches.ENABLED[0] = True


def test_a_launch_is_reported_with_its_dynamic_scalars_grid_and_checks(monkeypatch):
    """The wrapper's path without a GPU: Triton's driver and the launch stood in for, the rest
    (binding, Triton's binder and signature, the mapping, the record) real."""
    from triton.runtime import driver as triton_driver

    from jitcore.backends import use_backend
    from jitcore.backends.null import NullBackend
    from replay.recording import launch_views

    class FakeDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 1234

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    class Backend(NullBackend):
        name = "cuda"

        def kernel_param_sizes(self, function):
            return [8, 8, 8, 4, 4, 8, 8]

    launched = {}

    def original(fn, *args, grid, warmup, **kwargs):
        kernel, _ = compiled(fn, list(args), kwargs)
        launched.update(args=args, grid=grid)
        metadata = attrs.make_class("M", ["num_ctas", "num_warps", "shared"])(1, 4, 0)
        return attrs.make_class("K", ["src", "metadata", "function"])(kernel.src, metadata, 99)

    class Recorder:
        records: list = []

        def launch(self, record):
            self.records.append(record)

    monkeypatch.setattr(triton_driver, "_active", FakeDriver())
    x, recorder = torch.zeros(64), Recorder()
    n, m = dyn(48, 2), dyn(5, 3)
    with use_backend(Backend()):
        triton_launches._record_launch(
            recorder, original, scaled_add, (x, x, x, n, 2.5), {"BLOCK": 64}, lambda _: (m * 2,)
        )
    assert launched["grid"] == (10, 1, 1) and launched["args"][3] == 48  # Triton got the values
    (record,) = recorder.records
    assert record.function == 99 and record.stream == 1234 and record.launched and record.grid == (10, 1, 1)
    (config,) = record.dynamic_config
    assert config.field == "grid_x" and config.evaluate([None] * 6 + [10]) == 10
    view = launch_views([record])[0]
    assert view.scalar_sources[3] == "_d2" and view.scalar_sources[config.scalar_args[0]].startswith("(_d3 *")
    assert view.dynamic_args == {3, config.scalar_args[0]}
    with use_backend(Backend()), pytest.raises(DynamicScalarError, match="launch option"):
        triton_launches._record_launch(
            recorder, original, scaled_add, (x, x, x, 48, 2.5), {"BLOCK": 64, "num_warps": m}, (1,)
        )
