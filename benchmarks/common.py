"""Shared benchmark plumbing: timing loops, machine description, result files."""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

#: The checkout the benchmarks run in (they read its samples/ and write its docs/).
ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "docs" / "benchmarks"
#: The one command that runs benchmarks; results name it, with the arguments that make them.
RUNNER = "python -m benchmarks"


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="directory for the .json/.md/.png results")
    p.add_argument("--quick", action="store_true", help="fewer repetitions (smoke test, not for publishing)")
    return p


def command_line() -> str:
    """The runner command that makes this run's results: in a benchmark's own process (the
    runner starts each as ``benchmarks.NAME``), the runner with ``--only NAME``, so a table
    names the command that makes it alone; in the runner, the runner as it was called."""
    spec = sys.modules["__main__"].__spec__
    module = spec.name.removesuffix(".__main__") if spec else ""
    only = ["--only", module.removeprefix("benchmarks.")] if module.startswith("benchmarks.") else []
    return " ".join([RUNNER, *only, *sys.argv[1:]])


def machine() -> dict[str, object]:
    info: dict[str, object] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name()
            info["gpus"] = torch.cuda.device_count()
    except Exception:
        pass
    for package in ("cuda-bindings", "hip-python"):
        try:
            info[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return info


def per_call_us(fn: Callable[[], object], calls: int, sync: Callable[[], object] | None = None) -> float:
    """Host microseconds per call over one loop of ``calls`` calls (sync before timing)."""
    if sync:
        sync()
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter_ns() - start
    if sync:
        sync()
    return elapsed / calls / 1000.0


def _nothing() -> None:
    pass


def compare(
    paths: dict[str, Callable[[], object]],
    *,
    calls: int,
    repeats: int,
    warmup: int = 200,
    sync: Callable[[], object] | None = None,
    setups: dict[str, Callable[[], object]] | None = None,
) -> dict[str, dict[str, float]]:
    """Time every path in round-robin order (so drift of a noisy machine hits all alike) and
    report the median, min and max of the per-loop means, in microseconds per call.
    ``setups[name]``, where given, runs (untimed) before each warm-up and timed loop of that
    path: process-wide switches two paths differ in."""
    setups = setups or {}
    for name, fn in paths.items():
        setups.get(name, _nothing)()
        for _ in range(warmup):
            fn()
    samples: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(repeats):
        for name, fn in paths.items():
            setups.get(name, _nothing)()
            samples[name].append(per_call_us(fn, calls, sync))
    return {
        name: {"median_us": statistics.median(s), "min_us": min(s), "max_us": max(s), "loops": len(s), "calls": calls}
        for name, s in samples.items()
    }


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write(out: Path, name: str, title: str, results: dict, body: str, notes: str = "") -> None:
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": command_line(), "machine": machine(), "results": results}
    (out / f"{name}.json").write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    text = markdown(record, title, body, notes)
    (out / f"{name}.md").write_text(text)
    print(text)


def markdown(record: dict, title: str, body: str, notes: str = "") -> str:
    """The markdown page of a results record (as :func:`write` saves it: its command and
    machine come from the record, so a page can be made again from a saved JSON)."""
    info = record["machine"]
    where = ", ".join(f"{k} {info[k]}" for k in ("gpu", "torch", "cuda-bindings", "python", "processor") if k in info)
    text = f"# {title}\n\nCommand: `{record['command']}`\n\nMachine: {where}; measured {info['date']}.\n\n{body}\n"
    if notes:
        text += f"\n{notes.strip()}\n"
    return text


def plot(
    out: Path,
    name: str,
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, tuple[list, list]],
    *,
    logx: bool = False,
    logy: bool = False,
    bars: bool = False,
) -> None:
    """A PNG next to the results (skipped, with a message, where matplotlib is missing)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not installed: {name}.png not written (pip install 'jitreplay[bench]')")
        return
    figure, axes = plt.subplots(figsize=(7, 4.2))
    if bars:
        labels = list(series)
        values = [series[label][1][0] for label in labels]
        axes.barh(labels, values, color="#4c72b0")
        axes.invert_yaxis()
        for y, value in enumerate(values):
            axes.text(value, y, f" {value:.1f}", va="center", fontsize=8)
    else:
        for label, (xs, ys) in series.items():
            axes.plot(xs, ys, marker="o", label=label)
        axes.legend()
    if logx:
        axes.set_xscale("log", base=2)
    if logy:
        axes.set_yscale("log")
    axes.set_title(title)
    axes.set_xlabel(xlabel)
    axes.set_ylabel(ylabel)
    axes.grid(True, alpha=0.3)
    figure.tight_layout()
    figure.savefig(out / f"{name}.png", dpi=120)
    plt.close(figure)
