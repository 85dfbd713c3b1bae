"""The watch on a real GPU: a module a region closes over (or is), changed between calls by
each route that used to leave a stale graph serving them (``load_state_dict(assign=True)``,
``.data =``, ``.half()``, ``.to(dtype)``, a replaced submodule, a plain attribute), replays
exactly afterwards: every call is compared bit for bit with an eager run of the same module on
the same fresh random input, with the previous output poisoned (NaN) before each call so that a
replay that does not write its output shows. And every way of making the check sees each change
of tests/replay/test_watch.py on CUDA tensors (the interpreter here may keep other dict tags
and watchers than the CPU machine's)."""

from __future__ import annotations

import pytest
import torch

import replay
from tests.replay.test_objects_gpu import poison, same
from tests.replay.test_watch import MODEL_CHANGES, check_a_module_change

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("with_and_without_helper")]

DEVICE = "cuda"
WIDTH = 64


class Scaled(torch.nn.Module):
    """A linear layer, a float attribute and a norm: the weights read where they lie, the
    attribute baked into the graph as a constant of its kernels."""

    def __init__(self):
        super().__init__()
        self.inner = torch.nn.Linear(WIDTH, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.scale = 1.5

    def forward(self, x):
        return self.norm(self.inner(x) * self.scale)


def _weights_like(m: torch.nn.Module) -> dict:
    return {k: torch.randn_like(v) for k, v in m.state_dict().items()}


def _new_data(tensor: torch.Tensor) -> None:
    tensor.data = torch.randn_like(tensor)


CHANGES = {
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(_weights_like(m), assign=True),
    ".data =": lambda m: _new_data(m[0].inner.weight),
    ".half()": lambda m: m.half(),
    ".to(dtype)": lambda m: m.to(torch.float64),
    "a replaced submodule": lambda m: setattr(m[1], "inner", torch.nn.Linear(WIDTH, WIDTH, device=DEVICE)),
    "a plain attribute": lambda m: setattr(m[0], "scale", -2.0),
}


def _calls(step, m, count: int, module_region: bool) -> None:
    """``count`` calls on fresh random inputs, each compared bit for bit with the module's eager
    run; the previous output poisoned before each call."""
    previous = None
    for _ in range(count):
        x = torch.randn(8, WIDTH, device=DEVICE)
        if module_region:
            x = x.to(m[0].inner.weight.dtype)  # the caller converts, as for the eager call
        if previous is not None:
            poison(previous)
        out = step(x)
        with torch.no_grad():
            expected = m(x.to(m[0].inner.weight.dtype))
        torch.cuda.synchronize()
        assert same(out, expected)
        previous = out


@pytest.mark.parametrize("name", list(CHANGES))
@pytest.mark.parametrize("how", ["closure", "module region"])
def test_a_module_changed_between_calls_is_replayed_exactly_after_the_change(name, how):
    torch.manual_seed(0)
    m = torch.nn.Sequential(Scaled(), Scaled()).to(DEVICE).requires_grad_(False)

    def closure(x):
        return m(x.to(m[0].inner.weight.dtype))

    with replay.capture() as session:
        step = session.region(m if how == "module region" else closure)
        with torch.no_grad():
            _calls(step, m, 6, how == "module region")
            before = session.stats()
            assert before.replays >= 2, "the region never replayed before the change"
            CHANGES[name](m)
            m.requires_grad_(False)
            _calls(step, m, 8, how == "module region")
        after = session.stats()
    assert after.invalidations >= 1
    assert after.replays >= before.replays + 2, "the region did not replay again after the change"


@pytest.mark.parametrize("name", list(MODEL_CHANGES))
def test_each_change_to_a_module_on_the_gpu_is_seen_by_every_check(name, torch_native_helper):
    check_a_module_change(name, torch_native_helper, DEVICE)
