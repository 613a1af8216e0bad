"""outer_graph="auto", the default of `compile_regions` and `TorchDynamoPlugin`: the outer graph
compiled in the background (tier_up.py) where Kiln knows it works, per-block regions alone
elsewhere, and the compile report says which and why. Nothing here calls a model with Inductor
(compile_regions compiles at the first call); tests/compile/test_inductor.py trains through the
default's switch with real Inductor."""

import warnings

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile import outer_graph
from kiln.compile.regions import KilnCompileWarning, compile_regions, compiled_regions
from kiln.compile.report import compile_report
from toy_models import tiny_llama

pytestmark = pytest.mark.skipif(not outer_graph.supported(), reason="torch without nested_compile_region")


@pytest.fixture
def default_setting(monkeypatch):
    monkeypatch.delenv("KILN_DYNAMO_OUTER_GRAPH", raising=False)  # the tests' conftest turns the default off


def test_a_cpu_model_compiled_with_inductor_gets_the_background_outer_graph_by_default(default_setting):
    model = compile_regions(tiny_llama(layers=2), backend="inductor")
    block, outer = compiled_regions(model)
    assert (block.kind, outer.kind, outer.tier_up.auto, block.outer_off) == ("block", "outer", True, "")


def test_the_documented_settings_get_it_through_prepare(default_setting):
    plugin = TorchDynamoPlugin(backend="inductor", use_regional_compilation=True)
    assert plugin.outer_graph == "auto"
    model = Accelerator(dynamo_plugin=plugin, cpu=True).prepare(tiny_llama(layers=2))
    assert [r.kind for r in compiled_regions(model)] == ["block", "outer"]


@pytest.mark.parametrize("settings, why", [
    ({"backend": "aot_eager"}, "backend 'aot_eager': the helper hands the outer graph over through Inductor's caches"),
    ({"backend": "inductor", "dynamic": True}, "dynamic=True: not yet measured"),
    ({"backend": "inductor", "fullgraph": True, "precompile": "FOLDER"}, "precompiled regions are compiled per block"),
])
def test_where_it_does_not_apply_the_blocks_are_compiled_alone_and_the_report_says_why(default_setting, tmp_path,
                                                                                       settings, why):
    settings = {k: str(tmp_path) if v == "FOLDER" else v for k, v in settings.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnCompileWarning)  # not asked for: no warning
        model = compile_regions(tiny_llama(layers=2), **settings)
    (block,) = compiled_regions(model)
    assert block.outer_off.startswith(why)
    assert f"LlamaDecoderLayer: no outer graph (outer_graph='auto'): {why}" in compile_report(model).table()


def test_cuda_graphs_keep_per_block_regions():
    choice = outer_graph.choose(tiny_llama(layers=2), {"backend": "inductor"}, precompiled=False, cudagraphs=True)
    assert choice == (False, "CUDA graphs: not yet measured with an outer graph")


def test_turned_off_or_asked_for_by_the_environment(monkeypatch):
    monkeypatch.setenv("KILN_DYNAMO_OUTER_GRAPH", "false")
    model = compile_regions(tiny_llama(layers=2), backend="inductor")
    (block,) = compiled_regions(model)
    assert block.outer_off == "" and "outer_graph" not in compile_report(model).table()
    monkeypatch.setenv("KILN_DYNAMO_OUTER_GRAPH", "Background")
    assert TorchDynamoPlugin(use_regional_compilation=True).outer_graph == "background"
    monkeypatch.setenv("KILN_DYNAMO_OUTER_GRAPH", "sometimes")
    with pytest.raises(ValueError, match="KILN_DYNAMO_OUTER_GRAPH='sometimes': use true, false, background or auto"):
        compile_regions(tiny_llama(layers=2), backend="inductor")
    with pytest.raises(ValueError, match="use true, false, background or auto"):
        TorchDynamoPlugin(use_regional_compilation=True)


def test_the_default_sits_quietly_beside_settings_the_explicit_outer_graph_refuses(default_setting):
    # outer_graph=True or "background" beside precompile=True, or without regional compile, is an
    # error; "auto" leaves the per-block regions (or the full compile) alone.
    assert TorchDynamoPlugin(precompile=True, use_regional_compilation=True).outer_graph == "auto"
    assert TorchDynamoPlugin().outer_graph == "auto"
    with pytest.raises(ValueError, match="precompiles each block on its own"):
        TorchDynamoPlugin(precompile=True, use_regional_compilation=True, outer_graph="background")
    with pytest.raises(TypeError, match="a bool, 'background' or 'auto'"):
        TorchDynamoPlugin(use_regional_compilation=True, outer_graph="always")


def test_a_model_found_on_an_unverified_device_at_its_first_call_stays_per_block_without_a_helper(
        default_setting, monkeypatch):
    """The model may be moved after compile_regions (to a GPU, where the background outer graph has
    not been run yet): its first call decides, starts no helper and warns nothing."""
    import kiln.compile.tier_up as tier_up

    model = compile_regions(tiny_llama(layers=2), backend="inductor")
    block, outer = compiled_regions(model)
    monkeypatch.setattr(tier_up, "off_device", lambda module: "a model on cuda: not yet verified there")
    # The per-block path, without Inductor's compile: the blocks' regions run their base forward.
    monkeypatch.setattr(outer, "base_forward", lambda module, *a, **k: "per-block")
    with warnings.catch_warnings():
        warnings.simplefilter("error", KilnCompileWarning)
        assert [model(input_ids=torch.zeros(1, 4, dtype=torch.long)) for _ in range(3)] == ["per-block"] * 3
    assert outer.tier_up.off and outer.tier_up.compiler is None and outer.tier_up.per_block_calls == 3
    assert "kept on the per-block regions: a model on cuda: not yet verified there" in compile_report(model).table()


def test_one_process_of_several_keeps_per_block_regions(default_setting, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    (block,) = compiled_regions(compile_regions(tiny_llama(layers=2), backend="inductor"))
    assert block.outer_off.startswith("several processes")


def test_training_threads_that_fill_every_core_keep_per_block_regions_at_full_speed(default_setting, monkeypatch):
    """"auto" lends the helper no thread of training's ("background" does): where training fills
    every core, it stays on its per-block regions with all its threads, and starts no helper."""
    import kiln.compile.artifacts.background as background

    monkeypatch.setattr(background, "free_cores", lambda: 2)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = compile_regions(tiny_llama(layers=2), backend="inductor")
        block, outer = compiled_regions(model)
        monkeypatch.setattr(outer, "base_forward", lambda module, *a, **k: "per-block")
        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnCompileWarning)
            assert [model(input_ids=torch.zeros(1, 4, dtype=torch.long)) for _ in range(3)] == ["per-block"] * 3
        assert torch.get_num_threads() == 2 and outer.tier_up.off and outer.tier_up.compiler is None
        # The blocks call their own regions again, without the shared-code wrapper's frame.
        assert all(layer.forward.__func__ is block.compiled_forward for layer in model.model.layers)
        assert ("kept on the per-block regions: training's 2 thread(s) fill this process's 2 core(s)"
                in compile_report(model).table())
        # The outer region not running is by design (the blocks are silent here: base_forward is a stub).
        assert compile_report(model).silent_regions == ["LlamaDecoderLayer"]
    finally:
        torch.set_num_threads(threads)
