"""Run the benchmarks, each in a fresh process, then the decode-loop sample.

    python -m benchmarks [--out docs/benchmarks] [--quick] [--only NAME ...]

Writes <name>.json, <name>.md and PNG plots for: launch (host cost of each dispatch path),
jit (cache-hit cost against peers), keys (lean vs full keys), replay (the 32-kernel region),
pool_snapshot (a new shape's recording call with many other blocks alive, beside one whole-allocator snapshot),
scaling (per-step time against region length and distinct shapes; replay host time against
tensor arguments and patched nodes), shapes (replay under shape distributions: uniform, Zipf,
fixed, prefill), triton_region (triton.md: Triton kernels rebound against staged and eager;
skipped without Triton), hf (a Llama decode loop with a StaticCache, the cache passed as an
argument and closed over, beside eager, a static CUDA graph and torch.compile; skipped without
transformers), decode_loop (the sample at 400 and 2,000 steps against eager, recordings
included, and its ceiling once every size is recorded) and, with two GPUs, decode_loop_tp2.md
(the tensor-parallel sample). These
need a GPU (keys runs on CPU tensors without one) and are the default; jit_cpu (the jit's
Python-side cost with the driver call a no-op), recording_cpu (a recording's host steps besides
the driver), watch (the check of what a region reaches through its globals and objects, for
10, 100 and 1,000 watched tensors; with a GPU, the replay's host time with and without it) and
object_calls (the host path of a call passing an object: its memo, the full path) run on any
machine, with ``--only jit_cpu recording_cpu watch object_calls``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks import common

GPU_BENCHMARKS = ["launch", "jit", "keys", "replay", "pool_snapshot", "scaling", "shapes", "triton_region", "hf"]
CPU_BENCHMARKS = ["jit_cpu", "recording_cpu", "watch", "object_calls"]
SAMPLE = "decode_loop"


def main() -> int:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--only",
        nargs="+",
        choices=[*GPU_BENCHMARKS, *CPU_BENCHMARKS, SAMPLE],
        default=[*GPU_BENCHMARKS, SAMPLE],
        help="run only these (decode_loop is the sample, with its tensor-parallel run on two GPUs)",
    )
    args = parser.parse_args()
    extra = ["--out", str(args.out)] + (["--quick"] if args.quick else [])
    args.out.mkdir(parents=True, exist_ok=True)
    names = [name for name in (*GPU_BENCHMARKS, *CPU_BENCHMARKS) if name in args.only]
    failed = [name for name in names if _run_benchmark(name, extra)]
    if SAMPLE in args.only:
        failed += _run_sample(args, extra)
    if failed:
        print(f"failed: {', '.join(failed)}")
    return 1 if failed else 0


def _run_benchmark(name: str, extra: list[str]) -> bool:
    """Each benchmark in a fresh process, so one's warm caches and allocator state don't help another."""
    print(f"== {name}", flush=True)
    return subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *extra]).returncode != 0


def _run_sample(args: argparse.Namespace, extra: list[str]) -> list[str]:
    """The sample on one GPU (benchmarks/decode_loop.py: its default length and longer, beside
    its ceiling), then tensor parallel over two where two GPUs and torchrun exist."""
    failed = ["decode_loop"] if _run_benchmark("decode_loop", extra) else []
    torchrun = shutil.which("torchrun")
    if torch.cuda.device_count() >= 2 and torchrun:
        flags = ["--steps", "100" if args.quick else "1000", "--no-progress"]
        launcher = ["torchrun", "--nproc-per-node", "2"]
        title = "Decode-loop sample, tensor parallel over 2 GPUs"
        if _sample_run(args.out, "decode_loop_tp2", title, launcher, ["--tp", "2", *flags]):
            failed.append("decode_loop_tp2")
    return failed


def _sample_run(out: Path, name: str, title: str, launcher: list[str], flags: list[str]) -> bool:
    """Run the sample once and write its report to <name>.md; True when it failed."""
    print(f"== {title}", flush=True)
    sample = common.ROOT / "samples" / "decode_loop.py"
    executable = sys.executable if launcher == ["python"] else shutil.which(launcher[0])
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    done = subprocess.run([executable, *launcher[1:], str(sample), *flags], capture_output=True, text=True, env=env)
    print(done.stdout + done.stderr)
    # the report; its error output too when it failed, so a failed run isn't an empty block
    shown = (done.stdout if done.returncode == 0 else done.stdout + done.stderr).strip()
    command = " ".join([*launcher, "samples/decode_loop.py", *flags])
    (out / f"{name}.md").write_text(
        f"# {title}\n\nCommand: `{command}` (run by `{common.command_line()}`)\n\n"
        f"Machine: {common.machine()}\n\n```\n{shown}\n```\n"
    )
    return done.returncode != 0


if __name__ == "__main__":
    sys.exit(main())
