import pytest

from kiln import Accelerator, TorchDynamoPlugin


def test_plugin_defaults_to_inductor_with_tristate_dynamic_none():
    plugin = TorchDynamoPlugin(environ={})
    assert plugin.backend == "inductor"
    assert plugin.mode is None and plugin.dynamic is None
    assert plugin.fullgraph is False and plugin.use_regional_compilation is False
    assert plugin.to_compile_kwargs() == {"backend": "inductor", "fullgraph": False, "dynamic": None}


def test_plugin_reads_every_setting_from_environment():
    env = {
        "KILN_DYNAMO_BACKEND": "AOT_EAGER",
        "KILN_DYNAMO_MODE": "default",
        "KILN_DYNAMO_USE_FULLGRAPH": "true",
        "KILN_DYNAMO_USE_DYNAMIC": "false",
        "KILN_DYNAMO_USE_REGIONAL_COMPILATION": "1",
    }
    plugin = TorchDynamoPlugin(environ=env)
    assert plugin.backend == "aot_eager"  # Accelerate's upper-case spelling is accepted
    assert plugin.mode == "default"
    assert plugin.fullgraph is True
    assert plugin.dynamic is False
    assert plugin.use_regional_compilation is True


@pytest.mark.parametrize("raw, expected", [("none", None), ("auto", None), ("true", True), ("0", False)])
def test_dynamic_environment_value_is_tristate(raw, expected):
    assert TorchDynamoPlugin(environ={"KILN_DYNAMO_USE_DYNAMIC": raw}).dynamic is expected


def test_arguments_win_over_environment():
    env = {"KILN_DYNAMO_BACKEND": "eager", "KILN_DYNAMO_USE_FULLGRAPH": "true"}
    plugin = TorchDynamoPlugin(backend="aot_eager", fullgraph=False, environ=env)
    assert plugin.backend == "aot_eager" and plugin.fullgraph is False


def test_unknown_backend_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown backend 'indutor'; choose one of: .*inductor"):
        TorchDynamoPlugin(backend="indutor")


def test_unknown_mode_names_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"unknown mode 'fast'; choose one of: .*max-autotune"):
        TorchDynamoPlugin(mode="fast")


def test_mode_together_with_options_is_an_error():
    with pytest.raises(ValueError, match="both given"):
        TorchDynamoPlugin(mode="max-autotune", options={"epilogue_fusion": True})


def test_inductor_mode_with_another_backend_is_an_error():
    with pytest.raises(ValueError, match="Inductor setting"):
        TorchDynamoPlugin(backend="aot_eager", mode="max-autotune")


def test_non_boolean_environment_string_is_an_error():
    with pytest.raises(ValueError, match=r"KILN_DYNAMO_USE_FULLGRAPH='maybe' is not a boolean"):
        TorchDynamoPlugin(environ={"KILN_DYNAMO_USE_FULLGRAPH": "maybe"})


def test_non_boolean_argument_is_an_error():
    with pytest.raises(TypeError, match="fullgraph must be a bool"):
        TorchDynamoPlugin(fullgraph="yes")


def test_block_choice_without_regional_compilation_is_an_error():
    with pytest.raises(ValueError, match="use_regional_compilation=True"):
        TorchDynamoPlugin(block_classes=["GPT2Block"])


def test_backend_no_in_a_plugin_is_an_error():
    with pytest.raises(ValueError, match="means 'no compile'"):
        TorchDynamoPlugin(backend="no")


def test_accelerator_short_form_builds_a_plugin():
    accelerator = Accelerator(dynamo_backend="aot_eager")
    assert accelerator.dynamo_plugin.backend == "aot_eager"


def test_accelerator_rejects_both_forms():
    with pytest.raises(ValueError, match="either dynamo_plugin or dynamo_backend"):
        Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="eager"), dynamo_backend="eager")


def test_accelerator_reads_backend_from_environment(monkeypatch):
    monkeypatch.setenv("KILN_DYNAMO_BACKEND", "aot_eager")
    assert Accelerator().dynamo_plugin.backend == "aot_eager"
    monkeypatch.setenv("KILN_DYNAMO_BACKEND", "no")
    assert Accelerator().dynamo_plugin is None


def test_no_compile_by_default():
    assert Accelerator().dynamo_plugin is None
