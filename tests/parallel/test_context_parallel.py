"""Context parallelism's checks, on one process (kiln/parallel/context_parallel.py); training under
it, on four, is in tests/distributed/test_strategies.py."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import kiln.parallel.context_parallel as cp
from kiln import TorchDynamoPlugin
from kiln.parallel.fsdp import FSDPStrategy, FullyShardedDataParallelPlugin
from toy_models import tiny_llama

STUB_MESH = SimpleNamespace(size=lambda: 2, device_type="cpu")  # the checks run before the mesh is used


@pytest.fixture
def region_open(monkeypatch):
    """As inside accelerator.maybe_context_parallel, without the process group it needs."""
    monkeypatch.setattr(cp, "_regions_open", 1)


def test_a_model_whose_attention_would_see_its_slice_only_is_refused_at_prepare():
    cp.check_model(tiny_llama())  # sdpa: torch slices it
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attention is 'eager'.*attn_implementation=\"sdpa\""):
        cp.check_model(eager)
    windowed = tiny_llama()
    windowed._supports_context_parallel = False  # transformers: attention sinks, say; its property reads this
    with pytest.raises(ValueError, match="does not support context parallelism"):
        cp.check_model(windowed)


@pytest.mark.parametrize("buffers, dims, no_restore, message", [
    ("ids", [1], set(), "must be a list of tensors"),
    ([], [], set(), "needs the buffers"),
    ([torch.zeros(2, 8)], [1, 1], set(), "one sequence dimension per buffer"),
    ([torch.zeros(2, 8), torch.zeros(2, 12)], [1, 1], set(), r"sequence lengths differ \(\[8, 12\]\)"),
    ([torch.zeros(2, 6)], [1], set(), "6 must divide by 2 x cp_size = 4"),
    ([torch.zeros(2, 8, requires_grad=True)], [1], set(), "requires grad"),
    ([torch.zeros(2, 8)], [1], {torch.zeros(2, 8)}, "subset of buffers"),
])
def test_buffers_that_cannot_be_sliced_alike_are_refused_naming_the_fix(buffers, dims, no_restore, message):
    with pytest.raises((TypeError, ValueError), match=message):
        with cp.context_parallel_region(STUB_MESH, buffers, dims, no_restore, "allgather"):
            pass


def test_inside_a_region_padding_and_missing_positions_are_refused(region_open):
    model = tiny_llama()
    cp.check_inputs_under_context_parallel(model)
    ids = torch.randint(0, 97, (2, 8))
    positions = torch.arange(8).expand(2, 8)
    with pytest.raises(ValueError, match="must get them: pass position_ids"):
        model(input_ids=ids)
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, -1] = 0
    with pytest.raises(ValueError, match="attention mask with padding"):
        model(input_ids=ids, position_ids=positions, attention_mask=padded)
    model(input_ids=ids, position_ids=positions, attention_mask=torch.ones(2, 8, dtype=torch.long))


def test_outside_a_region_the_model_takes_what_it_always_took():
    model = tiny_llama()
    cp.check_inputs_under_context_parallel(model)
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, -1] = 0
    model(input_ids=torch.randint(0, 97, (2, 8)), attention_mask=padded)


def test_inside_a_region_each_block_is_called_without_the_models_mask(region_open):
    """A transformers model builds each process's mask from its own slice of positions, so the
    processes would disagree on it (and on the layout of grouped-query heads)."""
    model = tiny_llama(layers=2)
    paths = ["model.layers.0", "model.layers.1"]
    cp.drop_block_masks(model, paths)
    seen = []
    for path in paths:
        model.get_submodule(path).register_forward_pre_hook(
            lambda module, args, kwargs: seen.append(kwargs.get("attention_mask")), with_kwargs=True)
    padded = torch.ones(2, 8, dtype=torch.long)
    padded[0, -1] = 0
    model(input_ids=torch.randint(0, 97, (2, 8)), attention_mask=padded)  # a mask the model must build on
    assert seen == [None, None]


def test_attention_inside_a_region_is_causal_and_refuses_a_mask():
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    with cp._causal_attention():
        assert torch.equal(F.scaled_dot_product_attention(q, k, v), F.scaled_dot_product_attention.__wrapped__(
            q, k, v, is_causal=True))
        with pytest.raises(ValueError, match="takes no mask"):
            F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(8, 8, dtype=torch.bool))
    assert not hasattr(F.scaled_dot_product_attention, "__wrapped__")  # the original is back


def test_precompiled_regions_are_refused_under_context_parallel():
    strategy = FSDPStrategy(FullyShardedDataParallelPlugin())
    strategy.cp_mesh = STUB_MESH
    with pytest.raises(ValueError, match="precompile=True.*do not compose with context parallelism"):
        strategy.check_compile(TorchDynamoPlugin(backend="aot_eager", fullgraph=True, precompile=True))
    strategy.check_compile(TorchDynamoPlugin(backend="aot_eager"))
