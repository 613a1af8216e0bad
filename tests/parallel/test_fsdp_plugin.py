"""FullyShardedDataParallelPlugin takes Accelerate's FSDP2 fields with their meaning, from Python,
from the FSDP_* variables and from `kiln launch`'s config file; FSDP1 is refused by name."""

import pytest
import torch
from torch.distributed.fsdp import MixedPrecisionPolicy

from kiln import FullyShardedDataParallelPlugin
from kiln.cli.settings import load_config_file, process_environment, resolve
from kiln.parallel.fsdp_plugin import ignored_parameters, shard_units
from toy_models import tiny_llama


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    import os

    for name in [n for n in os.environ if n.startswith("FSDP_")]:
        monkeypatch.delenv(name)


def test_accelerates_documented_fsdp2_plugin_is_accepted_as_written():
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
                                            state_dict_type="SHARDED_STATE_DICT")
    assert plugin.auto_wrap_policy == "transformer_based_wrap"
    assert plugin.reshard_after_forward is True and plugin.activation_checkpointing is False
    assert not plugin.writes_whole_checkpoints


def test_the_defaults_keep_the_plain_loops_arithmetic():
    policy = FullyShardedDataParallelPlugin().mp_policy()
    assert policy.param_dtype is None and policy.reduce_dtype == torch.float32


@pytest.mark.parametrize("given, expected", [
    ("bf16", (torch.bfloat16, torch.bfloat16)),  # Accelerate's meaning: reductions in bf16 too
    ("fp32", (torch.float32, torch.float32)),
    ({"param_dtype": "bf16", "reduce_dtype": torch.float32}, (torch.bfloat16, torch.float32)),
    (MixedPrecisionPolicy(param_dtype=torch.float16), (torch.float16, None)),
])
def test_mixed_precision_policy_has_accelerates_meaning(given, expected):
    policy = FullyShardedDataParallelPlugin(mixed_precision_policy=given).mp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == expected


@pytest.mark.parametrize("fields, message", [
    ({"fsdp_version": 1}, "FSDP2 .* only"),
    ({"sharding_strategy": "FULL_SHARD", "use_orig_params": True}, "sharding_strategy, use_orig_params: not an FSDP2"),
    ({"reshard_after_forward": "SHARD_GRAD_OP"}, "FSDP1 sharding strategy"),
    ({"auto_wrap_policy": "layer_wrap"}, "choose one of: transformer_based_wrap"),
    ({"auto_wrap_policy": "size_based_wrap"}, "needs min_num_params"),
    ({"min_num_params": 100}, "size_based_wrap' only"),
    ({"transformer_cls_names_to_wrap": ["X"]}, "transformer_based_wrap' only"),
    ({"state_dict_type": "LOCAL_STATE_DICT"}, "FSDP1's"),
    ({"mixed_precision": "bf16", "mixed_precision_policy": "bf16"}, "not both"),
    ({"mixed_precision_policy": {"param_dtype": "bf16", "buffer_dtype": "bf16"}}, "unknown field"),
    ({"activation_checkpointing_offload": True}, "does not offload"),
    ({"ignored_modules": "model.(layers"}, "missing"),
])
def test_bad_or_fsdp1_settings_fail_at_construction_naming_the_fix(fields, message):
    with pytest.raises(Exception, match=message):
        FullyShardedDataParallelPlugin(**fields)


def test_fields_left_unset_come_from_the_fsdp_variables(monkeypatch):
    for name, value in {"FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP",
                        "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer,LlamaMLP",
                        "FSDP_STATE_DICT_TYPE": "FULL_STATE_DICT", "FSDP_RESHARD_AFTER_FORWARD": "false",
                        "FSDP_ACTIVATION_CHECKPOINTING": "true", "FSDP_CPU_RAM_EFFICIENT_LOADING": "true",
                        "FSDP_USE_ORIG_PARAMS": "false"}.items():  # an FSDP1 variable at its default is harmless
        monkeypatch.setenv(name, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.transformer_cls_names_to_wrap == ["LlamaDecoderLayer", "LlamaMLP"]
    assert plugin.writes_whole_checkpoints and plugin.reshard_after_forward is False
    assert plugin.activation_checkpointing and plugin.cpu_ram_efficient_loading
    assert FullyShardedDataParallelPlugin(reshard_after_forward=True).reshard_after_forward is True  # arguments win
    monkeypatch.setenv("FSDP_SYNC_MODULE_STATES", "true")
    with pytest.raises(ValueError, match="FSDP_SYNC_MODULE_STATES=true .*cpu_ram_efficient_loading"):
        FullyShardedDataParallelPlugin()


def test_set_state_dict_type_switches_what_save_state_writes():
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_state_dict_type("FULL_STATE_DICT")
    assert plugin.writes_whole_checkpoints
    from torch.distributed.fsdp import StateDictType

    plugin.set_state_dict_type(StateDictType.SHARDED_STATE_DICT)
    assert not plugin.writes_whole_checkpoints


def test_the_wrap_policy_chooses_the_units_deepest_first():
    model = tiny_llama(layers=2)
    blocks = ["model.layers.0", "model.layers.1"]
    units = lambda **fields: shard_units(model, FullyShardedDataParallelPlugin(**fields), blocks)  # noqa: E731
    assert units() == blocks  # Kiln's default: each repeated block
    assert units(auto_wrap_policy="no_wrap") == []
    assert sorted(units(auto_wrap_policy="transformer_based_wrap")) == blocks  # from _no_split_modules
    chosen = units(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["LlamaMLP",
                                                                                              "LlamaDecoderLayer"])
    assert chosen.index("model.layers.0.mlp") < chosen.index("model.layers.0")
    block_size = sum(p.numel() for p in model.model.layers[0].parameters())
    by_size = units(auto_wrap_policy="size_based_wrap", min_num_params=block_size - 1)
    assert set(blocks) <= set(by_size) and "model.layers.0.mlp" not in by_size and "model" in by_size
    assert units(auto_wrap_policy=lambda m: type(m).__name__ == "LlamaRMSNorm")[-1] == "model.norm"
    with pytest.raises(ValueError, match="does not hold; its module classes: .*LlamaDecoderLayer"):
        units(auto_wrap_policy="transformer_based_wrap", transformer_cls_names_to_wrap=["GPT2Block"])


def test_ignored_modules_by_expression_must_match_something():
    model = tiny_llama(layers=2)
    assert ignored_parameters(model, r"model\.norm") == {model.model.norm.weight}
    with pytest.raises(ValueError, match="matches no module"):
        ignored_parameters(model, "decoder")


def test_launch_config_takes_accelerates_fsdp_config_and_exports_the_fsdp_variables(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text("distributed_type: FSDP\nnum_processes: 2\nfsdp_config:\n  fsdp_version: 2\n"
                      "  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP\n"
                      "  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer\n"
                      "  fsdp_state_dict_type: FULL_STATE_DICT\n  fsdp_reshard_after_forward: false\n")
    env = process_environment(resolve({}, load_config_file(config)))
    assert env["FSDP_AUTO_WRAP_POLICY"] == "transformer_based_wrap"
    assert env["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"
    assert env["FSDP_RESHARD_AFTER_FORWARD"] == "false" and env["KILN_DISTRIBUTED_TYPE"] == "fsdp"
    config.write_text("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n")
    with pytest.raises(ValueError, match="fsdp_sharding_strategy: FSDP1 .*fsdp_reshard_after_forward"):
        load_config_file(config)
    config.write_text("distributed_type: ddp\nfsdp_version: 2\n")
    with pytest.raises(ValueError, match="fsdp_version is a fsdp setting"):
        resolve({}, load_config_file(config))


def test_a_unit_inside_a_compiled_block_is_refused_before_sharding():
    from kiln.parallel.fsdp import _refuse_units_inside_regions

    _refuse_units_inside_regions(["model.layers.0", "model.layers.1"], ["model.layers.0", "model.layers.1"])
    with pytest.raises(ValueError, match="'model.layers.0.mlp' lies inside the compiled block 'model.layers.0'"):
        _refuse_units_inside_regions(["model.layers.0.mlp", "model.layers.0"], ["model.layers.0", "model.layers.1"])
