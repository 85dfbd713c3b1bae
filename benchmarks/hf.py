"""A Hugging Face decode loop: a Llama StaticCache under replay, eager, a static CUDA graph, torch.compile.

A ``LlamaForCausalLM`` with random weights (6 layers, hidden 512, 8 heads, 4 key-value
heads; float16), a ``StaticCache``, a prompt prefilled eagerly, then 200 decode steps fed the
same tokens on every path (those eager chose greedily), for each batch size, five ways:

- eager: the model called directly every step;
- replay, cache as argument: ``capture().region(step)`` with ``step(ids, positions, cache)``:
  the cache is an object argument (replay.objects);
- replay, cache in a closure: the region reads the cache from its closure;
- static-copy CUDA graph: the step captured by hand with ``torch.cuda.graph`` on static
  input tensors, each step's inputs copied into them before its replay;
- torch.compile(mode="reduce-overhead"), where it runs.

Each path's logits are compared with eager's, bit for bit. Tokens per second count the
whole loop (a replay's recordings and analyses, a compile's compilation inside it); the
steady step is the second half's time per step. ``replay_over_eager`` is a path's tokens per
second over eager's; ``steady_over_static_graph`` its steady step over the static graph's.
transformers is an optional dependency (``pip install 'jitreplay[hf]'``): without it the
benchmark says so and passes. ``--dry`` (and a machine without a GPU) runs the same logic on the
CPU with a tiny model and a few steps, for the tests; its figures are not results.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings

import torch

import replay
from benchmarks import common

try:
    import transformers
except ImportError:  # an optional dependency: the benchmark says so and passes
    transformers = None

EAGER = "eager"
ARGUMENT = "replay, cache as argument"
CLOSURE = "replay, cache in a closure"
STATIC = "static-copy CUDA graph"
COMPILED = "torch.compile (reduce-overhead)"
PATHS = (EAGER, ARGUMENT, CLOSURE, STATIC, COMPILED)
#: The model of the results, and the tiny one of a dry run.
FULL = {"layers": 6, "hidden": 512, "heads": 8, "kv_heads": 4, "vocab": 8192, "prompt": 16}
DRY = {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64, "prompt": 4}


def make_model(size: dict, device: str, dtype: torch.dtype):
    config = transformers.LlamaConfig(
        vocab_size=size["vocab"],
        hidden_size=size["hidden"],
        intermediate_size=size["hidden"] * 11 // 4,
        num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"],
        num_key_value_heads=size["kv_heads"],
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).to(device=device, dtype=dtype).eval(), config


class Calls:
    """How this transformers calls the model with a cache: its keyword (``cache`` from 5.x's
    later releases, ``past_key_values`` before) and whether ``cache_position`` is a parameter."""

    def __init__(self, model) -> None:
        parameters = inspect.signature(model.forward).parameters
        self.cache_keyword = "cache" if "cache" in parameters else "past_key_values"
        self.cache_position = "cache_position" in parameters

    def step(self, model, ids: torch.Tensor, positions: torch.Tensor, cache) -> torch.Tensor:
        """The logits of the last position (``positions``: the step's positions, one row)."""
        kwargs = {self.cache_keyword: cache, "position_ids": positions.expand(ids.shape[0], -1), "use_cache": True}
        if self.cache_position:
            kwargs["cache_position"] = positions[0]
        return model(input_ids=ids, **kwargs).logits[:, -1, :]


class Loop:
    """One batch size's loop: the prompt, the tokens every path is fed (eager's greedy choice),
    and a fresh cache per path, prefilled eagerly."""

    def __init__(self, model, config, calls: Calls, batch: int, steps: int, prompt: int, device: str) -> None:
        self.model, self.config, self.calls = model, config, calls
        self.batch, self.steps, self.prompt_length, self.device = batch, steps, prompt, device
        generator = torch.Generator().manual_seed(batch)
        self.prompt = torch.randint(0, config.vocab_size, (batch, prompt), generator=generator).to(device)
        self.positions = torch.arange(prompt, prompt + steps, device=device).view(steps, 1, 1)
        self.tokens = torch.zeros(steps, batch, 1, dtype=torch.int64, device=device)
        self.logits = torch.zeros(steps, batch, config.vocab_size, dtype=model.dtype, device=device)

    def prefilled(self):
        cache = transformers.StaticCache(config=self.config, max_cache_len=self.prompt_length + self.steps)
        with torch.no_grad():
            positions = torch.arange(self.prompt_length, device=self.device).view(1, -1)
            last = self.calls.step(self.model, self.prompt, positions, cache)
        return cache, last.argmax(-1, keepdim=True)

    def choose_tokens(self) -> dict:
        """Eager's loop, choosing each next token greedily: what every path is then fed."""
        cache, token = self.prefilled()
        with torch.no_grad():
            for step in range(self.steps):
                self.tokens[step].copy_(token)
                logits = self.calls.step(self.model, self.tokens[step], self.positions[step], cache)
                token = logits.argmax(-1, keepdim=True)
        return self.run(EAGER, lambda ids, positions, cache: self.calls.step(self.model, ids, positions, cache))

    def run(self, name: str, step, cache=None, *, session=None) -> dict:
        """Time ``step`` over the loop (on a freshly prefilled cache, or ``cache``, prefilled
        already), comparing its logits with eager's."""
        if cache is None:
            cache, _ = self.prefilled()
        out = torch.empty_like(self.logits)
        half = self.steps // 2
        with torch.no_grad():
            sync()
            start = time.perf_counter()
            for number in range(self.steps):
                if number == half:
                    sync()
                    middle = time.perf_counter()
                out[number].copy_(step(self.tokens[number], self.positions[number], cache))
            sync()
            end = time.perf_counter()
        row = {
            "tokens_per_s": self.batch * self.steps / (end - start),
            "steady_step_us": (end - middle) / (self.steps - half) * 1e6,
            "bitwise": bool(torch.equal(out, self.logits)) if name != EAGER else True,
        }
        if name == EAGER:
            self.logits.copy_(out)
        if session is not None:
            stats = session.stats()
            row.update(recordings=stats.records, replays=stats.replays, recording_s=stats.capture_seconds)
        return row


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def replay_rows(loop: Loop) -> dict:
    calls, model = loop.calls, loop.model
    rows = {}
    with warnings.catch_warnings(record=True) as caught, replay.capture() as session:
        warnings.simplefilter("always")
        region = session.region(lambda ids, positions, cache: calls.step(model, ids, positions, cache))
        rows[ARGUMENT] = loop.run(ARGUMENT, region, session=session)
    rows[ARGUMENT]["warnings"] = sorted({str(w.message).splitlines()[0][:300] for w in caught})
    closure_cache, _ = loop.prefilled()
    with warnings.catch_warnings(record=True) as caught, replay.capture() as session:
        warnings.simplefilter("always")
        region = session.region(lambda ids, positions: calls.step(model, ids, positions, closure_cache))
        closure = lambda ids, positions, _cache: region(ids, positions)
        rows[CLOSURE] = loop.run(CLOSURE, closure, closure_cache, session=session)
    rows[CLOSURE]["warnings"] = sorted({str(w.message).splitlines()[0][:300] for w in caught})
    return rows


def static_graph_row(loop: Loop) -> dict:
    """torch.cuda.graph by hand: static inputs, two warm-up steps on a side stream (the
    cache's tensors put back afterwards), the capture, then per step a copy in and a replay."""
    if not torch.cuda.is_available():
        return {"skipped": "needs a GPU"}
    cache, _ = loop.prefilled()
    ids, positions = loop.tokens[0].clone(), loop.positions[0].clone()
    kept = [t.clone() for t in _cache_tensors(cache)]
    started = time.perf_counter()
    with torch.no_grad():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                loop.calls.step(loop.model, ids, positions, cache)
        torch.cuda.current_stream().wait_stream(side)
        for tensor, before in zip(_cache_tensors(cache), kept):
            tensor.copy_(before)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = loop.calls.step(loop.model, ids, positions, cache)
    capture_s = time.perf_counter() - started

    def step(new_ids, new_positions, _cache):
        ids.copy_(new_ids)
        positions.copy_(new_positions)
        graph.replay()
        return logits

    row = loop.run(STATIC, step, cache)
    row["recording_s"] = capture_s  # outside the loop: its tokens/s leave it out
    return row


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


def compiled_row(loop: Loop) -> dict:
    if not torch.cuda.is_available():
        return {"skipped": "needs a GPU (reduce-overhead records CUDA graphs)"}
    compiled = torch.compile(lambda ids, positions, cache: loop.calls.step(loop.model, ids, positions, cache),
                             mode="reduce-overhead")  # fmt: skip
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return loop.run(COMPILED, compiled)
    except Exception as error:  # torch.compile failing on this model is a result, not a crash
        return {"skipped": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"}


def measure_batch(model, config, calls: Calls, batch: int, steps: int, prompt: int, device: str) -> dict:
    loop = Loop(model, config, calls, batch, steps, prompt, device)
    rows = {EAGER: loop.choose_tokens()}
    rows.update(replay_rows(loop))
    rows[STATIC] = static_graph_row(loop)
    rows[COMPILED] = compiled_row(loop)
    eager, static = rows[EAGER], rows[STATIC]
    for row in rows.values():
        if "tokens_per_s" in row:
            row["replay_over_eager"] = row["tokens_per_s"] / eager["tokens_per_s"]
            if "steady_step_us" in static:
                row["steady_over_static_graph"] = row["steady_step_us"] / static["steady_step_us"]
    return rows


def report(results: dict, batches: list[int], primary: int, size: dict, steps: int) -> str:
    rows = []
    for batch in batches:
        for name, row in results["by_batch"][str(batch)].items():
            if "skipped" in row:
                rows.append((batch, name, "skipped: " + row["skipped"], "", "", "", "", ""))
                continue
            rows.append(
                (
                    batch,
                    name,
                    f"{row['tokens_per_s']:.0f}",
                    f"{row['replay_over_eager']:.2f}x",
                    f"{row['steady_step_us']:.1f}",
                    f"{row['steady_over_static_graph']:.2f}x" if "steady_over_static_graph" in row else "",
                    f"{row['recording_s'] * 1000:.1f}" if "recording_s" in row else "",
                    "yes" if row["bitwise"] else "NO",
                )
            )
    table = common.markdown_table(
        ["batch", "path", "tokens/s", "over eager", "steady us/step", "over static graph", "recording ms", "bitwise"],
        rows,
    )
    warned = {
        w for batch in batches for row in results["by_batch"][str(batch)].values() for w in row.get("warnings", ())
    }
    return (
        f"{table}\n\nLlama architecture with random weights: {size['layers']} layers, hidden {size['hidden']}, "
        f"{size['heads']} heads ({size['kv_heads']} key-value), vocabulary {size['vocab']}; a {size['prompt']}-token "
        f"prompt prefilled eagerly, then {steps} decode steps. The rows of `results` are batch {primary}'s; "
        "`by_batch` holds every batch size. Tokens/s count the whole loop (recordings and compilation inside it); "
        "the steady step is the second half's time per step; recording ms is the session's capture time (the "
        "static graph's capture, outside its loop)."
        + ("\n\nWarnings:\n" + "\n".join(f"- {w}" for w in sorted(warned)) if warned else "")
    )


def main() -> None:
    parser = common.parser(__doc__.splitlines()[0])
    parser.add_argument("--dry", action="store_true", help="a tiny model on the CPU, a few steps: the logic only")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="batch sizes (default 1 4 8)")
    args = parser.parse_args()
    if transformers is None:
        print("transformers is not installed (pip install 'jitreplay[hf]'): skipped")
        return
    dry = args.dry or not torch.cuda.is_available()
    size, device, dtype = (DRY, "cpu", torch.float32) if dry else (FULL, "cuda", torch.float16)
    steps = 8 if dry else 200
    batches = args.batches or ([1, 2] if dry else [4] if args.quick else [1, 4, 8])
    primary = 4 if 4 in batches else batches[-1]
    model, config = make_model(size, device, dtype)
    calls = Calls(model)
    by_batch = {str(b): measure_batch(model, config, calls, b, steps, size["prompt"], device) for b in batches}
    results = {**by_batch[str(primary)], "by_batch": by_batch, "primary_batch": primary, "steps": steps,
               "dry": dry, "model": size, "transformers": transformers.__version__}  # fmt: skip
    results[ARGUMENT]["bitwise"] = all(by_batch[str(b)][ARGUMENT].get("bitwise", False) for b in batches)
    title = "A Hugging Face decode loop: a StaticCache under replay" + (" (dry run: not results)" if dry else "")
    common.write(args.out, "hf-dry" if dry else "hf", title, results, report(results, batches, primary, size, steps))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
