"""The benchmarks (benchmarks/, in a checkout only): one runner, public API only, not shipped.

The GPU benchmarks run on the GPU machine (docs/benchmarks/README.md); here the runner runs
the CPU ones in their smoke-test form, and every benchmark module is checked to reach jitcore
and replay only through their public names and the driver interface.
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

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = sorted((ROOT / "benchmarks").glob("*.py"))
PUBLIC = {"jitcore": set(jitcore.__all__), "replay": set(replay.__all__)}
#: Modules besides the two packages themselves: the driver interface (selection, the parameter
#: buffer a raw launch is given) and the documented driver stand-in.
DRIVER_INTERFACE = {"jitcore.backends", "jitcore.backends.abi", "jitcore.backends.null"}


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
        and name.partition(".")[2] not in PUBLIC[name.partition(".")[0]]
    ]
    assert internal == [], f"{path.name} uses internals: {internal}"


def test_the_runner_runs_the_cpu_benchmarks_and_each_table_names_its_command(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--only", "keys", "jit_cpu", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    keys_table = "keys-cuda" if torch.cuda.is_available() else "keys"  # keys.py names its table by device
    for table, name in ((keys_table, "keys"), ("jit-cpu", "jit_cpu")):
        command = f"python -m benchmarks --only {name} --out {tmp_path} --quick"
        assert json.loads((tmp_path / f"{table}.json").read_text())["command"] == command
        assert f"Command: `{command}`" in (tmp_path / f"{table}.md").read_text()


def test_the_committed_results_name_the_runner():
    results = ROOT / "docs" / "benchmarks"
    commands = [json.loads(path.read_text())["command"] for path in results.glob("*.json")]
    lines = [line for path in results.glob("*.md") for line in path.read_text().splitlines()]
    commands += [line for line in lines if line.startswith("Command:")]
    assert commands and all("python -m benchmarks " in command for command in commands)
