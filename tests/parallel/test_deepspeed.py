"""DeepSpeed settings without processes: the plugin, the engine config Kiln builds, and refusals."""

import json

import pytest

from kiln import Accelerator, DeepSpeedPlugin, TorchDynamoPlugin
from kiln.parallel.deepspeed import build_config


def config(plugin=None, precision="no", accumulation=1, batch=4):
    return build_config(plugin or DeepSpeedPlugin(), mixed_precision=precision,
                        gradient_accumulation_steps=accumulation, micro_batch_size=batch)


def test_auto_and_missing_values_are_filled_from_the_accelerator():
    user = {"zero_optimization": {"stage": "auto"}, "gradient_accumulation_steps": "auto",
            "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "bf16": {"enabled": "auto"}}
    built = config(DeepSpeedPlugin(hf_ds_config=user, zero_stage=3, gradient_clipping=1.0), "bf16", 4, 8)
    assert built["zero_optimization"]["stage"] == 3
    assert built["gradient_accumulation_steps"] == 4 and built["train_micro_batch_size_per_gpu"] == 8
    assert "train_batch_size" not in built and built["gradient_clipping"] == 1.0
    assert built["bf16"] == {"enabled": True} and built["fp16"] == {"enabled": False}
    assert user["zero_optimization"]["stage"] == "auto"  # the user's dict is left as it was


def test_defaults_to_zero_2_and_no_clipping():
    built = config()
    assert built["zero_optimization"]["stage"] == 2 and "gradient_clipping" not in built


@pytest.mark.parametrize("user, plugin, precision, accumulation, message", [
    ({"zero_optimization": {"stage": 3}}, {"zero_stage": 2}, "no", 1, "zero_optimization.stage=3"),
    ({"gradient_accumulation_steps": 8}, {}, "no", 2, "gradient_accumulation_steps=8"),
    ({"bf16": {"enabled": True}}, {}, "no", 1, "bf16.enabled=True"),
    ({"fp16": {"enabled": False}}, {}, "fp16", 1, "fp16.enabled=False"),
    ({"optimizer": {"type": "Adam"}}, {}, "no", 1, "optimizer"),
    ({"zero_optimization": {"reduce_bucket_size": "auto"}}, {}, "no", 1, "zero_optimization.reduce_bucket_size"),
    ({}, {"offload_param_device": "cpu"}, "no", 1, "offload_param needs ZeRO stage 3"),
])
def test_conflicts_and_unfillable_values_are_named_errors(user, plugin, precision, accumulation, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        config(DeepSpeedPlugin(hf_ds_config=user, **plugin), precision, accumulation)


def test_a_batch_size_is_required():
    with pytest.raises(ValueError, match="batch size per process"):
        config(batch=None)
    assert config(DeepSpeedPlugin(hf_ds_config={"train_micro_batch_size_per_gpu": 2}), batch=None)


def test_plugin_reads_a_json_file_and_checks_its_values(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    assert DeepSpeedPlugin(hf_ds_config=str(path)).hf_ds_config["zero_optimization"]["stage"] == 1
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        DeepSpeedPlugin(hf_ds_config=path)
    with pytest.raises(FileNotFoundError):
        DeepSpeedPlugin(hf_ds_config=tmp_path / "missing.json")
    for bad in ({"zero_stage": 4}, {"gradient_clipping": -1}, {"offload_optimizer_device": "nvme"}):
        with pytest.raises(ValueError):
            DeepSpeedPlugin(**bad)


def test_plugin_from_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("KILN_DEEPSPEED_ZERO_STAGE", "3")
    monkeypatch.setenv("KILN_DEEPSPEED_GRADIENT_CLIPPING", "0.5")
    plugin = DeepSpeedPlugin.from_env()
    assert (plugin.zero_stage, plugin.gradient_clipping, plugin.hf_ds_config) == (3, 0.5, None)
    monkeypatch.setenv("KILN_DEEPSPEED_ZERO_STAGE", "three")
    with pytest.raises(ValueError, match="KILN_DEEPSPEED_ZERO_STAGE"):
        DeepSpeedPlugin.from_env()


def test_zero3_refuses_a_whole_model_fullgraph_compile():
    pytest.importorskip("deepspeed")
    from kiln.parallel.deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(DeepSpeedPlugin(zero_stage=3), "no", 1)
    with pytest.raises(ValueError, match="regional compilation"):
        strategy.check_compile(TorchDynamoPlugin(backend="eager", fullgraph=True))
    strategy.check_compile(TorchDynamoPlugin(backend="eager", fullgraph=True, use_regional_compilation=True))
    DeepSpeedStrategy(DeepSpeedPlugin(zero_stage=2), "no", 1).check_compile(
        TorchDynamoPlugin(backend="eager", fullgraph=True))


def test_one_process_with_deepspeed_warns_and_trains_unsharded():
    with pytest.warns(UserWarning, match="DeepSpeed was asked for, but this is a single process"):
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
    assert accelerator.strategy.name == "single"


def test_fsdp_and_deepspeed_together_are_refused():
    from kiln import FullyShardedDataParallelPlugin

    with pytest.raises(ValueError, match="not both"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(), deepspeed_plugin=DeepSpeedPlugin())


def test_the_engine_needs_the_model_and_its_optimizer_in_one_prepare_call():
    pytest.importorskip("deepspeed")
    import torch

    from kiln.accumulation import GradientState
    from kiln.parallel.deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(DeepSpeedPlugin(), "no", 1)
    model = torch.nn.Linear(2, 2)
    strategy.begin_prepare((model,))
    with pytest.raises(ValueError, match="same prepare\\(\\) call"):
        strategy.wrap_model(model, [])
    with pytest.raises(ValueError, match="together with its model"):
        strategy.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), GradientState(), None, None)


def test_accumulation_steps_of_the_plugin_are_used_when_the_accelerator_leaves_them_at_1():
    with pytest.warns(UserWarning, match="single process"):
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(gradient_accumulation_steps=4))
    assert accelerator.gradient_accumulation_steps == 4
    with pytest.raises(ValueError, match="set it in one place"):
        Accelerator(gradient_accumulation_steps=2, deepspeed_plugin=DeepSpeedPlugin(gradient_accumulation_steps=4))
    with pytest.raises(ValueError, match="positive int"):
        DeepSpeedPlugin(gradient_accumulation_steps=0)
