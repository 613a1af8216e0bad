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
    # bf16 is Kiln's autocast around the fp32 engine unless the config turns DeepSpeed's bf16 on.
    assert built["bf16"] == {"enabled": False} and built["fp16"] == {"enabled": False}
    assert user["zero_optimization"]["stage"] == "auto"  # the user's dict is left as it was


def test_defaults_are_the_plain_loops_arithmetic():
    built = config()
    assert built["zero_optimization"]["stage"] == 2
    # DeepSpeed's own default clips at 1.0; a plain loop clips only when asked.
    assert built["gradient_clipping"] == 0.0
    assert built["prescale_gradients"] is False and built["gradient_predivide_factor"] == 1.0
    assert "communication_data_type" not in built  # fp32 weights: DeepSpeed reduces in fp32


def test_deepspeeds_own_half_precision_reduces_in_fp32_and_scales_like_grad_scaler():
    own_bf16 = config(DeepSpeedPlugin(hf_ds_config={"bf16": {"enabled": True}}), "bf16")
    assert own_bf16["bf16"] == {"enabled": True} and own_bf16["communication_data_type"] == "fp32"
    fp16 = config(precision="fp16")
    assert fp16["communication_data_type"] == "fp32"
    # torch.amp.GradScaler(): 2**16 to start, halve at every overflow, double after 2000 clean steps.
    assert fp16["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000,
                            "hysteresis": 1, "consecutive_hysteresis": False}


def test_the_users_own_values_win_over_kilns_defaults():
    user = {"gradient_clipping": 0.5, "communication_data_type": "bf16", "prescale_gradients": True,
            "fp16": {"enabled": True, "hysteresis": 2, "loss_scale_window": "auto"}}
    built = config(DeepSpeedPlugin(hf_ds_config=user), "fp16")
    assert built["gradient_clipping"] == 0.5 and built["communication_data_type"] == "bf16"
    assert built["prescale_gradients"] is True
    assert built["fp16"]["hysteresis"] == 2 and built["fp16"]["loss_scale_window"] == 2000


def test_the_built_config_is_read_by_deepspeed_as_meant():
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    import torch

    read = DeepSpeedConfig(config(precision="fp16", accumulation=2))
    assert read.gradient_clipping == 0.0 and read.communication_data_type == torch.float32
    assert (read.float16_config.hysteresis, read.float16_config.loss_scale_window) == (1, 2000)
    assert read.prescale_gradients is False and read.gradient_predivide_factor == 1.0


@pytest.mark.parametrize("user, plugin, precision, accumulation, message", [
    ({"zero_optimization": {"stage": 3}}, {"zero_stage": 2}, "no", 1, "zero_optimization.stage=3"),
    ({"gradient_accumulation_steps": 8}, {}, "no", 2, "gradient_accumulation_steps=8"),
    ({"bf16": {"enabled": True}}, {}, "no", 1, "bf16.enabled=True"),
    ({"bf16": {"enabled": True}}, {}, "fp16", 1, "bf16.enabled=True"),
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


def test_clip_grad_norm_must_ask_for_the_norm_the_engine_clips_to():
    pytest.importorskip("deepspeed")
    from types import SimpleNamespace

    from kiln.parallel.deepspeed import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(DeepSpeedPlugin(), "no", 1)
    strategy.engine = SimpleNamespace(gradient_clipping=lambda: 0.0, get_global_grad_norm=lambda: 2.5)
    with pytest.raises(ValueError, match=r"built without clipping.*DeepSpeedPlugin\(gradient_clipping=1.0\)"):
        strategy.clip_grad_norm(1.0)
    strategy.engine = SimpleNamespace(gradient_clipping=lambda: 1.0, get_global_grad_norm=lambda: 2.5)
    assert strategy.clip_grad_norm(1.0).item() == 2.5  # the norm before clipping, as clip_grad_norm_ returns
