"""A stand-in for a Hugging Face ``StaticCache`` (transformers' cache_utils), of the same shape,
so that the CPU tests and the GPU tests cover an HF cache as a region argument without
transformers: a list of layer objects, each lazily initialised on its first update (``keys``
and ``values`` None until then, ``is_initialized`` False, its sizes set then), a
``cumulative_length`` tensor moved to the device at that point, and an update that writes the
new states in place at the positions ``cumulative_length`` says and then advances it in place
(``index_copy_``, ``add_``): after the first call no Python attribute changes."""

from __future__ import annotations

import math

import torch


class StandInLayer:
    def __init__(self, max_cache_len: int) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.is_initialized = False
        self.max_cache_len = max_cache_len
        self.cumulative_length = torch.tensor(0, dtype=torch.int64)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        self.batch_size, self.num_heads = key_states.shape[:2]
        self.head_dim = key_states.shape[-1]
        shape = (self.batch_size, self.num_heads, self.max_cache_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=key_states.dtype, device=self.device)
        self.values = torch.zeros(shape, dtype=value_states.dtype, device=self.device)
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        positions = torch.arange(key_states.shape[-2], device=self.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        return self.keys, self.values


class StandInCache:
    def __init__(self, layers: int, max_cache_len: int) -> None:
        self.layers = [StandInLayer(max_cache_len) for _ in range(layers)]
        self.layer_class_to_replicate = None
        self.offloading = False

    def update(self, key_states, value_states, layer_idx: int):
        return self.layers[layer_idx].update(key_states, value_states)


class CountingCache(StandInCache):
    """A cache that counts its tokens in a Python attribute: a side effect no graph replays."""

    def __init__(self, layers: int, max_cache_len: int) -> None:
        super().__init__(layers, max_cache_len)
        self.seen_tokens = 0

    def update(self, key_states, value_states, layer_idx: int):
        if layer_idx == 0:
            self.seen_tokens += key_states.shape[-2]
        return super().update(key_states, value_states, layer_idx)


class GrowingLayer(StandInLayer):
    """transformers' DynamicLayer: each update puts a new tensor in the attribute (torch.cat)."""

    def update(self, key_states, value_states):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.keys, self.values


HEADS = 4


def attention_step(weights: dict[str, torch.Tensor], cache: StandInCache, hidden: torch.Tensor) -> torch.Tensor:
    """One decode step of a small attention stack over ``cache`` (``hidden``: [batch, 1,
    HEADS * head_dim]): what a region passing its cache as an argument computes."""
    batch, _, width = hidden.shape
    heads = HEADS
    for index in range(len(cache.layers)):
        q, k, v = (
            (hidden @ weights[f"{name}{index}"]).view(batch, 1, heads, width // heads).transpose(1, 2) for name in "qkv"
        )
        keys, values = cache.update(k, v, index)
        scores = (q @ keys.transpose(-1, -2)) / math.sqrt(width // heads)
        hidden = hidden + (scores.softmax(-1) @ values).transpose(1, 2).reshape(batch, 1, width)
    return hidden


def attention_weights(layers: int, width: int, *, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device="cpu").manual_seed(seed)
    return {
        f"{name}{index}": (torch.randn(width, width, generator=generator) / math.sqrt(width)).to(device)
        for index in range(layers)
        for name in "qkv"
    }
