"""The watch of what a region reaches: host time per check on any machine, per replay on a GPU.

What a region reaches through its globals, closures and objects is checked on every call that
may replay (replay.watch): every dict, list and object that holds what it reads, and every
tensor among them. This times that check for 10, 100 and 1,000 watched tensors, held three
ways: transformer layers as Hugging Face's Llama holds them (attention and MLP projections
without bias and two norms: 9 tensors and 12 modules a layer), ``nn.Linear`` layers with bias
in an ``nn.Sequential`` (2 tensors a module), and a list of tensors. Each way of making the
check is timed, round robin:

- ``C``: csrc/replay_checks.c's WatchCheck with the torch-side helper, as replays run it (dicts
  skipped by their version tags or the dict watcher epoch, as the interpreter allows);
- ``C, every dict walked``: the same with neither (what CPython 3.13+ pays for objects' dicts);
- ``C, no torch-side helper``: tensors compared through torch's Python API;
- ``Python``: the program's own check (``JITCORE_NATIVE=0``, no compiler);
- ``C, dicts skipped`` (measurement only): the cost while the dict watcher epoch of CPython 3.12
  says that no watched dict changed (it skips them all), on an interpreter that has no epoch;
- ``C, without the module registries`` (measurement only, not exact): the parameters, buffers
  and submodules dicts left out, what an epoch bumped by torch's module registration hooks
  could save if it replaced polling them (it cannot: ``del module.weight``, ``_apply`` under
  ``torch.__future__.set_overwrite_module_params_on_conversion``, accelerate's device-map
  writes and other direct writes into those dicts reach no hook).

With a GPU, also the host time per replay of a region that closes over the same state and
runs one small op (its first layer's projection, or an add), with the watch and with it
skipped (measurement only), round robin.
"""

from __future__ import annotations

import functools

import attrs
import torch

import replay
from benchmarks import common
from jitcore import torch_native
from replay import watch

TENSOR_COUNTS = (10, 100, 1000)
WIDTH = 16


class Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4)
        )


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = (torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(3))


class Layer(torch.nn.Module):
    """A Llama decoder layer's modules and tensors (9 tensors, 12 modules with its own)."""

    def __init__(self):
        super().__init__()
        self.self_attn, self.mlp = Attention(), MLP()
        self.input_layernorm, self.post_attention_layernorm = torch.nn.RMSNorm(WIDTH), torch.nn.RMSNorm(WIDTH)


def held(kind: str, tensors: int, device: str) -> object:
    """About ``tensors`` tensors held the way ``kind`` says."""
    if kind == "transformer layers":
        return torch.nn.ModuleList(Layer() for _ in range(max(1, round(tensors / 9)))).to(device)
    if kind == "Linear layers with bias":
        return torch.nn.Sequential(*(torch.nn.Linear(WIDTH, WIDTH) for _ in range(tensors // 2))).to(device)
    return [torch.randn(WIDTH, device=device) for _ in range(tensors)]


KINDS = ("transformer layers", "Linear layers with bias", "a list of tensors")


def without_registries(program: watch.WatchProgram) -> watch.WatchProgram:
    """The program without the modules' parameters, buffers and submodules dicts (measurement only)."""
    keep = [i for i, (_, role) in enumerate(program.dict_paths) if role != watch.REGISTRY]
    fields = ("dicts", "dict_keys", "dict_values", "dict_paths")
    return attrs.evolve(program, **{f: tuple(getattr(program, f)[i] for i in keep) for f in fields})


def without_dicts(program: watch.WatchProgram) -> watch.WatchProgram:
    """The program without its dicts (measurement only): what a check costs while CPython 3.12's
    dict watcher epoch says that none changed (it skips them all)."""
    return attrs.evolve(program, dicts=(), dict_keys=(), dict_values=(), dict_paths=())


def checks(state: object, helper: object | None) -> tuple[dict[str, object], dict[str, object]]:
    """The ways of making the check of ``state``: those in C that read tensors through the
    helper, and those that compare them in Python (timed apart: a loop of the slow ones would
    leave the fast ones' memory cold)."""
    program = watch.build([(state, "state")], helper)
    fast, slow = {}, {"Python": watch.python_check(program)}
    if watch.native_enabled() and helper is not None:
        fast["C"] = watch.watch_check(program)
        fast["C, every dict walked"] = watch.watch_check(program, tags=False)
        fast["C, without the module registries"] = watch.watch_check(without_registries(program))
        fast["C, dicts skipped"] = watch.watch_check(without_dicts(program))
        slow["C, no torch-side helper"] = watch.watch_check(watch.build([(state, "state")], None))
    for check in (*fast.values(), *slow.values()):
        assert check() is False
    return fast, slow


def check_rows(quick: bool) -> tuple[list, dict]:
    helper = torch_native.module()
    rows, results = [], {}
    repeats = 3 if quick else 15
    for kind in KINDS:
        for count in TENSOR_COUNTS:
            state = held(kind, count, "cpu")
            program = watch.build([(state, "state")], helper)
            fast, slow = checks(state, helper)
            timed = common.compare(fast, calls=max(100, 200000 // count) // (10 if quick else 1), repeats=repeats)
            timed.update(common.compare(slow, calls=max(5, 2000 // count), repeats=repeats, warmup=5))
            tensors = len(program.tensors)
            for name, timing in timed.items():
                us = timing["median_us"]
                results[f"{kind}, {tensors} tensors, {name}"] = {**timing, "tensors": tensors, "values": program.values}
                row = [kind, tensors, len(program.objects), len(program.dicts), name, us, us * 100 / tensors]
                rows.append(row)
    return rows, results


def _nothing_changed() -> bool:
    return False


class WatchSwitch:
    """Turns a region's watch off and on again (measurement only): the call the region's globals
    checks make answers "nothing changed" while it is off."""

    def __init__(self, region) -> None:
        self.namespaces = [region.snapshot.namespace, region.program.region_drift.__globals__]
        self.check = self.namespaces[0]["_rwatch"]

    def off(self) -> None:
        for namespace in self.namespaces:
            namespace["_rwatch"] = _nothing_changed

    def on(self) -> None:
        for namespace in self.namespaces:
            namespace["_rwatch"] = self.check


def one_op_region(kind: str, state: object):
    """A region that closes over ``state`` and runs one small op of it."""
    if kind == "transformer layers":
        return lambda x: state[0].mlp.down_proj(x)
    if kind == "Linear layers with bias":
        return lambda x: state[0](x)
    return lambda x: x + state[0]


def replay_rows(quick: bool) -> tuple[list, dict]:
    rows, results = [], {}
    for kind in KINDS:
        for count in TENSOR_COUNTS:
            state = held(kind, count, "cuda")
            x = torch.randn(WIDTH, device="cuda")
            with torch.no_grad(), replay.capture() as session:
                region = session.region(one_op_region(kind, state))
                for _ in range(4):
                    region(x)
                assert session.stats().replays >= 2, "the region does not replay"
                switch = WatchSwitch(region)
                timed = common.compare(
                    {"with the watch": functools.partial(region, x), "watch skipped": functools.partial(region, x)},
                    calls=200 if quick else 2000,
                    repeats=3 if quick else 15,
                    sync=torch.cuda.synchronize,
                    setups={"with the watch": switch.on, "watch skipped": switch.off},
                )
                switch.on()
            tensors = len(region.snapshot.watch.tensors)
            for name, timing in timed.items():
                results[f"{kind}, {tensors} tensors, replay {name}"] = {**timing, "tensors": tensors}
            rows.append([kind, tensors, timed["with the watch"]["median_us"], timed["watch skipped"]["median_us"]])
    return rows, results


def main() -> None:
    args = common.parser(__doc__.splitlines()[0]).parse_args()
    rows, results = check_rows(args.quick)
    body = "Host time of one check (median of round-robin loops), and per 100 watched tensors:\n\n"
    body += common.markdown_table(
        ["held as", "tensors", "objects", "dicts", "check", "us per check", "us per 100 tensors"], rows
    )
    if torch.cuda.is_available():
        replays, replay_results = replay_rows(args.quick)
        results.update(replay_results)
        body += "\n\nHost time per replay of a one-op region that closes over the state (us):\n\n"
        body += common.markdown_table(["held as", "tensors", "with the watch", "watch skipped"], replays)
    else:
        body += "\n\nNo GPU here: the replay rows are measured where one is."
    common.write(args.out, "watch", "The watch of what a region reaches", results, body)


if __name__ == "__main__":
    main()
