"""The benchmarks (benchmarks/, in a checkout only): one runner, public API only, not shipped.

The GPU benchmarks run on the GPU machine (docs/benchmarks/README.md); here the runner runs
the CPU ones in their smoke-test form, and every benchmark module is checked to reach jitcore
and replay only through their public names, the driver interface and replay's measurement hooks.
"""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest
import setuptools
import torch

import jitcore
import replay
from benchmarks import common
from tests.jitcore.fakes import ListRecorder

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "benchmarks").glob("*.py"))
PUBLIC = {"jitcore": set(jitcore.__all__), "replay": set(replay.__all__)}
#: Modules besides the two packages themselves: the driver interface (selection, the parameter
#: buffer a raw launch is given) and the documented driver stand-in.
DRIVER_INTERFACE = {"jitcore.backends", "jitcore.backends.abi", "jitcore.backends.null"}
#: replay's measurement hooks, which only benchmarks turn on, a recording's host steps run one
#: by one (benchmarks/recording_cpu.py), and the watch, whose check benchmarks/watch.py times
#: made each way (replay.watch.watch_check).
MEASUREMENT = {"replay.instrumentation", "replay.recording_steps", "replay.watch"}


def test_the_benchmarks_are_not_part_of_the_installed_packages():
    tomllib = pytest.importorskip("tomllib")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = config["tool"]["setuptools"]["packages"]["find"]["include"]
    shipped = setuptools.find_packages(where=str(ROOT), include=include)
    assert shipped and all(name.partition(".")[0] in ("jitcore", "replay") for name in shipped)
    assert not any("bench" in name for name in shipped)


@pytest.mark.parametrize("path", MODULES, ids=lambda path: path.name)
def test_benchmarks_reach_jitcore_and_replay_only_through_public_names(path):
    tree = ast.parse(path.read_text())
    aliases, used = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for name in node.names:
                top = name.name.partition(".")[0]
                if top in PUBLIC:
                    used.append(name.name)
                    aliases[name.asname or top] = top
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.partition(".")[0] in PUBLIC:
            used.append(node.module)
            if node.module in PUBLIC:
                used += [f"{node.module}.{name.name}" for name in node.names]
    for node in ast.walk(tree):  # jc.NAME, replay.NAME
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            used.append(f"{aliases[node.value.id]}.{node.attr}")
    internal = [
        name
        for name in used
        if name not in PUBLIC
        and name not in DRIVER_INTERFACE
        and name not in MEASUREMENT
        and name.partition(".")[2] not in PUBLIC[name.partition(".")[0]]
    ]
    assert internal == [], f"{path.name} uses internals: {internal}"


def test_the_runner_runs_the_cpu_benchmarks_and_each_table_names_its_command(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks",
            "--only",
            "keys",
            "jit_cpu",
            "recording_cpu",
            "object_calls",
            "--quick",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    keys_table = "keys-cuda" if torch.cuda.is_available() else "keys"  # keys.py names its table by device
    tables = ((keys_table, "keys"), ("jit-cpu", "jit_cpu"), ("recording-cpu", "recording_cpu"))
    for table, name in (*tables, ("object-calls-cpu", "object_calls")):
        command = f"python -m benchmarks --only {name} --out {tmp_path} --quick"
        assert json.loads((tmp_path / f"{table}.json").read_text())["command"] == command
        assert f"Command: `{command}`" in (tmp_path / f"{table}.md").read_text()


def test_the_committed_results_name_the_runner():
    results = ROOT / "docs" / "benchmarks"
    commands = [json.loads(path.read_text())["command"] for path in results.glob("*.json")]
    lines = [line for path in results.glob("*.md") for line in path.read_text().splitlines()]
    commands += [line for line in lines if line.startswith("Command:")]
    assert commands and all("python -m benchmarks " in command for command in commands)


@pytest.mark.parametrize(("arguments", "patched"), [(4, 8), (16, 8), (64, 1), (4, 0), (1, 32)])
def test_scaling_grid_cells_read_the_arguments_their_plan_says(arguments, patched):
    """A cell of the argument x patched-node table, built and run on the CPU under the null
    backend (nothing compiles or launches): 32 jit kernels, kernels 0 to P-1 reading region
    arguments as planned (each argument by one kernel when A >= P), the others only the
    previous kernel's output."""
    from benchmarks import scaling
    from jitcore.backends import use_backend
    from jitcore.backends.null import NullBackend

    cell = scaling.Cell(arguments, patched)
    assert len(cell.reads) == scaling.KERNELS_PER_CELL == 32
    assert all(cell.reads[k] for k in range(patched)) and not any(cell.reads[patched:])
    if arguments >= patched > 0:  # every argument feeds exactly one node
        assert sorted(i for read in cell.reads for i in read) == list(range(arguments))
    assert cell.rebound_pointers == (max(arguments, patched) if patched else 0)
    launches = ListRecorder()
    with use_backend(NullBackend()):
        xs = cell.inputs("cpu")
        cell.region(*xs)  # the jit's misses, outside the recorder
        with jitcore.recorder.recording(launches):
            out = cell.region(*xs)
    assert len(launches.records) == 32
    previous = None
    for k, record in enumerate(launches.records):
        read = [record.args[p.arg_index] for p in record.params if p.kind == "pointer" and p.read_only]
        written = [record.args[p.arg_index] for p in record.params if p.kind == "pointer" and not p.read_only]
        chained = read[:1] if k else []
        assert [t is previous for t in chained] == [True] * len(chained)
        arguments_read = [next(i for i, x in enumerate(xs) if x is t) for t in read[len(chained) :]]
        assert tuple(arguments_read) == cell.reads[k], k
        assert len(written) == 1 and not any(written[0] is x for x in xs)
        previous = written[0]
    assert out is previous


def test_scaling_grid_report_reads_slopes_from_the_numbers():
    from benchmarks import scaling

    def cell(a, p):
        paths = {"replay": 5 + 0.25 * a + 0.5 * p, "torch CUDAGraph.replay": 2.0, "raw graph launch": 1.5}
        result = {name: {"host_us": host, "end_to_end_us": 40.0} for name, host in paths.items()}
        return {**result, "patches_per_step": float(p), "rebound_pointers": max(a, p) if p else 0}

    grid = {a: {p: cell(a, p) for p in scaling.PATCHED} for a in scaling.ARGUMENTS}
    body, summary = scaling.grid_report(grid)
    assert summary["us_per_argument_at_patched"] == pytest.approx({p: 0.25 for p in scaling.PATCHED})
    assert summary["us_per_patched_node_at_arguments"] == pytest.approx({a: 0.5 for a in scaling.ARGUMENTS})
    assert "| 64 | 21.000 | 21.500 | 25.000 | 37.000 |" in body  # host us/step, row A=64
    assert "| 1 | 2.625 |" in body  # the ratio to torch's replay
    assert "grows most with arguments" in body
    with pytest.raises(ValueError):
        scaling.plan(0, 1)


def test_compare_runs_each_paths_setup_before_its_warm_up_and_every_loop():
    log = []
    common.compare(
        {"a": lambda: log.append("a"), "b": lambda: log.append("b")},
        calls=2,
        repeats=3,
        warmup=1,
        setups={"a": lambda: log.append("setup a")},
    )
    assert log.count("setup a") == 4 and log[0] == "setup a" and "setup b" not in log
    assert all(log[i + 1] == "a" for i, entry in enumerate(log) if entry == "setup a")


def test_the_recording_call_in_parts_sets_each_step_beside_its_raw_counterpart():
    from benchmarks import replay as replay_benchmark

    shapes = [1, 2, 4]
    steps = {name: [10.0 * (k + 1)] * len(shapes) for k, name in enumerate(replay_benchmark.RECORDING_CALL_STEPS)}
    first = {b: 500.0 for b in shapes}
    outside = [first[b] - sum(values[i] for values in steps.values()) for i, b in enumerate(shapes)]
    raw_capture, raw_region, raw_first_launch = (
        {b: 200.0 for b in shapes},
        {b: 80.0 for b in shapes},
        dict.fromkeys(shapes, 30.0),
    )
    body = replay_benchmark.recording_parts(first, steps, outside, raw_capture, raw_region, raw_first_launch)
    # region 20 against raw's 80; begin/checks/end 30 + instantiate 70 against raw's 200 - 80
    assert (
        "| region under capture (the jit's launch reports and the torch-op observer inside) | 20.000 | 80.000 |" in body
    )
    assert "| 100.000 | 120.000 |" in body
    assert "| pool snapshot (no raw counterpart) | 40.000 | 0.000 |" in body
    # outside: 500 - 280; the call against raw capture + first launch
    assert "| 220.000 | 30.000 |" in body
    assert "| the call | 500.000 | 230.000 |" in body
    # prepare 10 + pool snapshot 40 + own outputs 50 + extents and records 60 = 160 = 0.80x raw;
    # the region 60 us less than raw's; 2 x 200 - 230 = 170 left
    assert "cost 160 us, 0.80x the raw capture" in body
    assert "-60 us more than raw's" in body
    assert "(at most 2x the raw capture, 400 us) 170 us for them all" in body


def test_the_targets_are_stated_against_the_exact_floor():
    """The replay benchmark's floor sentence and fields: what each target leaves above the
    driver work an exact recording cannot leave out, and what the host steps spend now."""
    from benchmarks import replay as replay_benchmark

    floor = {1: (300.0, 100.0), 2: (300.0, 100.0)}  # (recording call, second call) per shape
    text, fields = replay_benchmark.floor_report(250.0, floor, {1: 900.0, 2: 900.0}, {1: 600.0, 2: 600.0})
    assert fields["exact_floor_us"] == {1: 300.0, 2: 300.0} and fields["exact_floor_second_call_us"][2] == 100.0
    assert fields["exact_floor_ratio"] == pytest.approx(1.2)
    assert fields["exact_floor_two_calls_ratio"] == pytest.approx(1.6)
    assert fields["first_target_left_above_floor_us"] == pytest.approx(200.0)  # 2 x 250 - 300
    assert fields["two_calls_target_left_above_floor_us"] == pytest.approx(350.0)  # 3 x 250 - 400
    assert fields["in_session_first_above_floor_us"] == pytest.approx(600.0)
    assert fields["in_session_two_calls_above_floor_us"] == pytest.approx(1100.0)
    assert fields["targets_against_floor"] == text
    assert "costs 300 us, **1.20x** the raw capture: the 2x target leaves 200 us" in text
    assert "which spend 600 us now" in text and "the floor is 400 us, **1.60x**" in text
    assert "the 3x target leaves 350 us" in text and "which spend 1100 us now" in text


def test_the_hf_benchmark_runs_its_logic_on_the_cpu_with_a_tiny_model(tmp_path):
    """benchmarks/hf.py --dry: a tiny Llama on the CPU, a few steps, every path (those that
    need a GPU say so); the results hold the rows the GPU run commits."""
    pytest.importorskip("transformers")
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.hf", "--dry", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((tmp_path / "hf-dry.json").read_text())["results"]
    assert results["dry"] is True and set(results["by_batch"]) == {"1", "2"}
    for batch in results["by_batch"].values():
        assert batch["eager"]["replay_over_eager"] == 1.0
        for name in ("replay, cache as argument", "replay, cache in a closure"):
            row = batch[name]
            assert row["bitwise"] is True and row["tokens_per_s"] > 0 and row["replay_over_eager"] > 0
        assert "skipped" in batch["static-copy CUDA graph"] and "skipped" in batch["torch.compile (reduce-overhead)"]
    assert results["replay, cache as argument"]["bitwise"] is True
    assert "| 2 | replay, cache as argument |" in (tmp_path / "hf-dry.md").read_text()


def test_the_hf_benchmark_is_one_line_without_transformers(tmp_path):
    """Without transformers (hidden from the child process), one line and a clean exit."""
    script = (
        "import sys; sys.modules['transformers'] = None; import runpy; "
        f"sys.argv = ['hf', '--dry', '--out', {str(tmp_path)!r}]; "
        "runpy.run_module('benchmarks.hf', run_name='__main__')"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "transformers is not installed (pip install 'jitreplay[hf]'): skipped"
    assert not list(tmp_path.iterdir())
