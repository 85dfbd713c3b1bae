"""replay.watch: the state a region reaches through its globals, closures and objects, watched.

Each change a graph would bake stale is seen, and nothing is seen where nothing changed, by
every way the check is made: csrc/replay_checks.c's WatchCheck reading tensors through the
torch-side helper (with dict version tags and without), WatchCheck without the helper (tensors
compared in Python), and the program's own Python check. The bounds; the C check leaves to
Python exactly what identity cannot decide; and a region re-keys on a change (CPU, with the
session's recording double, whose graphs replay what they baked, as a stale graph would).
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import warnings

import attrs
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jitcore.backends import use_backend
from jitcore.backends.null import NullBackend
from replay import watch
from replay.errors import ReplayWarning
from replay.lifecycle import REPLAYING

from .test_drift_regions import BakingSession, warm
from .test_session import DoubleSession

try:
    from replay import _checks
except ImportError:
    _checks = None


class Block(torch.nn.Module):
    """A module of every kind of state: parameters (in a submodule), a buffer, a plain tensor
    attribute, a 2-D tensor attribute, and float attributes."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.register_buffer("offset", torch.randn(4))
        self.mask = torch.randn(4)
        self.table = torch.randn(2, 3)
        self.scale = 1.5
        self.shift = 0.0

    def forward(self, x):
        return self.norm(self.linear(x) * self.scale + self.offset + self.shift) * self.mask


class Slotted:
    __slots__ = ("weight", "factor")

    def __init__(self):
        self.weight, self.factor = torch.randn(3), 2


def model() -> torch.nn.Module:
    return torch.nn.Sequential(Block(), Block())


class Holder:
    """A plain object holding a list, a dict, a set and an object with slots."""

    def __init__(self):
        self.weights = [torch.randn(3), torch.randn(3)]
        self.table = {"a": torch.randn(2), "k": 1000}
        self.flags = {1, 2}
        self.slotted = Slotted()


def holder() -> Holder:
    return Holder()


def _reassigned_data(tensor: torch.Tensor, value: torch.Tensor) -> None:
    tensor.data = value


@torch.no_grad()
def _added_in_place(tensor: torch.Tensor) -> None:
    tensor.add_(1)


# (what it does, the path the Python check names, or None where nothing changed that a graph bakes)
MODEL_CHANGES = {
    "load_state_dict(assign=True)": (
        lambda m: m.load_state_dict({k: v.clone() for k, v in m.state_dict().items()}, assign=True),
        "model[0].offset",
    ),
    "load_state_dict, copied in place": (
        lambda m: m.load_state_dict({k: v * 2 for k, v in m.state_dict().items()}),
        None,
    ),
    ".data =": (lambda m: _reassigned_data(m[0].linear.weight, m[0].linear.weight.data * 2), "model[0].linear.weight"),
    ".half()": (lambda m: m.half(), "model[0].offset"),
    ".to(float64)": (lambda m: m.to(torch.float64), "model[0].offset"),
    ".data = of the same memory, transposed": (
        lambda m: _reassigned_data(m[0].linear.weight, m[0].linear.weight.data.t()),
        "model[0].linear.weight",
    ),
    "resize_ smaller": (lambda m: m[0].mask.resize_(2), "model[0].mask"),
    "resize_ larger": (lambda m: m[0].mask.resize_(64), "model[0].mask"),
    "set_": (lambda m: m[0].mask.set_(torch.zeros_like(m[0].mask)), "model[0].mask"),
    "t_()": (lambda m: m[0].table.t_(), "model[0].table"),
    "unsqueeze_": (lambda m: m[1].table.unsqueeze_(0), "model[1].table"),
    "swap_tensors": (lambda m: torch.utils.swap_tensors(m[0].mask, torch.zeros_like(m[0].mask)), "model[0].mask"),
    "conj bit": (lambda m: _reassigned_data(m[0].table, m[0].table.data.conj()), None),  # real: conj() is itself
    "neg bit": (lambda m: _reassigned_data(m[0].mask, m[0].mask.data._neg_view()), "model[0].mask"),
    "a float attribute set": (lambda m: setattr(m[0], "scale", 2.0), "model[0].scale"),
    "a float attribute to -0.0": (lambda m: setattr(m[1], "shift", -0.0), "model[1].shift"),
    "a float attribute to an equal float": (lambda m: setattr(m[0], "scale", float("1.5")), None),
    "an attribute added": (lambda m: setattr(m[0], "extra", 1), "model[0].extra"),
    "eval()": (lambda m: m.eval(), "model.training"),
    "train() while training": (lambda m: m.train(), None),
    "a submodule replaced": (lambda m: setattr(m[0], "linear", torch.nn.Linear(4, 4)), "model[0].linear"),
    "a forward hook": (lambda m: m[1].linear.register_forward_hook(lambda *a: None), "model[1].linear._forward_hooks"),
    "a forward pre-hook": (lambda m: m[1].norm.register_forward_pre_hook(lambda *a: None), "model[1].norm"),
    "a parameter deleted": (lambda m: delattr(m[0].linear, "bias"), "model[0].linear.bias"),
    "a parameter written into the registry": (
        lambda m: m[0].linear._parameters.__setitem__(
            "weight", torch.nn.Parameter(torch.randn_like(m[0].linear.weight))
        ),
        "model[0].linear.weight",
    ),
    "__class__ assigned": (lambda m: setattr(m[0], "__class__", type("Other", (Block,), {})), "model[0] (its class)"),
    "__dict__ replaced by an equal dict": (
        lambda m: setattr(m[0], "__dict__", dict(m[0].__dict__)),
        "model[0].__dict__",
    ),
    "requires_grad_ (not watched)": (lambda m: m.requires_grad_(False), None),
    "values written in place": (lambda m: _added_in_place(m[0].linear.weight), None),
    "a forward call": (lambda m: m(torch.randn(2, 4, device=m[0].mask.device)), None),
}
#: Changes whose path names a hook's id (a number of the moment): the path starts with the one given.
_PATH_PREFIX = {"a forward hook", "a forward pre-hook"}

HOLDER_CHANGES = {
    "a list grown": (lambda h: h.weights.append(torch.randn(3)), "holder.weights"),
    "a list item replaced": (lambda h: h.weights.__setitem__(0, torch.randn(3)), "holder.weights"),
    "a list item set to itself": (lambda h: h.weights.__setitem__(0, h.weights[0]), None),
    "a dict value replaced": (lambda h: h.table.__setitem__("a", torch.randn(2)), "holder.table['a']"),
    "a dict int set to an equal int": (lambda h: h.table.__setitem__("k", int("1000")), None),
    "a dict key added": (lambda h: h.table.__setitem__("b", 2), "holder.table['b']"),
    "a dict key removed": (lambda h: h.table.pop("k"), "holder.table['k']"),
    "a set grown": (lambda h: h.flags.add(3), "holder.flags"),
    "a slot set": (lambda h: setattr(h.slotted, "factor", 3), "holder.slotted.factor"),
    "a slot's tensor moved": (lambda h: _reassigned_data(h.slotted.weight, torch.zeros(3)), "holder.slotted.weight"),
    "__dict__ replaced": (lambda h: setattr(h, "__dict__", dict(h.__dict__)), "holder.__dict__"),
}


def all_checks(roots, helper) -> dict[str, object]:
    """Every way of making the check of ``roots``, on programs built now."""
    with_words = watch.build(roots, helper)
    without_words = watch.build(roots, None)
    made = {"python": (with_words, watch.python_check(with_words))}
    if _checks is not None:
        made["c"] = (with_words, _checks.WatchCheck(with_words))
        made["c, no tags"] = (with_words, _checks.WatchCheck(with_words, tags=False))
        made["c, no helper"] = (without_words, _checks.WatchCheck(without_words))
    return made


def _answers(made: dict) -> dict[str, bool]:
    return {name: check() for name, (_, check) in made.items()}


@pytest.fixture
def helper(request):
    """The torch-side helper built for real, or None where it cannot be (no C++ compiler,
    ``JITCORE_NATIVE=0``): the checks then compare tensors in Python."""
    try:
        return request.getfixturevalue("torch_native_helper")
    except pytest.skip.Exception:
        return None


def check_a_module_change(name: str, helper, device: str = "cpu") -> None:
    """Every check of a module tree on ``device`` says "the same" before the change ``name``
    and what MODEL_CHANGES says after it (twice: version tags armed or not), and the Python
    check names its path."""
    m = model().to(device)
    for block in m:  # plain tensor attributes are not moved by .to(): on the device as the rest
        block.mask, block.table = block.mask.to(device), block.table.to(device)
    made = all_checks([(m, "model")], helper)
    assert not any(_answers(made).values()), "a check saw a change before any"
    change, path = MODEL_CHANGES[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        change(m)
    expected = path is not None
    assert _answers(made) == dict.fromkeys(made, expected)
    assert _answers(made) == dict.fromkeys(made, expected)
    found = made["python"][0].first_change()
    assert found.startswith(path) if name in _PATH_PREFIX else found == path


@pytest.mark.parametrize("name", list(MODEL_CHANGES))
def test_each_change_to_a_module_is_seen_by_every_check_and_nothing_else(name, helper):
    check_a_module_change(name, helper)


@pytest.mark.parametrize("name", list(HOLDER_CHANGES))
def test_each_change_to_containers_and_objects_is_seen_by_every_check(name, helper):
    h = holder()
    made = all_checks([(h, "holder")], helper)
    assert not any(_answers(made).values())
    change, path = HOLDER_CHANGES[name]
    change(h)
    assert _answers(made) == dict.fromkeys(made, path is not None)
    assert made["python"][0].first_change() == path


def test_what_a_module_tree_holds_is_watched_once_each(helper):
    """Tied weights and a shared submodule are watched once; a cycle ends; the state-dict
    hooks and the hooks' keyword flags are held by identity, not walked."""
    m = model()
    m[1].linear = m[0].linear  # shared
    object.__setattr__(m[0], "back", m)  # a cycle, through an attribute that is not registered
    program = watch.build([(m, "model"), (m[0].linear.weight, "tied")], helper)
    tensors = program.tensors
    assert len({id(t) for t in tensors}) == len(tensors)
    assert sum(t is m[0].linear.weight for t in tensors) == 1
    paths = {path for path, _ in program.dict_paths}
    assert "model[0].linear" in paths and "model[1].linear" not in paths
    assert not any(d is m._state_dict_hooks or d is m._forward_hooks_with_kwargs for d in program.dicts)
    assert any(d is m._forward_hooks for d in program.dicts)
    if helper is not None:
        assert all(words is not None for words in program.words)  # the helper reads every plain tensor


def test_tensors_the_helper_does_not_read_are_compared_in_python(helper):
    """A tensor subclass (a subclass may answer otherwise in Python) and a sparse tensor: no
    words; both checks still see them moved."""

    class Marked(torch.Tensor):
        pass

    subclass = torch.randn(3).as_subclass(Marked)
    sparse = torch.randn(3).to_sparse()
    roots = [([subclass, sparse], "tensors")]
    program = watch.build(roots, helper)
    assert program.words == (None, None)
    made = all_checks(roots, helper)
    assert not any(_answers(made).values())
    subclass.data = torch.zeros(5)
    assert all(_answers(made).values())


def test_the_c_check_asks_python_only_where_identity_cannot_decide(helper):
    """The C check calls ``same`` for a holder whose identities differ, and, where version
    tags are kept, not again once the equal value was found the same (its tag is armed)."""
    if _checks is None or helper is None:
        pytest.skip("replay._checks or the torch-side helper is not built here (tensors are then compared in Python)")
    asked = []

    class Counting(watch.WatchProgram):
        def same(self, kind, index):
            asked.append((kind, index))
            return super().same(kind, index)

    m = model()
    built = watch.build([(m, "model")], helper)
    program = Counting(**{f.name: getattr(built, f.name) for f in attrs.fields(watch.WatchProgram)})
    check = _checks.WatchCheck(program)
    for _ in range(3):
        assert check() is False
    assert asked == []
    m[0].scale = float("1.5")  # an equal float, another object
    assert check() is False and len(asked) == 1 and asked[0][0] == "d"
    check()
    assert len(asked) == (1 if check.tags else 2)
    m[0].scale = 2.5
    assert check() is True


@pytest.mark.skipif(_checks is None or not getattr(_checks, "WATCH_EPOCH", 0), reason="dict watchers: CPython 3.12+")
def test_a_dict_watcher_epoch_skips_the_dicts_until_any_watched_dict_changes(helper):
    m = model()
    program = watch.build([(m, "model")], helper)
    check = _checks.WatchCheck(program)
    assert check.epoch and check() is False and check() is False
    other = watch.build([(model(), "other")], helper)
    other_check = _checks.WatchCheck(other)
    other.dicts[0]["training"] = True  # moves the epoch: every check compares its dicts again
    assert check() is False and other_check() is False
    m[1].scale = 3.0
    assert check() is True


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_property_every_check_answers_alike_through_random_sequences_of_changes(data, helper):
    """After every step of a random sequence of changes (some of them putting back what was
    there, or setting an equal value), every way of making the check gives one answer."""
    m = model()
    made = all_checks([(m, "model")], helper)
    names = sorted(MODEL_CHANGES)
    back = {
        "scale back": lambda m: setattr(m[0], "scale", 1.5),
        "shift back": lambda m: setattr(m[1], "shift", 0.0),
        "train": lambda m: m.train(),
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(data.draw(st.integers(1, 6), label="steps")):
            name = data.draw(st.sampled_from(names + sorted(back)), label="change")
            try:
                (back[name] if name in back else MODEL_CHANGES[name][0])(m)
            except Exception:  # a change an earlier one made impossible (a forward call after resize_)
                pass
            answers = _answers(made)
            assert len(set(answers.values())) == 1, answers


def test_objects_of_the_packages_not_followed_are_held_not_walked(helper):
    """jitcore's launchers, replay's regions and triton's kernels keep caches that fill as they
    compile: walked, they would re-key a region at every new shape. Modules and optimizers are
    walked wherever they come from (an optimizer's learning rate is baked by a step)."""

    class Launcher:
        def __init__(self):
            self.cache = {}

    Launcher.__module__ = "triton.runtime.jit"
    launcher, weight = Launcher(), torch.nn.Parameter(torch.randn(2))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    made = all_checks([(launcher, "launcher"), (optimizer, "optimizer")], helper)
    program = made["python"][0]
    assert not any(d is launcher.__dict__ for d in program.dicts) and any(t is weight for t in program.tensors)
    launcher.cache["new shape"] = object()
    assert not any(_answers(made).values())
    optimizer.param_groups[0]["lr"] = 0.05
    assert all(_answers(made).values())
    assert program.first_change() == "optimizer.param_groups[0]['lr']"


# --- the bounds --------------------------------------------------------------------------------
def test_the_depth_bound_leaves_what_lies_deeper_unwatched(helper):
    deep = leaf = torch.randn(2)
    for _ in range(watch.MAX_DEPTH + 3):
        deep = [deep]
    program = watch.build([(deep, "deep")], helper)
    assert program.unwatched and all(t is not leaf for t in program.tensors)
    assert program.unwatched[0].startswith("deep" + "[0]" * (watch.MAX_DEPTH + 1))


def test_the_count_bound_leaves_the_rest_unwatched_and_the_region_says_so(monkeypatch, helper):
    monkeypatch.setattr(watch, "MAX_VALUES", 20)
    weights = [torch.randn(2) for _ in range(8)]
    more = [torch.randn(2) for _ in range(8)]
    program = watch.build([(weights, "weights"), (more, "more")], helper)
    assert program.values == 16 and program.unwatched == ("more",)  # a list and its 8 tensors

    def step(x):
        return x + weights[0] + more[0]

    with pytest.warns(ReplayWarning, match=r"stops at its bounds \(20 values"):
        watch.RegionSnapshot(step, owner="region step", prefix="_r")


def test_nothing_reachable_makes_no_watch(helper):
    def step(x):
        return x + 1

    snapshot = watch.RegionSnapshot(step, owner="region step", prefix="_r")
    assert not snapshot.watch and not any("watch" in line for line in snapshot.check_lines)


# --- regions -------------------------------------------------------------------------------------
@pytest.fixture
def session():
    with use_backend(NullBackend()):
        made = BakingSession(record_after=0)
        DoubleSession.current = made
        yield made


REGION_CHANGES = {
    "load_state_dict(assign=True)": lambda m: m.load_state_dict(
        {k: torch.randn_like(v) for k, v in m.state_dict().items()}, assign=True
    ),
    ".data =": lambda m: _reassigned_data(m[0].linear.weight, m[0].linear.weight.data * 2),
    ".to(float64)": lambda m: m.to(torch.float64),
    "resize_ of an attribute": lambda m: m[1].mask.resize_(1),
    "a float attribute": lambda m: setattr(m[0], "scale", -3.0),
    "a submodule replaced": lambda m: setattr(m[1], "linear", torch.nn.Linear(4, 4)),
    "a forward hook": lambda m: m[0].register_forward_hook(lambda module, args, out: out * 2),
    "eval() (dropout off)": lambda m: m.eval(),
}


def _with_dropout() -> torch.nn.Module:
    m = model()
    m.append(torch.nn.Dropout(0.0))  # training or not: the same values, other modules' flags
    return m


@pytest.mark.parametrize("name", list(REGION_CHANGES))
@pytest.mark.parametrize("how", ["closure", "module region", "bound forward", "keyword call"])
def test_a_region_rekeys_on_each_change_and_returns_what_eager_returns(session, name, how, checks_kind):
    m = _with_dropout().requires_grad_(False)

    def closure(x):
        return m(x.to(m[0].linear.weight.dtype))

    def keyword(x, bias=0.0):
        return m(x.to(m[0].linear.weight.dtype)) + bias

    fn = {"closure": closure, "module region": m, "bound forward": m.forward, "keyword call": keyword}[how]
    step = session.region(fn)
    call = (lambda x: step(x, bias=0.0)) if how == "keyword call" else step
    x = torch.randn(2, 4)
    if how in ("module region", "bound forward"):
        x = x.to(m[0].linear.weight.dtype)
    warm(step, x, call)
    with torch.no_grad():
        REGION_CHANGES[name](m)
    if how in ("module region", "bound forward") and name == ".to(float64)":
        x = x.to(torch.float64)  # the same call a user makes of the converted module: its own key
    with torch.no_grad():
        expected = fn(x, bias=0.0) if how == "keyword call" else fn(x)
    assert torch.equal(call(x), expected)
    assert session.stats().invalidations == 1
    for _ in range(3):
        assert torch.equal(call(x), expected)
    assert [e.state for e in step.entries.values()] == [REPLAYING] or len(step.entries) > 1


def test_a_region_whose_state_does_not_change_keeps_replaying(session, checks_kind):
    m = model().requires_grad_(False)
    step = session.region(lambda x: m(x))
    x = torch.randn(2, 4)
    warm(step, x)
    replays = session.stats().replays
    for _ in range(10):
        step(x)
    with torch.no_grad():
        m[0].linear.weight.add_(1)  # values: read live by a graph
    step(x)
    stats = session.stats()
    assert (stats.invalidations, stats.replays) == (0, replays + 11)


def test_a_drift_seen_by_the_watch_names_what_changed(helper):
    m = model()

    def step(x):
        return m(x)

    snapshot = watch.RegionSnapshot(step, owner="region step", prefix="_r")
    snapshot.check()
    m[1].shift = 5.0
    with pytest.raises(watch.GlobalDriftError, match=r"m\[1\]\.shift, reached by region step"):
        snapshot.check()


# --- other interpreters ----------------------------------------------------------------------------
#: Run by another CPython with replay._checks built for it (no torch there): an object's
#: attributes written every way (a store the interpreter specializes, setattr, through its
#: __dict__, the __dict__ replaced), and a dict that is no object's, each seen, and nothing else.
PROBE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import _checks


class Program:  # a watch program's fields, without tensors
    def __init__(self, holder, table):
        self.dicts = (holder.__dict__, table)
        self.dict_keys = tuple(tuple(d) for d in self.dicts)
        self.dict_values = tuple(tuple(d.values()) for d in self.dicts)
        self.lists, self.list_items = (), ()
        self.objects, self.types, self.object_dicts = (holder,), (type(holder),), (holder.__dict__,)
        self.tensors, self.words, self.reader, self.others = (), (), None, 0

    def same(self, kind, index):
        now = tuple(self.dicts[index].items())
        then = tuple(zip(self.dict_keys[index], self.dict_values[index]))
        pairs = [(a, b) for pair, other in zip(now, then) for a, b in zip(pair, other)]
        return len(now) == len(then) and all(a is b or (type(a) is type(b) is int and a == b) for a, b in pairs)


class Holder:
    pass


def stores(holder, count, last):
    for i in range(count):  # specialized by the interpreter after a few rounds
        holder.b = i
    holder.b = last


CHANGES = [
    (lambda h, t: stores(h, 100, 2000), False),
    (lambda h, t: stores(h, 100, 7), True),
    (lambda h, t: setattr(h, "b", 9), True),
    (lambda h, t: setattr(h, "b", int("2000")), False),  # an equal int, another object
    (lambda h, t: h.__dict__.__setitem__("b", 9), True),
    (lambda h, t: setattr(h, "c", 1), True),
    (lambda h, t: setattr(h, "__dict__", dict(h.__dict__)), True),
    (lambda h, t: t.__setitem__("k", 5), True),
    (lambda h, t: t.__setitem__("k", int("1000")), False),
]
for tags in (True, False):
    for change, expected in CHANGES:
        holder, table = Holder(), {"k": 1000}
        holder.a, holder.b = 1.5, 2000
        check = _checks.WatchCheck(Program(holder, table), tags=tags)
        assert check() is False and check() is False
        change(holder, table)
        assert check() is expected, (sys.version, tags, CHANGES.index((change, expected)))
        assert check() is expected
print("ok", _checks.WATCH_TAGS, _checks.WATCH_EPOCH)
"""


def _other_pythons() -> list[str]:
    """Other CPythons 3.10 to 3.14 here: on the PATH, or installed by pyenv (whose shims run
    only the versions selected)."""
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    found = {}
    for minor in range(10, 15):
        candidates = sorted(glob.glob(os.path.join(pyenv, "versions", f"3.{minor}.*", "bin", f"python3.{minor}")))
        candidates.append(shutil.which(f"python3.{minor}") or "")
        for path in candidates:
            if minor != sys.version_info.minor and path and ".pyenv/shims" not in path:
                found.setdefault(minor, path)
    return [found[minor] for minor in sorted(found)]


@pytest.mark.parametrize("python", _other_pythons() or [None])
def test_the_c_check_sees_every_write_on_each_cpython_found_here(python, tmp_path):
    """csrc/replay_checks.c's dict version tags (3.10 to 3.12) and dict watcher epoch (3.12 on,
    without objects' __dict__s from 3.13) depend on what each interpreter tells: built for
    every other CPython on the PATH and run there."""
    if python is None:
        pytest.skip("no other CPython 3.10 to 3.14 on the PATH")
    compiler = shutil.which(os.environ.get("CC", "cc"))
    query = "import sysconfig; print(sysconfig.get_paths()['include']); print(sysconfig.get_config_var('EXT_SUFFIX'))"
    asked = subprocess.run([python, "-c", query], capture_output=True, text=True)
    if asked.returncode != 0:
        pytest.skip(f"{python} does not run here")
    include, suffix = asked.stdout.split()
    if compiler is None or not os.path.exists(os.path.join(include, "Python.h")):
        pytest.skip(f"no C compiler or no headers for {python}")
    source = os.path.join(os.path.dirname(watch.__file__), os.pardir, "csrc", "replay_checks.c")
    built = subprocess.run(
        [compiler, "-shared", "-fPIC", "-O2", f"-I{include}", source, "-o", str(tmp_path / f"_checks{suffix}")],
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    ran = subprocess.run([python, "-c", PROBE, str(tmp_path)], capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout.startswith("ok"), ran.stderr[-3000:]


def _with_grads() -> torch.optim.Optimizer:
    m = torch.nn.Linear(2, 2)
    for parameter in m.parameters():
        parameter.grad = torch.zeros_like(parameter)
    return torch.optim.SGD(m.parameters(), lr=0.1)


class _Items(list):
    pass


class _Entries(dict):
    pass


def _attributed(container):
    container.weight = torch.zeros(3)
    return container


def _defaulted(x, cfg={"scale": 1.0}, *, w=torch.zeros(2)):  # noqa: B006, B008 (its defaults are what is watched)
    return x


# (what it makes, what it does, the path the Python check names): state the walk reaches
# beyond a plain object's dict, each a value a graph bakes
REACHED_CHANGES = {
    "an optimizer's gradient replaced": (
        _with_grads,
        lambda o: setattr(o.param_groups[0]["params"][0], "grad", torch.ones(2, 2)),
        "opt.param_groups[0]['params'][0].grad",
    ),
    "an optimizer's gradient set to None": (
        _with_grads,
        lambda o: setattr(o.param_groups[0]["params"][1], "grad", None),
        "opt.param_groups[0]['params'][1].grad",
    ),
    "a tensor's attribute set": (
        lambda: _attributed(torch.zeros(2)),
        lambda t: setattr(t, "weight", torch.ones(3)),
        "opt.weight",
    ),
    "an object in a set given another tensor": (
        lambda: {"s": {_attributed(Holder())}},
        lambda d: setattr(next(iter(d["s"])), "weight", torch.ones(3)),
        "opt['s']{0}.weight",
    ),
    "a tensor in a frozenset given other memory": (
        lambda: [frozenset([torch.zeros(3)])],
        lambda items: next(iter(items[0])).set_(torch.zeros(7)),
        "opt[0]{0}",
    ),
    "a list subclass's attribute set": (
        lambda: _attributed(_Items([1])),
        lambda items: setattr(items, "weight", torch.ones(3)),
        "opt.weight",
    ),
    "a dict subclass's attribute set": (
        lambda: _attributed(_Entries(a=1)),
        lambda entries: setattr(entries, "weight", torch.ones(3)),
        "opt.weight",
    ),
    "a list subclass's class assigned": (
        lambda: _attributed(_Items([1])),
        lambda items: setattr(items, "__class__", type("Other", (list,), {})),
        "opt (its class)",
    ),
    "a sparse tensor given other memory of its shape": (
        lambda: [torch.randn(3).to_sparse()],
        lambda items: setattr(items[0], "data", torch.randn(3).to_sparse()),
        "opt[0]",
    ),
    "a nested tensor given other sizes": (
        lambda: [torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])],
        lambda items: setattr(items[0], "data", torch.nested.nested_tensor([torch.zeros(4)])),
        "opt[0]",
    ),
}


@pytest.mark.parametrize("name", list(REACHED_CHANGES))
def test_state_reached_past_a_plain_dict_is_seen_by_every_check(name, helper):
    make, change, path = REACHED_CHANGES[name]
    root = make()
    made = all_checks([(root, "opt")], helper)
    assert not any(_answers(made).values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        change(root)
    assert _answers(made) == dict.fromkeys(made, True)
    assert made["python"][0].first_change() == path


def test_a_region_functions_defaults_are_watched(helper):
    """A default argument is read by every call that leaves it out: its object mutated, its
    tensor moved, or the defaults replaced is a change; the function's own globals snapshot
    does not hold them."""
    saved = (_defaulted.__defaults__, _defaulted.__kwdefaults__)
    roots = watch.region_roots(_defaulted, [], "region")
    try:
        made = all_checks(roots, helper)
        assert not any(_answers(made).values())
        _defaulted.__defaults__[0]["scale"] = 2.0
        assert _answers(made) == dict.fromkeys(made, True)
        assert made["python"][0].first_change() == "region.__defaults__[0]['scale']"
        _defaulted.__defaults__[0]["scale"] = 1.0
        assert not any(_answers(made).values())
        _defaulted.__kwdefaults__["w"].set_(torch.zeros(5))
        assert made["python"][0].first_change() == "region.__kwdefaults__['w']"
        made = all_checks(roots, helper)
        _defaulted.__defaults__ = ({"scale": 1.0},)
        assert _answers(made) == dict.fromkeys(made, True)
        assert made["python"][0].first_change() == "region.__defaults__"
        method_roots = watch.region_roots(Holder().__init__, [], "bound")
        assert any(value is Holder.__init__ for value, _ in method_roots)
    finally:
        _defaulted.__defaults__, _defaulted.__kwdefaults__ = saved
