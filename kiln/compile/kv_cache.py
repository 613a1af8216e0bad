"""transformers' KV caches in a region call: one set of graphs for every layer, prefill and decode.

Depends on torch only; transformers is looked at, never imported, and only once a model imported it.

transformers' attention writes its keys and values with `cache.update(k, v, self.layer_idx)`, and
the cache picks the layer's storage with `cache.layers[layer_idx]`. Traced inside a region, that
index is a constant of the graph: Dynamo guarded on it (`layer_idx == 0`), every layer compiled a
graph of its own, and each layer's tensors were separate inputs for automatic dynamic shapes, so a
3-layer Llama generating 16 tokens hit the recompile limit of 8 and ran 14 of its 48 block calls
eagerly (torch 2.13, transformers 5.25).

Kiln hands each region call a `BlockCache` in the cache's place: the one layer this block owns,
picked outside the graph by the block's `layer_idx`. Every block then traces the same code on an
input of the same kind; the index the attention passes goes unused, so nothing guards on it. The
length of a growing cache is marked dynamic (as is the attention mask's matching dimension), so
each decode step reuses one graph whatever `dynamic` says, and a layer's keys and values are made
contiguous before a call (Inductor's prefill returns them transposed; otherwise the first decode
step of every `generate` compiled a graph for that layout). A cache Kiln cannot view one layer at a
time (offloading, quantized layers, an encoder-decoder cache) is passed whole, and the report and
one warning say so: it compiles a graph per layer.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch
from torch import nn

# Layers whose update reads and writes their own tensors only (transformers.cache_utils), by name so
# that a class transformers adds later is passed whole until checked here.
GROWING_LAYERS = ("DynamicLayer", "DynamicSlidingWindowLayer")
FIXED_LAYERS = ("StaticLayer", "StaticSlidingWindowLayer")
_NO_INDEX = "no index"  # a block without one `layer_idx`
_INDEX: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()


class BlockCache:
    """The layer of a transformers cache that one block reads and writes, standing in for the cache
    in that block's compiled call. Anything but the per-layer methods is the whole cache's."""

    def __init__(self, cache: Any, layer: Any) -> None:
        self.cache, self.layer = cache, layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layer.update(key_states, value_states, *args, **kwargs)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layer.get_seq_length()

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layer.get_mask_sizes(query_length)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.cache, name)


def cache_class() -> type | None:
    """transformers' `Cache`, once the process imported it; None before (no model can hold one)."""
    module = sys.modules.get("transformers.cache_utils")
    return getattr(module, "Cache", None)


def for_block(module: nn.Module, kwargs: dict[str, Any], notes: dict[str, str]) -> dict[str, Any]:
    """`kwargs` with each transformers cache in them replaced by the layer `module` owns (the
    same dict when there is none). `notes` (the region's, by cache class) gets what was done, or
    why a cache was passed whole; the caller warns once per new note."""
    base = cache_class()
    if base is None:
        return kwargs
    swapped = None
    for name, value in kwargs.items():
        if isinstance(value, base):
            view = _view(module, value, kwargs, notes)
            if view is not None:
                swapped = swapped if swapped is not None else dict(kwargs)
                swapped[name] = view
    return kwargs if swapped is None else swapped


def _view(module: nn.Module, cache: Any, kwargs: dict[str, Any], notes: dict[str, str]) -> BlockCache | None:
    kind = type(cache).__name__
    reason = _whole_reason(module, cache)
    if reason is not None:
        notes.setdefault(kind, f"passed whole, so each layer compiles its own graph: {reason}")
        return None
    index = _INDEX[module]
    replicate = getattr(cache, "layer_class_to_replicate", None)
    if replicate is not None:  # a cache made without layers grows one per new index, as its update would
        while len(cache.layers) <= index:
            cache.layers.append(replicate())
    layer = cache.layers[index]
    if not _is_kind(layer, GROWING_LAYERS + FIXED_LAYERS):
        notes.setdefault(kind, f"passed whole, so each layer compiles its own graph: its layer class "
                               f"{type(layer).__name__} is not one Kiln reads one at a time "
                               f"({', '.join(GROWING_LAYERS + FIXED_LAYERS)})")
        return None
    if not _is_kind(layer, GROWING_LAYERS):
        notes.setdefault(kind, "each block call gets its own layer; one set of graphs serves every layer")
    else:
        if getattr(layer, "is_initialized", False):
            _prepare_growing(layer, kwargs.get("attention_mask"))
        notes.setdefault(kind, "each block call gets its own layer; one set of graphs serves every layer, "
                               "and the cached length is a dynamic dimension")
    return BlockCache(cache, layer)


def _whole_reason(module: nn.Module, cache: Any) -> str | None:
    """Why `cache` cannot be handed to `module` one layer at a time, or None."""
    if getattr(cache, "offloading", False):
        return "it offloads layers (its update moves the next layer in and this one out)"
    if not isinstance(getattr(cache, "layers", None), list):
        return "it keeps no list of layers (an encoder-decoder cache holds two caches)"
    if module not in _INDEX:
        indices = {vars(m)["layer_idx"] for m in module.modules() if isinstance(vars(m).get("layer_idx"), int)}
        _INDEX[module] = indices.pop() if len(indices) == 1 else _NO_INDEX
    if _INDEX[module] is _NO_INDEX:
        return f"{type(module).__qualname__} holds no single layer_idx to pick its layer by"
    return None


def _is_kind(layer: Any, names: tuple[str, ...]) -> bool:
    return any(cls.__name__ in names for cls in type(layer).__mro__)


def _prepare_growing(layer: Any, mask: Any) -> None:
    """A decode step's inputs in the form one graph serves: contiguous keys and values with the
    cached length dynamic, and the mask's last dimension (the cached length plus the new tokens)."""
    for attribute in ("keys", "values"):
        tensor = getattr(layer, attribute)
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
            setattr(layer, attribute, tensor)
        if tensor.dim() >= 2:
            torch._dynamo.maybe_mark_dynamic(tensor, tensor.dim() - 2)
    cached = layer.keys.shape[-2] if layer.keys.dim() >= 2 else 0
    if isinstance(mask, torch.Tensor) and mask.dim() >= 2 and cached and mask.shape[-1] > cached:
        torch._dynamo.maybe_mark_dynamic(mask, mask.dim() - 1)
