"""transformers' generate on regionally compiled blocks: one set of graphs for every layer, prefill
and decode, every block call compiled, the tokens eager gives (kiln/compile/kv_cache.py)."""

import copy
import warnings

import pytest
import torch
from torch import nn
from transformers import DynamicCache

import kiln
from kiln.compile.regions import KilnCompileWarning
from toy_models import tiny_llama

LAYERS, NEW_TOKENS = 4, 8


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return tiny_llama(layers=LAYERS, width=64, init_std=0.08).eval()


def _prompt(length: int, seed: int) -> dict:
    ids = torch.randint(1, 97, (2, length), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0  # a left-padded row: the mask is a tensor at every step
    return dict(input_ids=ids, attention_mask=mask, pad_token_id=0, do_sample=False,
                max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)


@pytest.mark.parametrize("dynamic", [None, False])
def test_generate_compiles_one_prefill_and_one_decode_graph_for_all_layers(dynamic):
    eager = _llama()
    model = kiln.compile_regions(copy.deepcopy(eager), backend="aot_eager", dynamic=dynamic)
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnCompileWarning)
        tokens = model.generate(**_prompt(12, seed=1))
    assert torch.equal(tokens, eager.generate(**_prompt(12, seed=1)))
    (region,) = kiln.compile_report(model).regions
    assert region.compiled_calls == LAYERS * NEW_TOKENS and region.eager_calls == 0  # prefill + 7 decode steps
    # Before: a graph per layer index (`layer_idx == 0`) and per cached length, the recompile limit
    # hit within one generate, the rest eager. Now the prefill and one decode graph, even where
    # dynamic=False: the cached length is marked dynamic, and the report says so.
    assert region.graphs == 2, region.recompile_reasons
    assert not any("layer_idx" in reason for reason in region.recompile_reasons)
    assert "cached length is a dynamic dimension" in region.kv_caches["DynamicCache"]


def test_a_later_generate_with_another_prompt_length_compiles_no_new_decode_graph():
    eager = _llama()
    model = kiln.compile_regions(copy.deepcopy(eager), backend="aot_eager")
    for length, seed in ((12, 1), (9, 2), (15, 3)):
        assert torch.equal(model.generate(**_prompt(length, seed)), eager.generate(**_prompt(length, seed)))
    (region,) = kiln.compile_report(model).regions
    assert region.eager_calls == 0 and region.compiled_calls == 3 * LAYERS * NEW_TOKENS
    # The second prompt length makes the prefill's length dynamic (torch's automatic dynamic shapes);
    # the third reuses both graphs.
    assert region.graphs == 3, region.recompile_reasons


def _mistral_with_a_sliding_window() -> nn.Module:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=97, sliding_window=6, max_position_embeddings=64,
                           pad_token_id=0)
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("case", ["static-cache", "sliding-window"])
def test_a_static_cache_and_a_sliding_window_cache_are_split_by_layer_too(case):
    eager = _mistral_with_a_sliding_window() if case == "sliding-window" else _llama()
    extra = {"cache_implementation": "static"} if case == "static-cache" else {}
    model = kiln.compile_regions(copy.deepcopy(eager), backend="aot_eager")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnCompileWarning)
        tokens = model.generate(**_prompt(12, seed=1), **extra)  # 12 + 8 tokens: past the window of 6
    assert torch.equal(tokens, eager.generate(**_prompt(12, seed=1), **extra))
    (region,) = kiln.compile_report(model).regions
    assert region.eager_calls == 0 and region.graphs == 2, region.recompile_reasons
    (kind, note), = region.kv_caches.items()
    assert note.startswith("each block call gets its own layer")
    assert kind == ("StaticCache" if case == "static-cache" else "DynamicCache")
    assert ("dynamic dimension" in note) == (case == "sliding-window")  # a static cache keeps one size


class CachedBlock(nn.Module):
    """Writes a transformers cache at an index of its own naming: Kiln cannot tell its layer."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.slot = index

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        keys = self.proj(x)
        if cache is not None:
            keys, _ = cache.update(keys, keys, self.slot)
        return x + keys.mean(dim=-2, keepdim=True)


class CachedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(CachedBlock(i) for i in range(2))

    def forward(self, x: torch.Tensor, cache=None) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, cache=cache)
        return x


def test_a_block_without_a_layer_index_gets_the_whole_cache_with_one_warning_and_a_report_note():
    torch.manual_seed(0)
    eager = CachedStack()
    model = kiln.compile_regions(copy.deepcopy(eager), backend="aot_eager")
    x = torch.randn(1, 1, 3, 8)
    expected_cache, cache = DynamicCache(), DynamicCache()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out, expected = model(x, cache=cache), eager(x, cache=expected_cache)
            torch.testing.assert_close(out, expected)
    messages = [str(w.message) for w in caught if issubclass(w.category, KilnCompileWarning)]
    assert len(messages) == 1 and "KV cache DynamicCache is passed whole" in messages[0]
    assert "CachedBlock holds no single layer_idx" in messages[0]
    (region,) = kiln.compile_report(model).regions
    assert region.kv_caches["DynamicCache"].startswith("passed whole")
    assert region.eager_calls == 0 and region.compiled_calls == 4  # compiled, a graph per layer
    assert "KV cache DynamicCache: passed whole" in kiln.compile_report(model).table()
    for got, want in zip(cache.layers, expected_cache.layers):
        torch.testing.assert_close(got.keys, want.keys)  # the cache itself was written as eager writes it


@pytest.mark.inductor
@pytest.mark.latest
def test_with_inductor_generate_runs_every_block_call_compiled_with_eagers_tokens():
    eager = _llama()
    model = kiln.compile_regions(copy.deepcopy(eager), backend="inductor")
    for length, seed in ((12, 1), (9, 2)):
        assert torch.equal(model.generate(**_prompt(length, seed)), eager.generate(**_prompt(length, seed)))
    (region,) = kiln.compile_report(model).regions
    assert region.eager_calls == 0 and region.compiled_calls == 2 * LAYERS * NEW_TOKENS
    # Inductor's prefill returns the cache transposed; Kiln hands the decode steps contiguous keys, so
    # the second generate's first decode step compiles nothing for that layout.
    assert region.graphs <= 4, region.recompile_reasons
    assert not any("stride mismatch" in reason for reason in region.recompile_reasons)
