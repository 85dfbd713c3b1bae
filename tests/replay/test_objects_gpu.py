"""Objects and the other routes of global torch state, on a real GPU: exact, or refused loudly.

Each test compares the region's calls with eager runs of the same function on their own copies
of the same fresh random inputs, bit for bit, with the previous output poisoned (NaN) before
each call so that a replay that does not write its output shows. The tests of an object
argument that must *replay* (a Hugging Face cache, the stand-ins of the same shape) also check
that it did (:class:`NotReplayed`, raised where the calls ran eagerly).
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import replay
from replay import object_calls, region_keys
from tests.replay.cache_standin import CountingCache, StandInCache, attention_step, attention_weights
from tests.replay.fuzz_grammar import copy_row, row_sum

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("with_and_without_helper")]

DEVICE = "cuda"
WIDTH, LAYERS, MAX_LEN = 64, 3, 48


class NotReplayed(Exception):
    """The calls were exact but ran eagerly: what the session does with object arguments
    until it walks them."""


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaNs, -0.0 and all), of the same shape and dtype."""
    bits = [t.reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(*bits)


def poison(output: object) -> None:
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        output.fill_(float("nan"))


def cache_tensors(cache) -> list[torch.Tensor]:
    return [t for layer in cache.layers for t in vars(layer).values() if isinstance(t, torch.Tensor)]


def replayed(session, at_least: int) -> None:
    if session.stats().replays < at_least:
        raise NotReplayed(f"{session.stats().replays} replays: the calls ran eagerly")


# --- a cache as an argument -------------------------------------------------------------------
def _decode_loop(region, step, make_cache, steps: int, weights, *, generations: int = 1) -> None:
    """``generations`` caches in turn (a new cache per generation), each over ``steps`` decode
    steps, called through ``region`` and eagerly on a deep copy: outputs and every cache tensor
    equal after every step."""
    for _ in range(generations):
        cache = make_cache()
        eager_cache = copy.deepcopy(cache)
        previous = None
        for _ in range(steps):
            hidden = torch.randn(2, 1, WIDTH, device=DEVICE)
            expected = step(weights, eager_cache, hidden.clone())
            poison(previous)
            got = region(weights, cache, hidden)
            assert same(got, expected), "outputs differ from eager"
            for mine, theirs in zip(cache_tensors(cache), cache_tensors(eager_cache), strict=True):
                assert same(mine, theirs), "the cache differs from eager's after the call"
            previous = got


def test_a_static_cache_stand_in_as_an_argument_replays_bit_for_bit_a_new_cache_per_generation_too():
    """Torch ops read and write the cache (index_copy_, matmuls): its tensors are keyed by their
    address (a decode loop keeps its cache, and its key; a new cache elsewhere records anew)."""
    weights = attention_weights(LAYERS, WIDTH, device=DEVICE)
    with torch.no_grad(), replay.capture(record_budget=1) as session, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        region = session.region(attention_step)
        _decode_loop(region, attention_step, lambda: StandInCache(LAYERS, MAX_LEN), 12, weights, generations=3)
        replayed(session, 20)
        recorded = [key for key, entry in region.entries.items() if entry.graph is not None]
        assert recorded and all(region_keys.addressed_leaves(key) for key in recorded)
    assert not [w for w in caught if issubclass(w.category, replay.ReplayWarning)]  # (the lazy first calls: quiet)


def test_a_decode_loop_passing_its_cache_is_served_from_its_memo_at_every_steady_step(monkeypatch):
    """After its first replays, every step of a loop passing the same cache is served by the
    memo of its key (replay.object_calls: no walk, no full key), bit for bit as eager."""
    served: list[bool] = []
    real = object_calls._repeat

    def repeat(region, memo, plain):
        call = real(region, memo, plain)
        served.append(call is not None)
        return call

    monkeypatch.setattr(object_calls, "_repeat", repeat)
    weights = attention_weights(LAYERS, WIDTH, device=DEVICE)
    steps, by = 32, 12
    with torch.no_grad(), replay.capture(record_budget=1) as session:
        region = session.region(attention_step)
        cache = StandInCache(LAYERS, MAX_LEN)
        eager_cache = copy.deepcopy(cache)
        previous, first = None, None
        for number in range(steps):
            hidden = torch.randn(2, 1, WIDTH, device=DEVICE)
            expected = attention_step(weights, eager_cache, hidden.clone())
            poison(previous)
            count = served.count(True)
            got = region(weights, cache, hidden)
            assert same(got, expected), "outputs differ from eager"
            for mine, theirs in zip(cache_tensors(cache), cache_tensors(eager_cache), strict=True):
                assert same(mine, theirs), "the cache differs from eager's after the call"
            if served.count(True) > count and first is None:
                first = number
            if first is not None:
                assert served.count(True) == count + 1, f"step {number} was not served from the memo"
            previous = got
        assert first is not None and first <= by, f"the memo first served step {first}"
        replayed(session, steps - by)


# --- a cache only jit kernels read and write: rebound, one graph for every new cache -------------
class JitLayer:
    def __init__(self, rows: int, width: int) -> None:
        self.keys = torch.zeros(rows, width, device=DEVICE)
        self.max_len = rows


class JitCache:
    def __init__(self, layers: int, rows: int, width: int) -> None:
        self.layers = [JitLayer(rows, width) for _ in range(layers)]


def jit_cache_step(hidden: torch.Tensor, cache: JitCache, pos: int, torch_reads: bool = False) -> torch.Tensor:
    for layer in cache.layers:
        copy_row(hidden, layer.keys, pos)  # a jit kernel writes the object's tensor: its pointer rebound
        if torch_reads:
            sums = layer.keys.sum(1)  # a torch op reads it: keyed by its address
        else:
            sums = torch.empty(layer.max_len, device=DEVICE)
            row_sum(layer.keys, sums)  # a jit kernel reads it
        hidden = torch.tanh(hidden + sums.sum() / layer.max_len)
    return hidden


@pytest.mark.parametrize("torch_reads", [False, True], ids=["jit reads", "torch-op reads"])
def test_a_new_cache_per_generation_replays_one_graph_where_jit_kernels_alone_touch_it(torch_reads):
    rows, generations, steps = 16, 3, 10
    with torch.no_grad(), replay.capture(record_budget=1) as session:
        region = session.region(jit_cache_step)
        for _ in range(generations):
            cache = JitCache(LAYERS, rows, WIDTH)
            eager_cache = copy.deepcopy(cache)
            previous = None
            for pos in range(steps):
                hidden = torch.randn(WIDTH, device=DEVICE)
                expected = jit_cache_step(hidden.clone(), eager_cache, pos, torch_reads)
                poison(previous)
                got = region(hidden, cache, replay.dynamic(pos), torch_reads)
                assert same(got, expected), "outputs differ from eager"
                for mine, theirs in zip(cache_tensors(cache), cache_tensors(eager_cache), strict=True):
                    assert same(mine, theirs), "the cache differs from eager's after the call"
                previous = got
        recorded = [key for key, entry in region.entries.items() if entry.graph is not None]
        if torch_reads:  # every recorded key holds the cache's addresses
            assert recorded and all(region_keys.addressed_leaves(key) for key in recorded)
            replayed(session, steps)
        else:  # one graph, rebound to each new cache
            assert session.stats().records == 1 and not region_keys.addressed_leaves(recorded[0])
            replayed(session, generations * steps - 3)


# --- a module passed as an argument --------------------------------------------------------------
class TiedModel(torch.nn.Module):
    """Its output layer's weight is its embedding's (one tensor reached at two paths)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, WIDTH)
        self.head = torch.nn.Linear(WIDTH, 50, bias=False)
        self.head.weight = self.embed.weight
        self.scale = 1.0

    def forward(self, ids):
        return self.head(torch.tanh(self.embed(ids) * self.scale))


def test_a_module_with_tied_weights_passed_as_an_argument_replays_and_its_python_attributes_are_keyed():
    model = TiedModel().to(DEVICE).eval()
    with torch.no_grad(), replay.capture(record_budget=1) as session:
        region = session.region(lambda model, ids: model(ids))
        previous = None
        for step in range(12):
            if step == 8:
                model.scale = 0.5  # a plain value of the key: another key, never the graph of 1.0
            ids = torch.randint(0, 50, (3, 5), device=DEVICE)
            expected = model(ids.clone())
            poison(previous)
            got = region(model, ids)
            assert same(got, expected), f"outputs differ from eager at step {step}"
            previous = got
        replayed(session, 4)
        recorded = [key for key, entry in region.entries.items() if entry.graph is not None]
        assert recorded and all(key[3] for key in recorded)  # the tied weight: two leaves that overlap


# --- state a region changes: refused, never dropped ----------------------------------------------
class CountingModule(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(WIDTH, WIDTH)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.linear(x)


def test_a_module_that_counts_its_calls_in_python_is_refused_after_its_second_change_not_recorded_again():
    module = CountingModule().to(DEVICE)
    eager = copy.deepcopy(module)
    with torch.no_grad(), replay.capture(record_budget=1, record_after=0) as session:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            region = session.region(lambda x: module(x))
            previous = None
            for _ in range(12):
                x = torch.randn(4, WIDTH, device=DEVICE)
                expected = eager(x.clone())
                poison(previous)
                got = region(x)
                assert same(got, expected) and module.calls == eager.calls
                previous = got
        assert session.stats().records <= 2
    said = [str(w.message) for w in caught if issubclass(w.category, replay.ReplayWarning)]
    assert said and all("module.calls" in text for text in said)


def test_a_python_side_effect_in_an_argument_is_never_dropped():
    """seen_tokens += 1 inside the region: every call runs the Python (eagerly), whatever the
    session makes of the cache."""
    weights = attention_weights(LAYERS, WIDTH, device=DEVICE)
    with torch.no_grad(), replay.capture(record_budget=1) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        region = session.region(attention_step)
        cache = CountingCache(LAYERS, MAX_LEN)
        eager_cache = copy.deepcopy(cache)
        for step in range(1, 9):
            hidden = torch.randn(2, 1, WIDTH, device=DEVICE)
            expected = attention_step(weights, eager_cache, hidden.clone())
            assert same(region(weights, cache, hidden), expected)
            assert cache.seen_tokens == eager_cache.seen_tokens == step


def _llama(transformers, device: str):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.float32).eval()
    return model, config


def test_a_hugging_face_static_cache_as_an_argument_replays_bit_for_bit():
    transformers = pytest.importorskip("transformers")
    import inspect

    model, config = _llama(transformers, DEVICE)
    keyword = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    takes_cache_position = "cache_position" in inspect.signature(model.forward).parameters

    def step(ids, positions, cache):
        kwargs = {keyword: cache, "position_ids": positions.expand(ids.shape[0], -1), "use_cache": True}
        if takes_cache_position:
            kwargs["cache_position"] = positions[0]
        return model(input_ids=ids, **kwargs).logits

    with torch.no_grad(), replay.capture(record_budget=1) as session:
        region = session.region(step)
        for _ in range(2):  # a new cache per generation: the same key
            cache = transformers.StaticCache(config=config, max_cache_len=32)
            eager_cache = transformers.StaticCache(config=config, max_cache_len=32)
            previous = None
            for position in range(12):
                ids = torch.randint(0, 256, (2, 1), device=DEVICE)
                positions = torch.tensor([[position]], device=DEVICE)
                expected = step(ids.clone(), positions.clone(), eager_cache)
                poison(previous)
                got = region(ids, positions, cache)
                assert same(got, expected), f"logits differ from eager at position {position}"
                previous = got
        replayed(session, 16)


# --- other routes by which global torch state enters results ------------------------------------
def scaled_sum(x: torch.Tensor) -> torch.Tensor:
    return (x * 3).sum(0) + x[0]


class AddOne(TorchDispatchMode):
    """A mode that changes results: every multiplication's result plus one."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out + 1 if func is torch.ops.aten.mul.Tensor else out


class Doubling(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        return out * 2 if func is torch.Tensor.sum else out


def _calls(region, fn, context, count: int) -> None:
    previous = None
    for _ in range(count):
        x = torch.randn(16, 32, device=DEVICE)
        with context():
            expected = fn(x.clone())
            poison(previous)
            got = region(x)
        assert same(got, expected), "outputs differ from eager"
        previous = got


@pytest.mark.parametrize("mode", [AddOne, Doubling], ids=["dispatch mode", "function mode"])
def test_an_active_mode_makes_the_call_run_through_it(mode):
    with torch.no_grad(), replay.capture(record_budget=1) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)  # the refused key says why
        region = session.region(scaled_sum)
        _calls(region, scaled_sum, contextlib.nullcontext, 4)
        assert session.stats().replays >= 2
        _calls(region, scaled_sum, mode, 4)  # a graph bypasses the mode: never replayed under it
        _calls(region, scaled_sum, contextlib.nullcontext, 4)


def with_default_device_ones(x: torch.Tensor) -> torch.Tensor:
    return x + torch.arange(x.shape[-1], dtype=x.dtype)  # on the default device


def test_the_default_device_selects_its_own_graph_and_an_eager_error_stays_an_error():
    with torch.no_grad(), replay.capture(record_budget=1) as session:
        region = session.region(with_default_device_ones)
        _calls(region, with_default_device_ones, lambda: torch.device(DEVICE), 4)
        assert session.stats().replays >= 2
        x = torch.randn(16, 32, device=DEVICE)
        with pytest.raises(RuntimeError):  # eager: a CPU arange added to a GPU tensor
            with_default_device_ones(x.clone())
        with pytest.raises(RuntimeError):
            region(x)  # never the graph recorded under the GPU default device
        torch.set_default_device(DEVICE)
        try:
            _calls(region, with_default_device_ones, contextlib.nullcontext, 3)
        finally:
            torch.set_default_device(None)


def test_forward_mode_ad_keeps_its_tangents():
    def fn(x):
        return (x * x).sin()

    with torch.no_grad(), replay.capture(record_budget=1) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        region = session.region(fn)
        _calls(region, fn, contextlib.nullcontext, 3)
        with fwAD.dual_level():
            x, tangent = torch.randn(16, device=DEVICE), torch.randn(16, device=DEVICE)
            got = fwAD.unpack_dual(region(fwAD.make_dual(x, tangent)))
            expected = fwAD.unpack_dual(fn(fwAD.make_dual(x.clone(), tangent.clone())))
            assert got.tangent is not None and same(got.tangent, expected.tangent) and same(got.primal, expected.primal)


def test_the_mha_fast_path_switch_selects_its_own_graph():
    attention = torch.nn.MultiheadAttention(32, 4, batch_first=True).to(DEVICE).eval()

    def fn(x):
        return attention(x, x, x, need_weights=False)[0]

    with torch.no_grad(), replay.capture(record_budget=1) as session:
        region = session.region(fn)
        _calls(region, lambda x: fn(x), contextlib.nullcontext, 3)
        before = torch.backends.mha.get_fastpath_enabled()
        torch.backends.mha.set_fastpath_enabled(not before)
        try:
            previous = None
            for _ in range(3):
                x = torch.randn(2, 8, 32, device=DEVICE)
                expected = fn(x.clone())
                poison(previous)
                got = region(x)
                assert same(got, expected)
                previous = got
        finally:
            torch.backends.mha.set_fastpath_enabled(before)


def test_a_global_module_hook_runs_on_every_call():
    linear = torch.nn.Linear(32, 32).to(DEVICE)

    def fn(x):
        return linear(x)

    with torch.no_grad(), replay.capture(record_budget=1) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        region = session.region(fn)
        _calls(region, fn, contextlib.nullcontext, 3)
        calls = []

        def hook(module, args, output):
            calls.append(1)
            return output * 2

        handle = torch.nn.modules.module.register_module_forward_hook(hook)
        try:
            _calls(region, fn, contextlib.nullcontext, 3)
            assert len(calls) == 6  # eager's three and the region's three
        finally:
            handle.remove()


def test_a_draw_from_the_cpu_generator_is_never_baked():
    def fn(x):
        return x * torch.rand(()).item()  # a CPU draw: baked into a graph's kernel argument

    with torch.no_grad(), replay.capture(record_budget=1) as session, warnings.catch_warnings():
        warnings.simplefilter("ignore", replay.ReplayWarning)
        region = session.region(fn)
        torch.manual_seed(1)
        x = torch.ones(8, device=DEVICE)
        got = [region(x).clone() for _ in range(5)]
        torch.manual_seed(1)
        expected = [fn(x) for _ in range(5)]
        assert all(same(a, b) for a, b in zip(got, expected))
