"""The tensor-parallel plan: what the model declares (transformers' base_model_tp_plan), else
Kiln's for the common decoder names, checked before anything is split. Training with it runs in
tests/distributed/test_strategies.py (2 and 4 processes)."""

import pytest

from kiln.parallel.tensor_parallel import DEFAULT_PLAN, check_divisible, tensor_parallel_plan
from toy_models import tiny_llama

BLOCKS = ["model.layers.0", "model.layers.1"]


def test_the_models_own_plan_splits_every_block_projection():
    model = tiny_llama(layers=2)
    plan = tensor_parallel_plan(model, BLOCKS)
    assert len(plan) == 14  # 7 projections a block
    assert plan["model.layers.1.self_attn.q_proj"] == "colwise" and plan["model.layers.1.mlp.down_proj"] == "rowwise"
    assert not any(name.startswith("lm_head") or "embed" in name for name in plan)


def test_without_a_declared_plan_kilns_default_names_the_same_layers():
    model = tiny_llama(layers=2)
    declared = tensor_parallel_plan(model, BLOCKS)
    model.config.base_model_tp_plan = None
    assert tensor_parallel_plan(model, BLOCKS) == declared
    assert tensor_parallel_plan(model, BLOCKS[:1]) == {k: v for k, v in declared.items() if ".0." in k}
    assert set(DEFAULT_PLAN.values()) == {"colwise", "rowwise"}


@pytest.mark.parametrize("plan, message", [
    ({"layers.*.mlp.up_proj": "colwise_rep"}, "styles colwise_rep are not supported"),
    ({"layers.*.input_layernorm": "colwise"}, "Kiln splits nn.Linear layers only"),
    ({"layers.*.mlp.w1": "colwise"}, "no layer .* matches"),
])
def test_a_plan_kiln_cannot_apply_is_refused_by_name(plan, message):
    with pytest.raises((ValueError, NotImplementedError), match=message):
        tensor_parallel_plan(tiny_llama(layers=2), BLOCKS, plan)


def test_heads_and_split_sizes_must_divide_by_the_tp_size():
    model = tiny_llama(layers=2)  # 4 attention heads, 2 key-value heads
    plan = tensor_parallel_plan(model, BLOCKS)
    check_divisible(model, plan, 2)
    with pytest.raises(ValueError, match="num_key_value_heads=2 does not divide by tp_size=4"):
        check_divisible(model, plan, 4)


def test_float8_layers_get_torchaos_float8_splits_and_other_recipes_are_refused():
    """mixed_precision="fp8" with tensor parallel: torchao's Float8Linear is split by torchao's
    float8-aware styles, which take the default recipe's dynamic tensorwise scales only."""
    pytest.importorskip("torchao")
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    from kiln.fp8 import convert_to_fp8
    from kiln.parallel.tensor_parallel import parallel_style

    model = tiny_llama(layers=2, width=64)
    assert type(parallel_style(model.model.layers[0].mlp.up_proj, "colwise")) is ColwiseParallel
    assert type(parallel_style(model.model.layers[0].mlp.down_proj, "rowwise")) is RowwiseParallel
    convert_to_fp8(model)
    assert type(parallel_style(model.model.layers[0].mlp.up_proj, "colwise")) is Float8ColwiseParallel
    assert type(parallel_style(model.model.layers[0].mlp.down_proj, "rowwise")) is Float8RowwiseParallel
    rowwise = tiny_llama(layers=2, width=64)
    convert_to_fp8(rowwise, Float8LinearConfig.from_recipe_name("rowwise"))
    with pytest.raises(NotImplementedError, match="dynamic tensorwise"):
        parallel_style(rowwise.model.layers[0].mlp.up_proj, "colwise")
