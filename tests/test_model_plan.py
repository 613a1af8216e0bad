"""One plan per prepared model and the transformations that take it in turn (kiln/model_plan.py)."""

import pytest

import kiln.model_plan as model_plan
from kiln import Accelerator, TorchDynamoPlugin
from toy_models import tiny_llama

ORDER = ["split_tensor_parallel", "hook_context_parallel", "checkpoint_blocks", "compile_model", "wrap_precision",
         "wrap_strategy"]


@pytest.fixture
def seen(monkeypatch):
    """Each transformation's name and the plan it was given, as prepare runs them."""
    calls = []

    def recorded(step):
        def run(model, plan, parts):
            calls.append((step.__name__, plan))
            return step(model, plan, parts)
        return run

    monkeypatch.setattr(model_plan, "TRANSFORMS", tuple(recorded(step) for step in model_plan.TRANSFORMS))
    return calls


def test_prepare_runs_every_transformation_once_in_order_on_one_plan(seen):
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    accelerator.prepare(tiny_llama(layers=2))
    assert [name for name, _ in seen] == ORDER
    plans = {id(plan) for _, plan in seen}
    assert len(plans) == 1
    plan = seen[0][1]
    assert plan.block_paths == ["model.layers.0", "model.layers.1"] and plan.regional and plan.training
    assert not plan.context_parallel


def test_a_model_prepared_for_evaluation_is_compiled_but_neither_split_nor_wrapped(seen):
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    model = tiny_llama(layers=2)
    prepared = accelerator.prepare_model(model, evaluation_mode=True)
    assert prepared is model and not model.training
    assert [name for name, _ in seen] == ORDER and not seen[0][1].training
    assert accelerator.compile_report().regions[0].name == "LlamaDecoderLayer"
