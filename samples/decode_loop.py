"""A small transformer decode loop: jitcore kernels, run eagerly and under replay.capture().

Each step takes one token per active request (the batch size changes from step to step as
requests come and go), runs a 4-layer decoder (embedding lookup, RMSNorm, QKV projection with
torch matmul, rotary embedding, single-query attention over a KV cache, MLP with a fused SiLU,
residuals) and returns logits. The same token stream runs twice: eagerly, then under
``capture()``; the logits must match bit for bit, and the run prints tokens/s for both.

    python samples/decode_loop.py                       # one GPU
    torchrun --nproc-per-node 2 samples/decode_loop.py --tp 2   # tensor parallel over two GPUs

With ``--tp 2`` attention heads and the MLP are split across ranks (column-parallel in,
row-parallel out, an all-reduce after each); each rank also runs the single-GPU model and
checks the tensor-parallel logits against it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

import jitcore as jc
import replay

#: The README's test command, quoted where no GPU is visible (tests/samples checks they are equal).
TEST_COMMAND = "pip install -e '.[cuda,test]' && python -m jitcore.torch_native --if-possible && python -m pytest -q"

SOURCE = r"""
__global__ void embed(const long long* __restrict__ tokens, const float* __restrict__ table,
                      float* __restrict__ out, int dim) {
    int b = blockIdx.x;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) out[b * dim + d] = table[tokens[b] * dim + d];
}

template <int BLOCK>
__global__ void rmsnorm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ out,
                        int dim, float eps) {
    __shared__ float partial[BLOCK];
    const float* row = x + (long long)blockIdx.x * dim;
    float acc = 0.f;
    for (int d = threadIdx.x; d < dim; d += BLOCK) acc += row[d] * row[d];
    partial[threadIdx.x] = acc;
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) partial[threadIdx.x] += partial[threadIdx.x + s];
        __syncthreads();
    }
    float scale = rsqrtf(partial[0] / dim + eps);
    for (int d = threadIdx.x; d < dim; d += BLOCK) out[(long long)blockIdx.x * dim + d] = row[d] * scale * w[d];
}

// qkv: [batch, 3, heads, head_dim]; rotates q and k in place for position pos
__global__ void rope(float* __restrict__ qkv, int heads, int head_dim, int pos, float theta) {
    int b = blockIdx.x, h = blockIdx.y, i = threadIdx.x;  // i < head_dim / 2
    if (i >= head_dim / 2) return;
    float angle = pos * powf(theta, -2.0f * i / head_dim);
    float c = cosf(angle), s = sinf(angle);
    for (int which = 0; which < 2; ++which) {
        float* v = qkv + (((long long)b * 3 + which) * heads + h) * head_dim;
        float a = v[2 * i], bb = v[2 * i + 1];
        v[2 * i] = a * c - bb * s;
        v[2 * i + 1] = a * s + bb * c;
    }
}

// cache: [max_batch, heads, max_len, head_dim]; writes k and v of this step at pos
__global__ void kv_write(const float* __restrict__ qkv, float* __restrict__ cache_k, float* __restrict__ cache_v,
                         int heads, int head_dim, int max_len, int pos) {
    int b = blockIdx.x, h = blockIdx.y, d = threadIdx.x;
    if (d >= head_dim) return;
    long long at = (((long long)b * heads + h) * max_len + pos) * head_dim + d;
    cache_k[at] = qkv[(((long long)b * 3 + 1) * heads + h) * head_dim + d];
    cache_v[at] = qkv[(((long long)b * 3 + 2) * heads + h) * head_dim + d];
}

// one block per (request, head): softmax(q . K[:len]) V[:len]
template <int MAX_LEN>
__global__ void attend(const float* __restrict__ qkv, const float* __restrict__ cache_k,
                       const float* __restrict__ cache_v, float* __restrict__ out, int heads, int head_dim,
                       int max_len, int length, float scale) {
    __shared__ float score[MAX_LEN];
    __shared__ float reduce[128];
    int b = blockIdx.x, h = blockIdx.y;
    const float* q = qkv + (((long long)b * 3) * heads + h) * head_dim;
    const float* keys = cache_k + ((long long)b * heads + h) * max_len * head_dim;
    const float* values = cache_v + ((long long)b * heads + h) * max_len * head_dim;
    float best = -3.0e38f;
    for (int t = threadIdx.x; t < length; t += blockDim.x) {
        float dot = 0.f;
        for (int d = 0; d < head_dim; ++d) dot += q[d] * keys[(long long)t * head_dim + d];
        score[t] = dot * scale;
        best = fmaxf(best, score[t]);
    }
    reduce[threadIdx.x] = best;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) reduce[threadIdx.x] = fmaxf(reduce[threadIdx.x], reduce[threadIdx.x + s]);
        __syncthreads();
    }
    best = reduce[0];
    __syncthreads();
    float total = 0.f;
    for (int t = threadIdx.x; t < length; t += blockDim.x) {
        score[t] = __expf(score[t] - best);
        total += score[t];
    }
    reduce[threadIdx.x] = total;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) reduce[threadIdx.x] += reduce[threadIdx.x + s];
        __syncthreads();
    }
    float inv = 1.f / reduce[0];
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.f;
        for (int t = 0; t < length; ++t) acc += score[t] * values[(long long)t * head_dim + d];
        out[((long long)b * heads + h) * head_dim + d] = acc * inv;
    }
}

// gate_up: [batch, 2 * ffn] -> out: [batch, ffn] = silu(gate) * up
__global__ void silu_mul(const float* __restrict__ gate_up, float* __restrict__ out, int ffn) {
    int b = blockIdx.y, i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= ffn) return;
    float g = gate_up[(long long)b * 2 * ffn + i], u = gate_up[(long long)b * 2 * ffn + ffn + i];
    out[(long long)b * ffn + i] = g / (1.f + __expf(-g)) * u;
}

__global__ void add(const float* __restrict__ x, const float* __restrict__ y, float* __restrict__ out, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) out[i] = x[i] + y[i];
}
"""
embed_kernel = jc.Kernel(SOURCE, "embed")
rmsnorm_kernel = jc.Kernel(SOURCE, "rmsnorm")
rope_kernel = jc.Kernel(SOURCE, "rope")
kv_write_kernel = jc.Kernel(SOURCE, "kv_write")
attend_kernel = jc.Kernel(SOURCE, "attend")
silu_mul_kernel = jc.Kernel(SOURCE, "silu_mul")
add_kernel = jc.Kernel(SOURCE, "add")


@jc.jit
def embed(tokens, table, out):
    embed_kernel[tokens.shape[0], 128](tokens, table, out, out.shape[1])


@jc.jit
def rmsnorm(x, w, out):
    rmsnorm_kernel.instantiate(128)[x.shape[0], 128](x, w, out, x.shape[1], 1e-6)


@jc.jit
def rope(qkv, pos):
    batch, _three, heads, head_dim = qkv.shape
    rope_kernel[(batch, heads), 32](qkv, heads, head_dim, pos, 10000.0)


@jc.jit
def kv_write(qkv, cache_k, cache_v, pos):
    batch, _three, heads, head_dim = qkv.shape
    kv_write_kernel[(batch, heads), head_dim](qkv, cache_k, cache_v, heads, head_dim, cache_k.shape[2], pos)


@jc.jit
def attend(qkv, cache_k, cache_v, out, length, scale, max_len: jc.Constexpr[int]):
    batch, _three, heads, head_dim = qkv.shape
    attend_kernel.instantiate(max_len)[(batch, heads), 128](
        qkv, cache_k, cache_v, out, heads, head_dim, max_len, length, scale
    )


@jc.jit
def silu_mul(gate_up, out):
    batch, ffn = out.shape
    silu_mul_kernel[(jc.cdiv(ffn, 128), batch), 128](gate_up, out, ffn)


@jc.jit
def add(x, y, out):
    n = x.numel()
    add_kernel[jc.cdiv(n, 256), 256](x, y, out, n)


@dataclass
class Config:
    vocab: int = 1024
    dim: int = 256
    heads: int = 8
    layers: int = 4
    ffn: int = 512
    max_len: int = 256
    max_batch: int = 16


class Model:
    """Random weights from a seed; ``shard``/``shards`` split heads and the MLP for tensor
    parallelism (the same seed gives every rank the same full weights to slice from)."""

    def __init__(self, config: Config, seed: int, device: torch.device, shard: int = 0, shards: int = 1):
        generator = torch.Generator().manual_seed(seed)
        c = self.config = config
        if c.heads % shards or c.ffn % shards:
            raise SystemExit(f"--tp {shards} must divide heads ({c.heads}) and ffn ({c.ffn})")
        self.shards, self.heads = shards, c.heads // shards
        self.head_dim = c.dim // c.heads
        ffn = c.ffn // shards

        def weight(*shape, scale=None):
            scale = scale or shape[0] ** -0.5
            return (torch.randn(*shape, generator=generator) * scale).to(device)

        self.table = weight(c.vocab, c.dim, scale=1.0)
        self.layers = []
        for _ in range(c.layers):
            wqkv = weight(c.dim, 3, c.heads, self.head_dim)
            wo = weight(c.heads, self.head_dim, c.dim, scale=c.dim**-0.5)
            wup = weight(c.dim, 2, c.ffn)
            wdown = weight(c.ffn, c.dim)
            heads = slice(shard * self.heads, (shard + 1) * self.heads)
            cols = slice(shard * ffn, (shard + 1) * ffn)
            self.layers.append(
                {
                    "norm1": (1 + 0.1 * torch.randn(c.dim, generator=generator)).to(device),
                    "norm2": (1 + 0.1 * torch.randn(c.dim, generator=generator)).to(device),
                    "wqkv": wqkv[:, :, heads].reshape(c.dim, 3 * self.heads * self.head_dim).contiguous(),
                    "wo": wo[heads].reshape(self.heads * self.head_dim, c.dim).contiguous(),
                    "wup": wup[:, :, cols].reshape(c.dim, 2 * ffn).contiguous(),
                    "wdown": wdown[cols].contiguous(),
                }
            )
        self.final_norm = (1 + 0.1 * torch.randn(c.dim, generator=generator)).to(device)
        self.lm_head = weight(c.dim, c.vocab)
        self.group = None

    def new_cache(self, device: torch.device) -> list[torch.Tensor]:
        """Keys and values of every layer, as one flat list [k0, v0, k1, v1, ...]."""
        c = self.config
        shape = (c.max_batch, self.heads, c.max_len, self.head_dim)
        return [torch.zeros(shape, device=device) for _ in range(2 * c.layers)]

    def step(self, tokens: torch.Tensor, pos, *caches: torch.Tensor):
        """One decode step for ``tokens`` (one per request) at position ``pos``. The caches
        come last and flat, so a replayed call is a flat argument list (the fast path)."""
        c = self.config
        batch = tokens.shape[0]
        x = torch.empty(batch, c.dim, device=tokens.device)
        embed(tokens, self.table, x)
        h = torch.empty_like(x)
        for number, layer in enumerate(self.layers):
            cache_k, cache_v = caches[2 * number], caches[2 * number + 1]
            rmsnorm(x, layer["norm1"], h)
            qkv = (h @ layer["wqkv"]).view(batch, 3, self.heads, self.head_dim)
            rope(qkv, pos)
            kv_write(qkv, cache_k, cache_v, pos)
            attention = torch.empty(batch, self.heads, self.head_dim, device=x.device)
            attend(qkv, cache_k, cache_v, attention, pos + 1, self.head_dim**-0.5, c.max_len)
            projected = attention.view(batch, -1) @ layer["wo"]
            if self.group is not None:
                torch.distributed.all_reduce(projected, group=self.group)
            residual = torch.empty_like(x)
            add(x, projected, residual)
            rmsnorm(residual, layer["norm2"], h)
            gate_up = h @ layer["wup"]
            activated = torch.empty(batch, gate_up.shape[1] // 2, device=x.device)
            silu_mul(gate_up, activated)
            down = activated @ layer["wdown"]
            if self.group is not None:
                torch.distributed.all_reduce(down, group=self.group)
            x = torch.empty_like(residual)
            add(residual, down, x)
        rmsnorm(x, self.final_norm, h)
        return h @ self.lm_head


def request_stream(steps: int, max_batch: int, max_len: int, vocab: int, seed: int) -> list[tuple[int, list[int]]]:
    """(position, tokens) per step; the number of active requests changes step to step."""
    rng = random.Random(seed)
    stream, batch = [], max(1, max_batch // 2)
    for step in range(steps):
        batch = min(max_batch, max(1, batch + rng.choice([-2, -1, 0, 0, 1, 2])))
        stream.append((step % max_len, [rng.randrange(vocab) for _ in range(batch)]))
    return stream


def progress(done: int, total: int, label: str, enabled: bool) -> None:
    if enabled and (done == total or done % max(1, total // 20) == 0):
        width = 30
        filled = width * done // total
        print(f"\r  {label:8s} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end="", file=sys.stderr)
        if done == total:
            print(file=sys.stderr)


def run(model: Model, stream, device, *, use_replay: bool, show_progress: bool, record_budget: float | None = None):
    caches = model.new_cache(device)
    tokens_on_device = [torch.tensor(t, device=device) for _pos, t in stream]
    policy = {} if record_budget is None else {"record_budget": record_budget}
    session = replay.capture(**policy) if use_replay else None
    step = session.region(model.step, name="decode_step") if session else model.step
    logits = []
    torch.cuda.synchronize()
    start = time.perf_counter()
    for number, ((pos, _tokens), tokens) in enumerate(zip(stream, tokens_on_device)):
        out = step(tokens, replay.dynamic(pos) if session else pos, *caches)
        logits.append(out.clone() if session else out)  # replayed outputs are overwritten by the next replay
        progress(number + 1, len(stream), "replay" if session else "eager", show_progress)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    report = None
    if session:
        report = session.report()
        session.close()
    return logits, seconds, report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400, help="decode steps (default 400)")
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    parser.add_argument("--ffn", type=int, default=512, help="MLP width (default 512)")
    parser.add_argument("--max-batch", type=int, default=16, help="most concurrent requests (default 16)")
    parser.add_argument("--max-len", type=int, default=256, help="KV cache length (default 256)")
    parser.add_argument("--seed", type=int, default=0, help="weights and request stream seed")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (launch with torchrun)")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--eager-only", action="store_true", help="run only the eager loop")
    mode.add_argument("--replay-only", action="store_true", help="run only the replay loop")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--record-budget",
        type=float,
        default=None,
        help="replay.capture(record_budget=...): the share of the loop's time recording may take "
        "(default: the library's, 3%%; 1 records every size on its second call)",
    )
    args = parser.parse_args(argv)
    for name in ("steps", "dim", "heads", "layers", "ffn", "max_batch", "max_len", "tp"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.dim % args.heads or (args.dim // args.heads) % 2 or args.dim // args.heads > 128:
        parser.error("--dim / --heads must be an even head size of at most 128")
    if not torch.cuda.is_available():
        print(
            "decode_loop.py needs a CUDA or ROCm GPU and none is visible; to check the install without "
            f"one, run the tests: {TEST_COMMAND}",
            file=sys.stderr,
        )
        return 2
    rank = 0
    if args.tp > 1:
        if "RANK" not in os.environ:
            parser.error("--tp needs torchrun: torchrun --nproc-per-node N samples/decode_loop.py --tp N")
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.distributed.init_process_group("nccl")
        rank = torch.distributed.get_rank()
        if torch.distributed.get_world_size() != args.tp:
            parser.error(f"--tp {args.tp} but torchrun started {torch.distributed.get_world_size()} ranks")
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    device = torch.device("cuda", torch.cuda.current_device())
    config = Config(
        dim=args.dim, heads=args.heads, layers=args.layers, ffn=args.ffn, max_len=args.max_len, max_batch=args.max_batch
    )
    model = Model(config, args.seed, device, shard=rank, shards=args.tp)
    if args.tp > 1:
        model.group = torch.distributed.group.WORLD
    stream = request_stream(args.steps, args.max_batch, args.max_len, config.vocab, args.seed + 1)
    tokens = sum(len(t) for _pos, t in stream)
    show = not args.no_progress and rank == 0
    say = print if rank == 0 else (lambda *a, **k: None)
    say(
        f"decode loop: {args.steps} steps, {tokens} tokens, batch 1..{args.max_batch}, {args.layers} layers, "
        f"dim {args.dim}, tp {args.tp}, on {torch.cuda.get_device_name()}"
    )
    results = {}
    for use_replay in (False, True):
        if (use_replay and args.eager_only) or (not use_replay and args.replay_only):
            continue
        run(model, stream[: min(8, len(stream))], device, use_replay=use_replay, show_progress=False)  # warm up
        logits, seconds, report = run(
            model, stream, device, use_replay=use_replay, show_progress=show, record_budget=args.record_budget
        )
        results[use_replay] = (logits, seconds)
        label = "replay" if use_replay else "eager"
        say(f"  {label:6s}: {tokens / seconds:10.0f} tokens/s ({seconds * 1e3 / args.steps:.3f} ms/step)")
        if report:
            say(report)
    status = 0
    if len(results) == 2:
        eager_logits, eager_seconds = results[False]
        replay_logits, replay_seconds = results[True]
        mismatched = [i for i, (a, b) in enumerate(zip(eager_logits, replay_logits)) if not torch.equal(a, b)]
        if mismatched:
            worst = max((a - b).abs().max().item() for a, b in zip(eager_logits, replay_logits))
            say(
                f"  logits differ from eager at {len(mismatched)} of {len(eager_logits)} steps (max |diff| {worst:.3g})"
            )
            status = 1
        else:
            say(f"  logits: replay equals eager bit for bit at all {len(eager_logits)} steps")
        say(f"  speedup: {eager_seconds / replay_seconds:.2f}x")
    if args.tp > 1:
        status = max(status, check_against_single_gpu(args, config, stream, results, device, say))
        torch.distributed.destroy_process_group()
    return status


def check_against_single_gpu(args, config, stream, results, device, say) -> int:
    """Every rank runs the unsharded model eagerly and compares its logits with the TP run."""
    full = Model(config, args.seed, device)
    reference, _seconds, _ = run(full, stream, device, use_replay=False, show_progress=False)
    worst = 0.0
    for logits, _seconds in results.values():
        for a, b in zip(logits, reference):
            worst = max(worst, (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6))
    tolerance = 1e-4  # all-reduce sums the shards in another order than one GPU's matmul
    say(f"  tensor parallel vs single GPU: max relative difference {worst:.2e} (tolerance {tolerance:g})")
    return 0 if worst <= tolerance else 1


if __name__ == "__main__":
    sys.exit(main())
