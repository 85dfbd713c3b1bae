"""The global torch state a graph bakes: every setting the key holds is seen by the replay's
check (both ways it is made), the states that refuse a key, and the list of every global torch
state held against torch's own getters."""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import re
import subprocess
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import replay
from jitcore import torch_native
from replay import torch_state
from replay.errors import RefusedKey


# --- torch modes: every setting read by the key is seen by replay's per-call check -------------
def _flipped(getter, setter, other=lambda value: not value):
    """A context that sets a global torch setting to another value and restores it."""

    @contextlib.contextmanager
    def change():
        before = getter()
        try:
            setter(other(before))  # may fail half-way (torch sets the linalg backend, then raises)
            yield
        finally:
            setter(before)

    return change


_C = torch._C
_matmul = torch.backends.cuda.matmul
_BLAS = getattr(_C, "_BlasBackend", None)
_LINALG = getattr(_C, "_LinalgBackend", None)
#: For each setting the key holds, a context that changes it (explicit: a new reader needs one).
MODE_CHANGES = {
    "grad mode": torch.no_grad,
    "inference mode": torch.inference_mode,
    "autocast (cuda)": lambda: torch.autocast("cuda", dtype=torch.float16),
    "autocast dtype (cuda)": _flipped(
        lambda: torch.get_autocast_dtype("cuda"),
        lambda d: torch.set_autocast_dtype("cuda", d),
        lambda d: torch.bfloat16 if d != torch.bfloat16 else torch.float16,
    ),
    "autocast (cpu)": lambda: torch.autocast("cpu", dtype=torch.bfloat16),
    "autocast dtype (cpu)": _flipped(
        lambda: torch.get_autocast_dtype("cpu"),
        lambda d: torch.set_autocast_dtype("cpu", d),
        lambda d: torch.float16 if d != torch.float16 else torch.bfloat16,
    ),
    "autocast cache": _flipped(torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
    "default dtype": _flipped(
        torch.get_default_dtype,
        torch.set_default_dtype,
        lambda d: torch.float64 if d != torch.float64 else torch.float32,
    ),
    "deterministic algorithms": _flipped(
        torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms
    ),
    "deterministic algorithms (warn only)": _flipped(
        _C._get_deterministic_algorithms_warn_only,
        lambda v: _C._set_deterministic_algorithms(_C._get_deterministic_algorithms(), warn_only=v),
    ),
    "float32 matmul precision": _flipped(
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
        lambda p: "medium" if p != "medium" else "highest",
    ),
    "cuBLAS TF32": _flipped(_C._get_cublas_allow_tf32, _C._set_cublas_allow_tf32),
    "cuBLAS fp16 reduced precision": _flipped(
        lambda: _matmul.allow_fp16_reduced_precision_reduction,
        lambda v: setattr(_matmul, "allow_fp16_reduced_precision_reduction", v),
    ),
    "cuBLAS bf16 reduced precision": _flipped(
        lambda: _matmul.allow_bf16_reduced_precision_reduction,
        lambda v: setattr(_matmul, "allow_bf16_reduced_precision_reduction", v),
    ),
    "cuBLAS fp16 accumulation": _flipped(
        lambda: _matmul.allow_fp16_accumulation, lambda v: setattr(_matmul, "allow_fp16_accumulation", v)
    ),
    "cuDNN TF32": _flipped(_C._get_cudnn_allow_tf32, _C._set_cudnn_allow_tf32),
    "cuDNN enabled": _flipped(_C._get_cudnn_enabled, _C._set_cudnn_enabled),
    "cuDNN benchmark": _flipped(_C._get_cudnn_benchmark, _C._set_cudnn_benchmark),
    "cuDNN deterministic": _flipped(_C._get_cudnn_deterministic, _C._set_cudnn_deterministic),
    "SDPA flash": _flipped(_C._get_flash_sdp_enabled, _C._set_sdp_use_flash),
    "SDPA memory-efficient": _flipped(_C._get_mem_efficient_sdp_enabled, _C._set_sdp_use_mem_efficient),
    "SDPA math": _flipped(_C._get_math_sdp_enabled, _C._set_sdp_use_math),
    "SDPA cuDNN": _flipped(_C._get_cudnn_sdp_enabled, _C._set_sdp_use_cudnn),
    "SDPA math fp16/bf16 reduction": _flipped(
        _C._get_math_sdp_allow_fp16_bf16_reduction, _C._set_math_sdp_allow_fp16_bf16_reduction
    ),
    "SDPA priority order": _flipped(
        _C._get_sdp_priority_order, _C._set_sdp_priority_order, lambda order: list(reversed(order))
    ),
    "preferred BLAS library": _flipped(
        _C._get_blas_preferred_backend,
        _C._set_blas_preferred_backend,
        lambda b: next(m for m in _BLAS.__members__.values() if m != b),
    ),
    "preferred linalg library": _flipped(
        _C._get_linalg_preferred_backend,
        _C._set_linalg_preferred_backend,
        lambda b: next(m for m in _LINALG.__members__.values() if m != b),
    ),
}


@contextlib.contextmanager
def _fp32_precisions_kept():
    """Puts every per-backend float32 precision back afterwards: a legacy TF32 setter writes
    them, and setting it back writes "ieee" where "none" was."""
    if torch_state._FP32_PRECISION is None:
        yield
        return
    get, put = _C._get_fp32_precision_getter, _C._set_fp32_precision_setter
    before = []
    for pair in itertools.product(("generic", "cuda", "mkldnn"), ("all", "matmul", "conv", "rnn")):
        with contextlib.suppress(RuntimeError, ValueError, TypeError):  # a pair this torch lacks
            before.append((pair, get(*pair)))
    try:
        yield
    finally:
        for pair, value in sorted(before, key=lambda entry: entry[0][1] != "all"):  # parents first
            put(*pair, value)


def _fp32_precision_change(backend: str, op: str):
    """A context that sets one of torch's per-backend float32 precisions (torch >= 2.9) to
    another value and restores them all: a setter also changes the precisions below it
    (generic "all" every backend's), so each is put back, parents first."""

    @contextlib.contextmanager
    def change():
        get, put = _C._get_fp32_precision_getter, _C._set_fp32_precision_setter
        with _fp32_precisions_kept():
            put(backend, op, "ieee" if get(backend, op) != "ieee" else "tf32")
            yield

    return change


if torch_state._FP32_PRECISION is not None:
    MODE_CHANGES.update(
        {f"fp32 precision ({b} {op})": _fp32_precision_change(b, op) for b, op in torch_state._FP32_PRECISIONS}
    )
_ROCM_FA = getattr(_C, "_ROCmFABackend", None)
#: Settings of newer torches (each where this torch has its getter and setter).
for _name, _getter, _setter, _other in (
    ("deterministic fill of uninitialized memory", "_get_deterministic_fill_uninitialized_memory",
     "_set_deterministic_fill_uninitialized_memory", lambda v: not v),
    ("cuDNN depthwise kernel", "_get_cudnn_depthwise_kernel", "_set_cudnn_depthwise_kernel",
     lambda k: "native" if k != "native" else "cudnn"),
    ("SDPA FlashAttention-3", "_get_fa3_sdp_enabled", "_set_sdp_use_fa3", lambda v: not v),
    ("preferred ROCm flash-attention library", "_get_rocm_fa_preferred_backend", "_set_rocm_fa_preferred_backend",
     lambda b: next(m for m in _ROCM_FA.__members__.values() if m != b)),
):  # fmt: skip
    if hasattr(_C, _getter) and hasattr(_C, _setter):
        MODE_CHANGES[_name] = _flipped(getattr(_C, _getter), getattr(_C, _setter), _other)


class _PassThrough(torch.utils._python_dispatch.TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class _Logging(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_TRACING_STATES: list = []


@contextlib.contextmanager
def _tracing():
    """A TorchScript tracing state in force (one kept from a finished trace; no op runs under it)."""
    if not _TRACING_STATES:

        def traced(x):
            _TRACING_STATES.append(_C._get_tracing_state())
            return x * 2

        torch.jit.trace(traced, torch.zeros(1))
    before = _C._get_tracing_state()
    _C._set_tracing_state(_TRACING_STATES[0])
    try:
        yield
    finally:
        _C._set_tracing_state(before)


@contextlib.contextmanager
def _global_hook():
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: None)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _cuda_default_tensor_type():
    """torch.set_default_tensor_type with a CUDA type: the C++ default device (raises where
    torch has no CUDA)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecated
        try:
            torch.set_default_tensor_type("torch.cuda.FloatTensor")
        except TypeError as error:  # "not available": as the other settings a CPU build lacks
            raise RuntimeError(str(error)) from None
        try:
            yield
        finally:
            torch.set_default_tensor_type("torch.FloatTensor")


@contextlib.contextmanager
def _vmap_level():
    from torch._functorch.vmap import vmap_increment_nesting

    with vmap_increment_nesting(2, "error"):
        yield


MODE_CHANGES.update(
    {
        "cuBLAS SM carveout": _flipped(
            _C._get_sm_carveout_experimental, _C._set_sm_carveout_experimental, lambda v: 4 if v is None else None
        ),
        "MIOpen immediate mode": _flipped(_C._get_miopen_immediate, _C._set_miopen_immediate),
        "TorchScript executor optimization": _flipped(_C._get_graph_executor_optimize, _C._set_graph_executor_optimize),
        "TorchScript tensor-expression fuser": _flipped(_C._jit_texpr_fuser_enabled, _C._jit_set_texpr_fuser_enabled),
        "TorchScript tensor-expression reductions": _flipped(
            _C._jit_texpr_reductions_enabled, _C._jit_set_texpr_reductions_enabled
        ),
        "TorchScript tensor-expression dynamic shapes": _flipped(
            _C._jit_texpr_dynamic_shape_enabled, _C._jit_set_texpr_dynamic_shape_enabled
        ),
        "TorchScript GPU fusion": _flipped(_C._jit_can_fuse_on_gpu, _C._jit_override_can_fuse_on_gpu),
        "TorchScript profiled runs": _flipped(
            _C._jit_get_num_profiled_runs, _C._jit_set_num_profiled_runs, lambda runs: runs + 1
        ),
        "default device (C++)": _cuda_default_tensor_type,
        "torch function handling disabled": _C.DisableTorchFunction,
        "torch function modes": lambda: torch.device("meta"),
        "torch dispatch modes": _PassThrough,
        "torch.func transform": _vmap_level,
        "TorchScript tracing": _tracing,
        "forward-mode AD": torch.autograd.forward_ad.dual_level,
        "global module hooks": _global_hook,
        "MHA fast path": _flipped(torch.backends.mha.get_fastpath_enabled, torch.backends.mha.set_fastpath_enabled),
        "flush denormal": _flipped(torch_state.python_flush_denormal, torch.set_flush_denormal),
    }
)


@contextlib.contextmanager
def _flash_attention_impl():
    """A flash-attention implementation activated (torch.nn.attention.activate_flash_attention_impl,
    as FA3 or FA4 would be; this one registers no kernel), then the default restored."""
    from torch.nn.attention import _registry

    class Handle:
        def remove(self):
            pass

    torch.nn.attention.register_flash_attention_impl("replay-test", register_fn=Handle)
    try:
        torch.nn.attention.activate_flash_attention_impl("replay-test")
        yield
    finally:
        torch.nn.attention.restore_flash_attention_impl(_raise_warn=False)
        _registry._FLASH_ATTENTION_IMPLS.pop("replay-test", None)


MODE_CHANGES.update(
    {
        "thread-local dispatch keys included": lambda: _C._IncludeDispatchKeyGuard(_C.DispatchKey.Meta),
        "thread-local dispatch keys excluded": _C._AutoDispatchBelowAutograd,
        "flash-attention implementation": _flash_attention_impl,
    }
)
if torch.backends.opt_einsum.is_available():  # else torch refuses to set them
    MODE_CHANGES.update(
        {
            "opt_einsum enabled": lambda: torch.backends.opt_einsum.flags(
                enabled=not torch.backends.opt_einsum.enabled
            ),
            "opt_einsum strategy": lambda: torch.backends.opt_einsum.flags(
                strategy="greedy" if torch.backends.opt_einsum.strategy != "greedy" else "optimal"
            ),
        }
    )
for _name, _getter, _setter, _other in (
    ("cuDNN benchmark limit", "_cuda_get_cudnn_benchmark_limit", "_cuda_set_cudnn_benchmark_limit", lambda n: n + 1),
    ("TunableOp", "_cuda_tunableop_is_enabled", "_cuda_tunableop_enable", lambda v: not v),
    ("TunableOp tuning", "_cuda_tunableop_tuning_is_enabled", "_cuda_tunableop_tuning_enable", lambda v: not v),
):  # fmt: skip
    if hasattr(_C, _getter) and hasattr(_C, _setter):
        MODE_CHANGES[_name] = _flipped(getattr(_C, _getter), getattr(_C, _setter), _other)

#: The settings whose change refuses the key (no graph may be recorded or replayed under it).
REFUSING = {
    "torch dispatch modes", "torch.func transform", "TorchScript tracing", "forward-mode AD", "global module hooks"
}  # fmt: skip


def test_every_mode_the_key_holds_has_a_change_in_this_test():
    assert set(torch_state.MODE_NAMES) <= set(MODE_CHANGES)


def _conjugate_read_as_its_base() -> bool:
    return (torch.tensor([1 + 2j]).conj() * 1).imag.item() == 2.0


def _masked_select_runs_its_meta_kernel() -> bool:
    try:
        torch.masked_select(torch.ones(2), torch.ones(2, dtype=torch.bool))
    except NotImplementedError:  # the Meta kernel it has not
        return True
    return False


#: Guards of the thread's dispatch keys, each with what it makes an op compute otherwise (None:
#: an op with a Python kernel runs it).
_DISPATCH_GUARDS = {
    "below autograd": (_C._AutoDispatchBelowAutograd, lambda: (torch.ones(2, requires_grad=True) * 2).grad_fn is None),
    "conjugation skipped": (
        lambda: _C._ExcludeDispatchKeyGuard(_C.DispatchKeySet(_C.DispatchKey.Conjugate)),
        _conjugate_read_as_its_base,
    ),
    "Meta included": (lambda: _C._IncludeDispatchKeyGuard(_C.DispatchKey.Meta), _masked_select_runs_its_meta_kernel),
    "Python dispatcher": (_C._EnablePythonDispatcher, None),
}


@pytest.mark.parametrize("guard", sorted(_DISPATCH_GUARDS))
def test_a_guard_of_the_threads_dispatch_keys_is_keyed_and_seen_by_the_replay_check(guard, checks_kind):
    """Under such a guard an op computes something else (an output without autograd history, a
    conjugate view read as its base, a meta tensor): a graph recorded under it must not serve a
    call outside it, nor the reverse."""
    make, computes_otherwise = _DISPATCH_GUARDS[guard]
    recorded = torch_state.torch_modes()
    outside = torch_state.modes_changed(recorded)
    with make():
        assert computes_otherwise is None or computes_otherwise()
        inside = torch_state.torch_modes()
        assert inside != recorded and outside() is True
        under = torch_state.modes_changed(inside)
        assert under() is False
    assert under() is True and outside() is False
    assert not _conjugate_read_as_its_base()


def test_an_activated_flash_attention_implementation_is_keyed_and_seen_by_the_replay_check(checks_kind):
    """activate_flash_attention_impl("FA4") swaps the kernels SDPA's flash backend runs: a graph
    recorded under one implementation must not serve a call under another (each activation is
    its own, its handle being another)."""
    recorded = torch_state.torch_modes()
    default = torch_state.modes_changed(recorded)
    with _flash_attention_impl():
        first = torch_state.torch_modes()
        assert first != recorded and default() is True
        assert torch_state.modes_changed(first)() is False
    with _flash_attention_impl():
        assert torch_state.torch_modes() != first and torch_state.modes_changed(first)() is True
    assert default() is False


#: Settings that change nothing while autocast is off: the replay check ignores them then.
AUTOCAST_ONLY = {"autocast dtype (cuda)", "autocast dtype (cpu)", "autocast cache"}


def test_the_check_kind_is_the_one_asked_for(checks_kind):
    changed = torch_state.modes_changed(torch_state.torch_modes())
    if checks_kind == "python":
        assert type(changed).__name__ == "function"
    else:  # the C check, answering from the helper's state with the watch
        assert type(changed).__name__ == "SettingsCheck"
        assert (changed.state is not None) is (checks_kind == "watch")  # the helper's SETTINGS_READER


@pytest.mark.parametrize("name", torch_state.MODE_NAMES)
def test_every_mode_the_key_holds_is_seen_by_the_replay_check(name, checks_kind):
    """Change one setting: the key's tuple changes and the generated per-call check says so
    (the autocast dtypes and cache only while autocast is on: see the next test); back: the
    check passes again."""
    number = torch_state.MODE_NAMES.index(name)
    recorded = torch_state.torch_modes()
    changed = torch_state.modes_changed(recorded)
    autocast_off = not torch.is_autocast_enabled("cuda") and not torch.is_autocast_enabled("cpu")
    assert changed() is False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecations (MAGMA), CPU autocast dtypes
            with MODE_CHANGES[name]():
                if name in REFUSING:
                    with pytest.raises(RefusedKey, match=f"\\({name}: "):
                        torch_state.torch_modes()
                    assert changed() is True
                    return
                now = torch_state.torch_modes()
                if now == recorded:
                    pytest.skip(f"this torch build cannot change {name}")
                assert now[number] != recorded[number]
                assert changed() is not (name in AUTOCAST_ONLY and autocast_off)
    except RuntimeError as error:  # a backend this torch build lacks (cuBLASLt on a CPU build)
        if "compiled with" not in str(error) and "not available" not in str(error):
            raise
        if torch_state.torch_modes() == recorded:
            pytest.skip(f"this torch build cannot change {name}: {error}")
    assert torch_state.torch_modes() == recorded
    assert changed() is False


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_autocast_dtype_and_cache_count_while_autocast_is_on(device, checks_kind):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("autocast for CUDA needs a GPU")
    dtypes = (torch.bfloat16, torch.float16)
    with torch.autocast(device, dtype=dtypes[0]):
        recorded = torch_state.torch_modes()
        changed = torch_state.modes_changed(recorded)
        assert changed() is False
        before = torch.get_autocast_dtype(device)
        torch.set_autocast_dtype(device, dtypes[1])
        try:
            assert changed() is True
        finally:
            torch.set_autocast_dtype(device, before)
        assert changed() is False
        torch.set_autocast_cache_enabled(not torch.is_autocast_cache_enabled())
        try:
            assert changed() is True
        finally:
            torch.set_autocast_cache_enabled(not torch.is_autocast_cache_enabled())
        assert changed() is False
    assert changed() is True  # autocast off again: another setting than recorded


def test_with_autocast_off_one_call_checks_it_for_every_device(checks_kind):
    recorded = torch_state.torch_modes()
    tests = torch_state.setting_tests(recorded)
    assert tests[0].getter == "_is_any_autocast_enabled"
    assert not {"is_autocast_enabled", "get_autocast_dtype", "is_autocast_cache_enabled"} & {t.getter for t in tests}
    changed = torch_state.modes_changed(recorded)
    if checks_kind == "c":
        assert changed.readers[0] is torch_state._any_autocast and changed.arguments[0] == ()
        autocast_readers = {torch._C.is_autocast_enabled, getattr(torch._C, "get_autocast_dtype", None)}
        assert not any(reader in autocast_readers for reader in changed.readers)  # per-device settings
    elif checks_kind == "python":
        source = "".join(__import__("linecache").getlines(changed.__code__.co_filename))
        lines = source.splitlines()
        first_test = lines[lines.index("        return (") + 1]  # the first setting the check reads
        assert "_any_autocast() is not _v0" in first_test
        autocast_cuda = torch_state._SETTINGS[torch_state.MODE_NAMES.index("autocast (cuda)")].function
        assert autocast_cuda not in changed.__globals__.values()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert changed() is True


# --- torch settings read in C++: the torch-side helper's settings watch ------------------------
def _covered_readers(helper) -> list[tuple[str, object]]:
    """(name, a reader) for every per-replay reading the helper's state covers on this torch."""
    covered = set(helper.SETTINGS_COVERED)
    getters = {getter for getter, _ in covered}  # first: some readers' arguments are not hashable
    readers = [(r.what, r.read) for r in torch_state._SETTINGS if r.getter in getters and (r.getter, r.args) in covered]
    if ("_is_any_autocast_enabled", ()) in covered and torch_state._any_autocast is not None:
        readers.append(("any autocast", torch_state._any_autocast))
    return readers


def _entered(name) -> contextlib.ExitStack | None:
    """MODE_CHANGES[name] entered (as a context to exit), or None where this torch build cannot
    make that change."""
    stack = contextlib.ExitStack()
    stack.enter_context(_fp32_precisions_kept())
    try:
        stack.enter_context(MODE_CHANGES[name]())
    except RuntimeError as error:
        stack.close()
        # a backend this torch build lacks (cuBLASLt on a CPU build); a legacy TF32 getter
        # after the per-backend precisions were set (torch 2.9 to 2.11 refuse to answer then)
        if not any(
            reason in str(error)
            for reason in ("compiled with", "not available", "legacy and new APIs", "Nested forward mode AD")
        ):
            raise
        return None
    return stack


@pytest.mark.parametrize("name", sorted(MODE_CHANGES))
def test_the_helpers_state_moves_with_every_setting_it_covers(name, torch_native_helper):
    """The watch's soundness: whatever changes a reading the state covers (each setting the
    key holds, and the legacy TF32 setters that write the per-backend precisions) changes
    the state read in C++, and putting it back puts the state back."""
    readers = _covered_readers(torch_native_helper)
    assert len(readers) >= 25  # the torches tested cover (nearly) every setting
    state = torch_native_helper.settings_state
    before, values = state(), [read() for _, read in readers]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecations (MAGMA), CPU autocast dtypes
        change = _entered(name)
        if change is None:
            pytest.skip(f"this torch build cannot change {name}")
        try:
            moved = [what for (what, read), value in zip(readers, values) if read() != value]
            if not moved:
                pytest.skip(f"{name} changes no reading the state covers on this torch")
            assert state() != before, f"{name} changed {moved} but not the state read in C++"
        finally:
            change.__exit__(None, None, None)
    assert [read() for _, read in readers] == values
    assert state() == before


def test_a_watch_runs_the_full_check_whenever_its_state_moved(torch_native_helper):
    """settings_watch(exact, residual): the full check until it says "unchanged", then only
    the residual while the state stays; any other state runs the full check again, and
    becomes the reference only where the full check says "unchanged"."""
    calls, answer = [], [False]

    def exact():
        calls.append("exact")
        return answer[0]

    def residual():
        calls.append("residual")
        return False

    watch = torch_native_helper.settings_watch(exact, residual)
    assert watch() is False and calls == ["exact"]
    assert watch() is False and watch() is False and calls == ["exact", "residual", "residual"]
    calls.clear()
    with torch.no_grad():  # another state: the full check decides
        answer[0] = True
        assert watch() is True and watch() is True and calls == ["exact", "exact"]
        answer[0] = False
        assert watch() is False and watch() is False and calls == ["exact", "exact", "exact", "residual"]
    calls.clear()
    assert watch() is False and calls == ["exact"]  # grad mode again: not the reference now
    without_residual = torch_native_helper.settings_watch(exact, None)
    calls.clear()
    assert without_residual() is False and without_residual() is False and calls == ["exact"]


def test_a_watch_passes_its_checks_errors_and_refuses_bad_arguments(torch_native_helper):
    def broken():
        raise ValueError("cannot say")

    watch = torch_native_helper.settings_watch(broken, None)
    with pytest.raises(ValueError, match="cannot say"):
        watch()
    with pytest.raises(ValueError, match="cannot say"):
        watch()  # never armed by an error
    with pytest.raises(TypeError, match="no arguments"):
        watch(1)
    with pytest.raises(TypeError, match="exact callable"):
        torch_native_helper.settings_watch(1, None)
    with pytest.raises(TypeError, match="residual callable or None"):
        torch_native_helper.settings_watch(broken, 2)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_watch_answers_as_the_full_check_through_any_sequence_of_changes(torch_native_helper, monkeypatch, data):
    """Settings changed and put back in any order, nested: after every step the replay check
    made with the helper answers what the full (generated) check answers."""
    monkeypatch.setattr(torch_state, "_modes_changed_cache", {})
    recorded = torch_state.torch_modes()
    with torch_native.using(torch_native_helper):
        watch = torch_state.modes_changed(recorded)
    assert type(watch).__name__ == "SettingsCheck" and watch.state is not None
    full = torch_state.modes_changed(recorded, compiled=False)
    names = sorted(MODE_CHANGES)
    entered = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            for _ in range(data.draw(st.integers(1, 10), label="steps")):
                if entered and data.draw(st.booleans(), label="put one back"):
                    entered.pop().__exit__(None, None, None)
                else:
                    change = _entered(data.draw(st.sampled_from(names), label="change"))
                    if change is not None:
                        entered.append(change)
                expected = full()
                assert watch() is expected and watch() is expected
        finally:
            while entered:
                entered.pop().__exit__(None, None, None)
    assert watch() is False and full() is False


def _program(readers, arguments, expected, ways, state=None, uncovered=None):
    """A SettingsProgram's fields, as the C check reads them (by name)."""
    import types

    uncovered = tuple(range(len(readers))) if uncovered is None else uncovered
    return types.SimpleNamespace(
        readers=readers, arguments=arguments, expected=expected, ways=ways, state=state, uncovered=uncovered
    )


def test_the_c_check_makes_the_same_calls_and_comparisons():
    """replay._checks.SettingsCheck on its own: identity, equality and enum-value comparisons,
    the first difference ends it (later readers are not called), readers get their
    arguments, a reader's exception comes out, and bad construction is refused."""
    if torch_state._SettingsCheck is None:
        pytest.skip("replay._checks is not built here")
    check_type = torch_state._SettingsCheck
    calls = []

    def reader(value):
        def read(*args):
            calls.append(args)
            return value

        return read

    class Enum:
        def __init__(self, value):
            self.value = value

    def check(readers, arguments, expected, ways, **kwargs):
        return check_type(_program(readers, arguments, expected, ways), **kwargs)

    same = check((reader(True), reader("x"), reader(Enum(3))), ((), (1, 2), ()), (True, "x", 3), "iev")
    assert same() is False and calls == [(), (1, 2), ()]
    calls.clear()
    for position, readers in enumerate(
        [
            (reader(False), reader("x"), reader(Enum(3))),
            (reader(True), reader("y"), reader(Enum(3))),
            (reader(True), reader("x"), reader(Enum(4))),
        ]
    ):
        assert check(readers, ((), (1, 2), ()), (True, "x", 3), "iev")() is True
        assert len(calls) == position + 1  # stopped at the difference
        calls.clear()
    assert check((reader([1, 2]),), ((),), ([1, 2],), "e")() is False
    assert check((reader([1, 2]),), ((),), ([1, 3],), "e")() is True
    half = 0.5
    assert check((reader(half),), ((),), (half,), "i")() is False
    assert check((reader(half),), ((),), (float("0.5"),), "i")() is True  # identity: another object

    def broken():
        raise RuntimeError("no reading")

    with pytest.raises(RuntimeError, match="no reading"):
        check((broken,), ((),), (True,), "i")()
    with pytest.raises(AttributeError):
        check((reader(5),), ((),), (5,), "v")()  # an int has no .value
    with pytest.raises(ValueError, match="one entry per setting"):
        check((reader(1),), ((), ()), (1,), "i")
    with pytest.raises(ValueError, match="ways"):
        check((reader(1),), ((),), (1,), "x")
    with pytest.raises(TypeError, match="not callable"):
        check((1,), ((),), (1,), "i")
    with pytest.raises(TypeError, match="no arguments"):
        same(1)
    with pytest.raises(AttributeError):
        check_type(object())  # a program without its fields
    with pytest.raises(TypeError, match="state must be None or a"):
        check_type(_program((reader(1),), ((),), (1,), "i", state=1))
    with pytest.raises(ValueError, match="uncovered"):
        check_type(_program((reader(1),), ((),), (1,), "i", uncovered=(1,)))
    # with `unreadable`, an Exception becomes its answer; a BaseException still comes out
    answers = []

    def unreadable():
        answers.append(1)
        return True

    assert check((broken,), ((),), (True,), "i", unreadable=unreadable)() is True and answers == [1]
    assert check((reader(5),), ((),), (5,), "v", unreadable=lambda: 0)() is False

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        check((interrupted,), ((),), (True,), "i", unreadable=unreadable)()
    with pytest.raises(TypeError, match="callable"):
        check((reader(1),), ((),), (1,), "i", unreadable=1)


_READER = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.POINTER(ctypes.c_int64), ctypes.c_ssize_t)
_CAPSULE_NAME = b"jitcore._torch_native.settings_reader"


def _reader_capsule(read):
    """A SETTINGS_READER-like capsule of a Python function ``read() -> list of ints or None``
    (None: the state cannot be read), and what must stay alive with it."""

    def reader(values, capacity):
        state = read()
        if state is None or len(state) > capacity:
            return -1
        for i, value in enumerate(state):
            values[i] = value
        return len(state)

    function = _READER(reader)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.cast(function, ctypes.c_void_p), _CAPSULE_NAME, None), function


def test_the_c_check_answers_from_the_state_only_where_its_tests_said_the_same():
    """With a state: every test until they all say "the same" in a state read twice alike,
    then only the uncovered tests while the state stays; any other state runs them all, and
    becomes the reference only where they all said "the same". A state that cannot be read
    decides nothing."""
    if torch_state._SettingsCheck is None:
        pytest.skip("replay._checks is not built here")
    calls, values, states = [], {"a": 1, "b": 2}, [[0]]

    def reader(name):
        def read():
            calls.append(name)
            return values[name]

        return read

    capsule, kept = _reader_capsule(lambda: states[0])
    check = torch_state._SettingsCheck(
        _program((reader("a"), reader("b")), ((), ()), (1, 2), "ee", state=capsule, uncovered=(1,))
    )
    assert check.state is capsule
    assert check.armed is False and check() is False and calls == ["a", "b"] and check.armed is True
    calls.clear()
    assert check() is False and check() is False and calls == ["b", "b"]  # the uncovered test alone
    values["b"] = 3
    assert check() is True and calls == ["b", "b", "b"]
    values["b"] = 2
    calls.clear()
    states[0] = [1, 5]  # another state: every test decides
    values["a"] = 5
    assert check() is True and check() is True and calls == ["a", "a"]
    values["a"] = 1
    assert check() is False and calls == ["a", "a", "a", "b"]
    calls.clear()
    assert check() is False and calls == ["b"]  # [1, 5] is the reference now
    states[0] = None
    calls.clear()
    assert check() is False and calls == ["a", "b"]  # unreadable: the tests decide
    states[0] = list(range(300))  # more than the check holds: as unreadable
    calls.clear()
    assert check() is False and calls == ["a", "b"]
    with pytest.raises(TypeError, match="capsule"):
        torch_state._SettingsCheck(_program((reader("a"),), ((),), (1,), "e", state=lambda: (0,)))
    del kept


# --- torch settings: the new TF32 API (torch >= 2.9) in either import order ------------------
_NEW_API_SCRIPT = r"""
import os, sys, warnings
warnings.simplefilter("error")  # a reader dropped or a refusal would show
import torch
order = sys.argv[1]
if order == "before":
    torch.backends.cuda.matmul.fp32_precision = "tf32"
from replay import torch_state as rk
wanted = {"fp32 precision (cuda matmul)", "fp32 precision (cuda conv)", "fp32 precision (generic all)"}
assert wanted <= set(rk.MODE_NAMES), rk.MODE_NAMES
torch.backends.cuda.matmul.fp32_precision = "tf32"
tf32 = rk.torch_modes()  # never raises, in either order
changed = rk.modes_changed(tf32)
assert changed() is False
torch.backends.cuda.matmul.fp32_precision = "ieee"
ieee = rk.torch_modes()
assert ieee != tf32 and changed() is True, (ieee, tf32)
torch.backends.cuda.matmul.fp32_precision = "tf32"
assert changed() is False
def toggled(holder):
    return lambda: setattr(holder, "fp32_precision", "tf32" if holder.fp32_precision == "ieee" else "ieee")
b = torch.backends
for change in (
    # the legacy API writes the map too ("high" and "medium" differ in oneDNN's entries only)
    lambda: torch.set_float32_matmul_precision("highest" if b.cuda.matmul.fp32_precision == "tf32" else "high"),
    toggled(b), toggled(b.cudnn), toggled(b.cudnn.conv), toggled(b.cudnn.rnn), toggled(b.cuda.matmul),
):
    before = rk.torch_modes()
    check = rk.modes_changed(before)
    change()
    assert rk.torch_modes() != before and check() is True
# oneDNN's precisions (CPU ops, which no graph holds) are neither keyed nor checked
for change in (toggled(b.mkldnn.matmul), toggled(b.mkldnn.conv), toggled(b.mkldnn.rnn)):
    before = rk.torch_modes()
    check = rk.modes_changed(before)
    change()
    assert rk.torch_modes() == before and check() is False
print("ok", os.environ.get("JITCORE_NATIVE", "1"))
"""


@pytest.mark.skipif(torch_state._FP32_PRECISION is None, reason="torch < 2.9 has no per-backend fp32_precision")
@pytest.mark.parametrize("order", ["before", "after"])
def test_the_new_tf32_api_is_keyed_and_checked_in_either_import_order(order, checks_kind):
    """In a fresh process (torch's settings are process-wide): the API set before replay is
    imported (the old readers were dropped: silently wrong) or after (every key raised)."""
    import pathlib

    root = pathlib.Path(torch_state.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, "-c", _NEW_API_SCRIPT, order], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ok")


def test_a_setting_that_cannot_be_read_refuses_the_key_and_the_replay(monkeypatch, checks_kind):
    """Never a key or a replay without a setting: a reader that raises makes torch_modes
    raise RefusedKey naming it, and a replay's check answer True (refused) with one warning."""
    recorded = torch_state.torch_modes()
    state = {"broken": False}

    def flaky():
        if state["broken"]:
            raise RuntimeError("cannot say")
        return True

    readers = [*torch_state._SETTINGS, torch_state.Setting("a flaky setting", "flaky", flaky)]
    monkeypatch.setattr(torch_state, "_SETTINGS", readers)
    monkeypatch.setattr(torch_state, "MODE_NAMES", (*torch_state.MODE_NAMES, "a flaky setting"))
    monkeypatch.setattr(torch_state, "_modes_changed_cache", {})
    monkeypatch.setattr(torch_state, "_WARNED_UNREADABLE", set())
    modes = torch_state._make_torch_modes()
    recorded = modes()
    check = torch_state.modes_changed(recorded)
    assert check() is False
    state["broken"] = True
    with pytest.raises(RefusedKey, match="the torch setting a flaky setting cannot be read"):
        modes()
    with pytest.warns(replay.ReplayWarning, match="a flaky setting cannot be read"):
        assert check() is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check() is True  # warned once
    state["broken"] = False
    assert check() is False


# --- every global torch state that changes what an op computes: keyed, refused or outside -----
#: torch's getters of global state, by name: the settings torch.backends wraps are torch._C
#: getters too (tested below).
_GETTER = re.compile(
    r"_get_\w+|_is_\w+_(enabled|disabled)|is_\w+_enabled|_jit_(get|can|is)_\w+|_jit_(?!set_)\w+_enabled"
    r"|_cuda_\w*get_\w+|_cuda_\w*is_enabled|_len_torch_\w+|_is_tracing|_llvm_enabled"
    r"|_dispatch_tls_(?!set_)\w+|_meta_in_tls_dispatch_include|_are_\w+_active|_jit_texpr_fallback_allowed"
    r"|_functionalization_\w+_tls"
)
#: Names the pattern catches that read no global setting: queries of the build or of a value
#: passed in, files, models and schemas, caches' statistics, torch internals' scratch space.
NOT_STATE = {
    "_get_DTensor_sharding_propagator_cache_stats", "_get_accelerator", "_get_all_dtypes", "_get_blas_default_backend",
    "_get_caught_jit_exception_class_name", "_get_caught_jit_exception_original_msg", "_get_constant_bool_symnode",
    "_get_custom_class_python_wrapper", "_get_file_format", "_get_max_operator_version",
    "_get_mobile_model_contained_types", "_get_mobile_model_contained_types_from_buffer",
    "_get_model_bytecode_version", "_get_model_bytecode_version_from_buffer", "_get_model_extra_files",
    "_get_model_extra_files_from_buffer", "_get_model_ops_and_info", "_get_model_ops_and_info_from_buffer",
    "_get_module_info_from_flatbuffer", "_get_nested_int", "_get_obj_in_tls", "_get_operation_overload",
    "_get_operator_version_map", "_get_privateuse1_backend_name", "_get_schema", "_get_tensor_metadata",
    "_get_thread_name", "_get_upgrader_ranges", "_get_upgraders_entry_map", "_get_upgraders_map_size",
    "_get_value_trace", "_get_version_calculator_flag", "_jit_get_all_schemas", "_jit_get_custom_class_schemas",
    "_jit_get_operation", "_jit_get_schemas_for_operator", "_jit_is_script_object",
    "_cuda_get_stream",  # the current stream: a replay launches on it
}  # fmt: skip


def _handled_getters() -> set[str]:
    return {getter for handling in torch_state.GLOBAL_STATE.values() for getter in handling.getters}


def test_every_getter_of_global_torch_state_is_keyed_refused_or_said_to_change_nothing_a_graph_holds():
    """The enumeration: every torch._C getter of global state (and every setting of
    torch.backends, whose properties read such getters) is named in GLOBAL_STATE. A torch that
    grows a setting fails here until the setting is handled."""
    from torch.backends import ContextProp

    getters = {name for name in dir(torch._C) if _GETTER.fullmatch(name)}
    for module in _backends_modules():
        for prop in type(module).__dict__.values():
            if isinstance(prop, ContextProp):
                getter = vars(prop)["getter"]
                getters.add("_get_fp32_precision_getter" if getter.__name__ == "inner" else getter.__name__)
    unhandled = sorted(getters - _handled_getters() - NOT_STATE)
    assert not unhandled, f"global torch state neither keyed, refused nor said to change nothing: {unhandled}"


def _backends_modules() -> list:
    import importlib
    import pkgutil

    modules = []
    for info in pkgutil.iter_modules(torch.backends.__path__):
        with contextlib.suppress(Exception):  # a backend this build cannot import
            importlib.import_module(f"torch.backends.{info.name}")
            modules.append(sys.modules[f"torch.backends.{info.name}"])
    return modules


def test_every_setting_the_key_holds_is_listed_and_every_listed_one_this_torch_has_is_keyed():
    handled = {name for handling in torch_state.GLOBAL_STATE.values() for name in handling.names}
    assert set(torch_state.MODE_NAMES) <= handled
    for name, handling in torch_state.GLOBAL_STATE.items():
        assert handling.how in ("keyed", "refused", "outside"), name
        assert handling.getters, name
        assert (handling.how == "outside") is bool(handling.why) or handling.how == "refused", name
        for what in handling.names:  # a setting this torch has is in the key
            wanted = [entry for entry in torch_state._WANTED if entry[0] == what]
            assert len(wanted) == 1, what
            _, getter, function, _, extra = wanted[0]
            has = function is not None or hasattr(torch._C, getter) or hasattr(torch, getter)
            superseded = what in torch_state._SUPERSEDED_BY_FP32_PRECISION and torch_state._FP32_PRECISION is not None
            if has and not superseded:
                assert what in torch_state.MODE_NAMES, what
            if handling.how == "refused" and what in torch_state.MODE_NAMES:
                refuses = (
                    extra.get("required", torch_state.ANY) is not torch_state.ANY or what == "torch function modes"
                )
                assert refuses, what


def test_a_torch_function_mode_other_than_a_device_refuses_and_a_device_is_keyed():
    recorded = torch_state.torch_modes()
    check = torch_state.modes_changed(recorded)
    number = torch_state.MODE_NAMES.index("torch function modes")
    with torch.device("meta"):
        meta = torch_state.torch_modes()
        assert meta[number] == (torch.device("meta"),) and check() is True
        assert torch_state.modes_changed(meta)() is False
        with _Logging():
            with pytest.raises(RefusedKey, match=r"TorchFunctionMode .*_Logging\) is active"):
                torch_state.torch_modes()
            assert torch_state.modes_changed(meta)() is True
    torch.set_default_device("meta")
    try:
        assert torch_state.torch_modes()[number] == (torch.device("meta"),)
    finally:
        torch.set_default_device(None)
    with _Logging():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a refused state is a change, never "cannot be read"
            assert check() is True
    assert check() is False


def test_the_readers_of_state_without_a_torch_getter_answer_alike_in_c_and_python():
    for on in (True, False):
        if not torch.set_flush_denormal(on):
            pytest.skip("this CPU cannot flush denormals")
        assert torch_state.flush_denormal() is on and torch_state.python_flush_denormal() is on
    dicts = ({}, {1: 2}, {3: 4, 5: 6})
    assert torch_state.total_length(*dicts) == torch_state.python_total_length(*dicts) == 3
    assert torch_state.total_length() == 0
    with pytest.raises(TypeError):
        torch_state.total_length(1)


def test_a_draw_from_the_cpu_generator_is_seen():
    before = torch_state.cpu_random_state()
    torch.ones(3) * 2  # no draw
    assert torch_state.cpu_random_advanced(before) is False
    torch.rand(())
    assert torch_state.cpu_random_advanced(before) is True
    state = torch_state.cpu_random_state()
    torch.manual_seed(0)
    assert torch_state.cpu_random_advanced(state) is True


def test_a_setting_a_run_left_changed_is_named_and_a_refused_state_counts_as_one():
    before = torch_state.settings_or_none()
    assert before is not None and torch_state.setting_changed(before) is None
    with torch.no_grad():
        assert torch_state.setting_changed(before) == "grad mode"
    torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    try:
        assert torch_state.setting_changed(before) == "cuDNN benchmark"
    finally:
        torch.backends.cudnn.benchmark = not torch.backends.cudnn.benchmark
    with _PassThrough():  # a state no key holds: the run left something no graph replays
        assert torch_state.settings_or_none() is None and torch_state.setting_changed(before) is not None
    assert torch_state.setting_changed(None) is not None
