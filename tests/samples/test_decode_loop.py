"""The decode-loop sample: argument checks and the no-GPU exit everywhere, the real run on a GPU."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

from tests.test_docs import readme_command

ROOT = pathlib.Path(__file__).resolve().parents[2]
SAMPLE = ROOT / "samples" / "decode_loop.py"


def load():
    if "decode_loop" not in sys.modules:
        spec = importlib.util.spec_from_file_location("decode_loop", SAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["decode_loop"] = module  # dataclasses look their module up here
        spec.loader.exec_module(module)
    return sys.modules["decode_loop"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--steps", "0"], "--steps must be at least 1"),
        (["--dim", "100", "--heads", "8"], "even head size"),
        (["--eager-only", "--replay-only"], "not allowed with"),
        (["--layers", "x"], "invalid int value"),
    ],
)
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        load().main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_without_a_gpu_it_says_so_in_one_line_and_exits_non_zero():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    done = subprocess.run(
        [sys.executable, str(SAMPLE)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "needs a CUDA or ROCm GPU" in lines[0]
    assert lines[0].endswith(f"run the tests: {readme_command('Run the tests')}")


def test_the_no_gpu_message_quotes_the_readmes_test_command():
    assert load().TEST_COMMAND == readme_command("Run the tests")


def test_the_readme_runs_this_sample():
    assert readme_command("Run the sample").endswith("python samples/decode_loop.py")


def test_the_request_stream_changes_batch_size_within_bounds():
    stream = load().request_stream(200, 16, 64, 1024, seed=3)
    sizes = [len(tokens) for _pos, tokens in stream]
    assert min(sizes) >= 1 and max(sizes) <= 16 and len(set(sizes)) > 4
    assert [pos for pos, _ in stream][:3] == [0, 1, 2] and stream[64][0] == 0
    assert stream == load().request_stream(200, 16, 64, 1024, seed=3)


@pytest.mark.gpu
def test_the_sample_runs_end_to_end_and_replay_matches_eager(capsys):
    status = load().main(["--steps", "60", "--layers", "2", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "bit for bit" in out and "speedup" in out and "replay session report" in out


@pytest.mark.multigpu
def test_tensor_parallel_sample_matches_the_single_gpu_run():
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not on the PATH")
    env = dict(os.environ, PYTHONPATH=str(ROOT), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1")
    done = subprocess.run(
        [
            torchrun,
            "--nproc-per-node",
            "2",
            str(SAMPLE),
            "--tp",
            "2",
            "--steps",
            "40",
            "--layers",
            "2",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "tensor parallel vs single GPU" in done.stdout and "bit for bit" in done.stdout
