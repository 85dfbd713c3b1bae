"""Two GPUs: per-device jit state, per-device graphs, and replayed regions with NCCL all-reduce.

Runs on a machine with two or more GPUs (marked ``multigpu``); the collective tests spawn one
process per GPU. NVLink multicast stays off (NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1) in every process.
"""

from __future__ import annotations

import os
import random
import socket
import warnings

import pytest
import torch
import torch.multiprocessing as mp

import jitcore as jc
import replay

pytestmark = pytest.mark.multigpu

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

SOURCE = r"""
__global__ void affine(const float* __restrict__ x, float* __restrict__ y, float a, float b, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = a * x[i] + b;
}
"""
affine_kernel = jc.Kernel(SOURCE, "affine")


@jc.jit
def affine(x, y, a, b):
    n = x.numel()
    affine_kernel[jc.cdiv(n, 256), 256](x, y, a, b, n)


def test_each_device_compiles_and_loads_its_own_module():
    spec = affine_kernel.instantiate()
    results = {}
    for device in (0, 1):
        with torch.cuda.device(device):
            x = torch.randn(1000, device=f"cuda:{device}")
            y = torch.full_like(x, float("nan"))
            affine(x, y, 2.0, 1.0)
            torch.cuda.synchronize(device)
            results[device] = torch.equal(y, x * 2.0 + 1.0)
    assert results == {0: True, 1: True}
    states = affine.jit.states
    assert {key[0] for key in states} >= {0, 1}  # the current device is part of every key
    functions = {device: spec.function(device) for device in (0, 1)}
    assert functions[0].handle is not functions[1].handle and functions[1].device == 1


def test_set_device_is_followed():
    torch.cuda.set_device(1)
    try:
        x = torch.randn(64, device="cuda")
        assert x.device.index == 1
        y = torch.empty_like(x)
        affine(x, y, 3.0, 0.0)
        torch.cuda.synchronize()
        assert torch.equal(y, x * 3.0)
    finally:
        torch.cuda.set_device(0)


def test_a_tensor_on_the_other_device_is_refused_before_launch():
    x = torch.randn(64, device="cuda:1")
    with torch.cuda.device(0), pytest.raises(jc.DeviceError, match="cuda:1.*current device cuda:0"):
        affine(x, torch.empty_like(x), 1.0, 0.0)


def region(x):
    y = torch.empty_like(x)
    affine(x, y, 2.0, 0.5)
    return y


def test_one_session_keeps_graphs_per_device():
    with replay.capture(record_after=0) as session:
        step = session.region(region)
        for _ in range(3):
            for device in (0, 1):
                with torch.cuda.device(device):
                    x = torch.randn(256, device=f"cuda:{device}")
                    out = step(x)
                    assert out.device.index == device and torch.equal(out, x * 2.0 + 0.5)
        devices = {entry.key[0] for entry in step.entries.values()}
    assert devices == {0, 1}


# --- collectives: one process per GPU --------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def allreduce_region(x, scale):
    y = torch.empty_like(x)
    affine(x, y, scale, 1.0)
    torch.distributed.all_reduce(y)
    z = torch.empty_like(y)
    affine(y, z, 0.5, 0.0)
    return z


def host_sync_on_rank_zero(x, scale):
    y = torch.empty_like(x)
    affine(x, y, scale, 1.0)
    if torch.distributed.get_rank() == 0 and y[0].item() > 1e30:  # a host sync: this rank cannot capture
        y.zero_()
    torch.distributed.all_reduce(y)
    return y


def _worker(rank: int, port: int, scenario: str, steps: int, queue) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1"
    )
    torch.cuda.set_device(rank)
    torch.distributed.init_process_group("nccl", rank=rank, world_size=2)
    try:
        fn = allreduce_region if scenario == "allreduce" else host_sync_on_rank_zero
        rng = random.Random(7)  # the same batch sizes on both ranks
        generator = torch.Generator(device="cuda").manual_seed(100 + rank)
        mismatches = 0
        with warnings.catch_warnings(record=True) as caught, replay.capture(record_budget=1.0) as session:
            warnings.simplefilter("always")
            step = session.region(fn)
            for number in range(steps):
                batch = rng.choice([1, 3, 8, 64, 100, 257, 512, 1000])
                x = torch.randn(batch, device="cuda", generator=generator)
                scale = 1.0 + number * 1e-3
                expected = fn(x.clone(), scale)
                got = step(x, replay.dynamic(scale))
                mismatches += not torch.equal(got, expected)
            stats = session.stats()
        torch.cuda.synchronize()
        queue.put(
            (
                rank,
                mismatches,
                stats.replays,
                stats.eager_only_keys,
                sum(issubclass(w.category, replay.ReplayWarning) for w in caught),
            )
        )
    except Exception as exc:  # report it instead of hanging the other rank's queue.get
        queue.put((rank, repr(exc), -1, -1, -1))
        raise
    finally:
        torch.distributed.destroy_process_group()


def _run(scenario: str, steps: int) -> dict:
    context = mp.get_context("spawn")
    queue = context.Queue()
    port = _free_port()
    processes = [context.Process(target=_worker, args=(rank, port, scenario, steps, queue)) for rank in (0, 1)]
    for process in processes:
        process.start()
    results = {}
    for _ in processes:
        rank, *rest = queue.get(timeout=600)
        results[rank] = rest
    for process in processes:
        process.join(120)
        assert process.exitcode == 0, results
    return results


def test_a_replayed_region_with_all_reduce_matches_eager_over_500_steps():
    results = _run("allreduce", 500)
    for rank, (mismatches, replays, eager_only, warned) in results.items():
        assert mismatches == 0, f"rank {rank}: {mismatches} steps differ from eager"
        assert replays > 400 and eager_only == 0 and warned == 0


def test_a_rank_whose_capture_fails_runs_eagerly_and_the_other_does_not_hang():
    results = _run("host-sync", 60)
    mismatches0, replays0, eager_only0, warned0 = results[0]
    mismatches1, replays1, eager_only1, _ = results[1]
    assert mismatches0 == mismatches1 == 0
    assert eager_only0 > 0 and warned0 == eager_only0 and replays0 == 0  # rank 0 ran every key eagerly
    assert eager_only1 == 0 and replays1 > 0  # rank 1 replayed graphs holding the same all-reduces
