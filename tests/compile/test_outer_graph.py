"""compile_regions(outer_graph=True): the whole model one graph, each block class one shared subgraph
(kiln/compile/outer_graph.py). aot_eager: Dynamo traces the nested regions as Inductor would get them."""

import copy

import pytest
import torch

from kiln.compile import outer_graph
from kiln.compile.regions import compile_regions, compiled_regions, uncompile
from kiln.compile.report import compile_report
from toy_models import tiny_llama

pytestmark = pytest.mark.skipif(not outer_graph.supported(), reason="torch without nested_compile_region")


def _step(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), out.logits.detach(), grads


def test_one_graph_calls_one_shared_block_subgraph_with_eagers_numbers():
    torch.manual_seed(0)
    eager = tiny_llama(layers=4, width=64, init_std=0.08)
    model = compile_regions(copy.deepcopy(eager), backend="aot_eager", outer_graph=True)
    ids = torch.randint(0, 97, (2, 16))
    for _ in range(2):  # the second step runs the first step's graph
        expected, got = _step(eager, ids), _step(model, ids)
        assert torch.allclose(got[0], expected[0], atol=1e-6) and torch.allclose(got[1], expected[1], atol=1e-5)
        for name, grad in expected[2].items():
            assert torch.allclose(got[2][name], grad, atol=1e-6), name
    (region,) = compiled_regions(model)
    assert region.kind == "outer" and region.shared_blocks == {"LlamaDecoderLayer": 4}
    assert region.graphs == 1 and region.calls == 2 and region.eager_calls == 0
    # One subgraph, traced once, called at each of the four layers.
    assert list(region.backend.graphs[0].subgraphs.values()) == [4]
    report = compile_report(model)
    assert report.regions[0].subgraph_calls == region.backend.graphs[0].subgraphs
    assert "blocks as shared subgraphs: LlamaDecoderLayer x4; 1 subgraph(s) in its last graph (4 call site(s))" \
        in report.table()


def test_evaluation_compiles_a_second_graph_and_eager_runs_after_uncompile():
    torch.manual_seed(0)
    eager = tiny_llama(layers=3, width=64)
    model = compile_regions(copy.deepcopy(eager), backend="aot_eager", outer_graph=True)
    ids = torch.randint(0, 97, (2, 16))
    with torch.no_grad():
        assert torch.allclose(model(input_ids=ids, use_cache=False).logits,
                              eager(input_ids=ids, use_cache=False).logits, atol=1e-5)
    (region,) = compiled_regions(model)
    assert region.graphs == 1 and region.calls == 1
    copied = copy.deepcopy(model)  # the blocks' forwards are bound methods: a copy calls its own blocks
    assert copied.model.layers[0].forward.__self__ is copied.model.layers[0]
    uncompile(model)
    assert compiled_regions(model) == []
    assert all("forward" not in vars(block) for block in model.model.layers) and "forward" not in vars(model)


def test_precompiled_regions_and_a_torch_without_nested_regions_are_refused(monkeypatch, tmp_path):
    with pytest.raises(NotImplementedError, match="choose one of the two"):
        compile_regions(tiny_llama(layers=2), backend="aot_eager", outer_graph=True, fullgraph=True,
                        precompile=tmp_path)
    monkeypatch.delattr(torch.compiler, "nested_compile_region")
    with pytest.raises(RuntimeError, match="needs torch.compiler.nested_compile_region"):
        compile_regions(tiny_llama(layers=2), backend="aot_eager", outer_graph=True)


def test_inductors_buffer_reuse_is_off_in_the_outer_graph_and_asking_for_it_is_refused():
    # Buffer reuse gave wrong gradients there (torch 2.13, 2.14.1): the real compile is in test_inductor.py.
    model = compile_regions(tiny_llama(layers=2), backend="inductor", outer_graph=True, options={"max_autotune": False})
    (region,) = compiled_regions(model)
    assert region.backend.inner.config["allow_buffer_reuse"] is False
    assert region.backend.inner.config["max_autotune"] is False  # the user's options kept
    with pytest.raises(ValueError, match="buffer reuse gives wrong gradients"):
        compile_regions(tiny_llama(layers=2), backend="inductor", outer_graph=True,
                        options={"allow_buffer_reuse": True})
    # Per-block regions call no nested region: their settings are the user's.
    (block,) = compiled_regions(compile_regions(tiny_llama(layers=2), backend="inductor"))
    assert "allow_buffer_reuse" not in block.backend.inner.config


def test_the_accelerator_trains_with_an_outer_graph_like_the_plain_loop():
    """TorchDynamoPlugin(use_regional_compilation=True, outer_graph=True) through prepare: AdamW
    steps with the plain eager loop's losses, one graph a step, the blocks one shared subgraph."""
    from kiln import Accelerator, TorchDynamoPlugin

    torch.manual_seed(0)
    plain = tiny_llama(layers=3, width=64, init_std=0.08)
    model = copy.deepcopy(plain)
    ids = torch.randint(0, 97, (4, 16))
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    expected = []
    for _ in range(3):
        loss = plain(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        plain_optimizer.step()
        plain_optimizer.zero_grad()
        expected.append(loss.item())
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True, outer_graph=True, cache=False)
    accelerator = Accelerator(dynamo_plugin=plugin, cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    got = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        got.append(loss.item())
    assert got == pytest.approx(expected, abs=1e-6)
    (region,) = accelerator.compile_report().regions
    assert region.kind == "outer" and region.compiled_calls == 3 and region.graphs == 1
    assert region.shared_blocks == {"LlamaDecoderLayer": 3} and list(region.subgraph_calls.values()) == [3]


@pytest.mark.parametrize("settings, error, message", [
    (dict(outer_graph=True), ValueError, "set use_regional_compilation=True with it"),
    (dict(use_regional_compilation=True, outer_graph=True, precompile=True), ValueError, "choose one of the two"),
    (dict(use_regional_compilation=True, outer_graph="yes"), TypeError, "must be a bool"),
])
def test_the_plugin_refuses_an_outer_graph_it_cannot_build(settings, error, message):
    from kiln import TorchDynamoPlugin

    with pytest.raises(error, match=message):
        TorchDynamoPlugin(backend="aot_eager", **settings)


def test_the_setting_reads_from_the_environment_and_sharded_strategies_refuse_it():
    from kiln import TorchDynamoPlugin
    from kiln.parallel.fsdp import FSDPStrategy, FullyShardedDataParallelPlugin

    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True,
                               environ={"KILN_DYNAMO_OUTER_GRAPH": "true"})
    assert plugin.outer_graph is True
    strategy = FSDPStrategy(FullyShardedDataParallelPlugin(), torch.device("cpu"))  # what 2+ processes get
    with pytest.raises(NotImplementedError, match="outer_graph=True.*FSDP2"):
        strategy.check_compile(plugin)


def test_transformers_gradient_checkpointing_stays_inside_the_one_graph():
    """Each block checkpoints itself inside the outer graph (Dynamo told not to replay the layer's
    context-variable side effect in the recompute, as for per-block regions): one graph, the blocks
    one subgraph, eager-with-checkpointing's numbers. Before, the graph broke at every block."""
    torch.manual_seed(0)
    eager = tiny_llama(layers=3, width=64, init_std=0.08)
    eager.gradient_checkpointing_enable()
    model = compile_regions(copy.deepcopy(eager), backend="aot_eager", outer_graph=True)
    ids = torch.randint(0, 97, (2, 16))
    expected, got = _step(eager, ids), _step(model, ids)
    assert torch.allclose(got[0], expected[0], atol=1e-6)
    for name, grad in expected[2].items():
        assert torch.allclose(got[2][name], grad, atol=1e-6), name
    (region,) = compiled_regions(model)
    assert region.graphs == 1 and not region.graph_breaks
    assert list(region.backend.graphs[0].subgraphs.values()) == [3]


def test_blocks_inlined_instead_of_shared_are_said_once():
    """An outer graph whose blocks Dynamo inlined (here: never wrapped as nested regions) compiles
    like a full compile; one warning says so, not a silent loss of the shared code."""
    from kiln.compile.regions import KilnCompileWarning

    model = tiny_llama(layers=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(outer_graph, "share_block_code", lambda forward, instances: None)
        compile_regions(model, backend="aot_eager", outer_graph=True)
    ids = torch.randint(0, 97, (2, 16))
    with pytest.warns(KilnCompileWarning, match="holds no shared block subgraph"):
        model(input_ids=ids, use_cache=False)
    with torch.no_grad():  # a second graph: no second warning
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error", KilnCompileWarning)
            model(input_ids=ids, use_cache=False)
    assert compiled_regions(model)[0].graphs == 2


def test_float8_layers_are_refused():
    """torchao's Float8Linear blocks are inlined, not shared, and the whole graph's gradients differ
    from eager's (0.045 on this model, as a full compile's do): refused, per-block regions named."""
    pytest.importorskip("torchao")
    from kiln.fp8 import convert_to_fp8

    model = tiny_llama(layers=4, width=64)
    convert_to_fp8(model)
    with pytest.raises(NotImplementedError, match="float8 layers .* use per-block regions"):
        compile_regions(model, backend="aot_eager", outer_graph=True)
