"""Real Inductor compiles (tens of seconds each on a CPU): the few places where code generation,
not just tracing, must be shown to work."""

import time

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile.regions import compile_regions, compiled_regions
from toy_models import tiny_llama

pytestmark = pytest.mark.inductor


def test_inductor_regional_training_step_matches_eager():
    torch.manual_seed(0)
    eager = tiny_llama(3)
    compiled = tiny_llama(3)
    compiled.load_state_dict(eager.state_dict())
    plugin = TorchDynamoPlugin(backend="inductor", fullgraph=True, dynamic=False, use_regional_compilation=True)
    accelerator = Accelerator(dynamo_plugin=plugin)
    compiled, optimizer = accelerator.prepare(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    ids = torch.randint(0, 97, (2, 16))
    expected = eager(input_ids=ids, labels=ids, use_cache=False).loss
    expected.backward()
    loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
    accelerator.backward(loss)
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=name)
    (region,) = compiled_regions(compiled)
    assert (region.name, region.instances, region.graphs, region.calls) == ("LlamaDecoderLayer", 3, 1, 3)
    optimizer.step()


@pytest.mark.warm_starts  # 18 s of gcc: CI's warm-starts lane, beside the other outer-graph Inductor test
def test_inductor_outer_graph_training_step_gives_eagers_gradients():
    # torch 2.13 and 2.14.1: with Inductor's buffer reuse on, a graph calling one nested region at
    # several call sites gave gradients off eager's by thousands (the loss right); aot_eager, which
    # the other outer-graph tests use, never showed it (kiln/compile/outer_graph.py compile_kwargs).
    torch.manual_seed(0)
    eager = tiny_llama(2, width=64, init_std=0.08)
    compiled = tiny_llama(2, width=64, init_std=0.08)
    compiled.load_state_dict(eager.state_dict())
    compile_regions(compiled, backend="inductor", outer_graph=True)
    ids = torch.randint(0, 97, (2, 16))
    for _ in range(2):
        expected = eager(input_ids=ids, labels=ids, use_cache=False).loss
        expected.backward()
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=name)
        eager.zero_grad()
        compiled.zero_grad()
    (region,) = compiled_regions(compiled)
    assert (region.kind, region.calls, region.backend.graphs[-1].subgraphs) == ("outer", 2, {"subgraph_0": 2})


@pytest.mark.warm_starts  # a helper's cold compile beside training's: about a minute, so CI's warm-starts lane
def test_inductor_outer_graph_compiled_in_the_background_is_found_in_the_caches(tmp_path, monkeypatch):
    """The default (outer_graph="auto": "background" for a CPU model with Inductor): the helper's
    compile fills Inductor's caches and passes its check against eager, and the training process's
    compile at the switch finds every graph there (no miss), with eager's gradients."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # empty: the helper fills it
    monkeypatch.delenv("KILN_DYNAMO_OUTER_GRAPH")  # the tests' conftest turns the default off
    torch.manual_seed(0)
    eager = tiny_llama(2, width=64, init_std=0.08)
    compiled = tiny_llama(2, width=64, init_std=0.08)
    compiled.load_state_dict(eager.state_dict())
    compile_regions(compiled, backend="inductor")
    block, outer = compiled_regions(compiled)
    ids = torch.randint(0, 97, (2, 16))
    began, after = time.monotonic(), 0
    while after < 2:
        expected = eager(input_ids=ids, labels=ids, use_cache=False).loss
        expected.backward()
        loss = compiled(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=name)
        eager.zero_grad()
        compiled.zero_grad()
        after += bool(outer.calls)
        assert time.monotonic() - began < 400, "the outer graph never took over"
    assert outer.cache_misses == 0 and outer.cache_hits > 0, (outer.cache_hits, outer.cache_misses)
    assert outer.calls == 2 and block.cache_misses > 0  # the blocks compiled cold, here
    assert outer.tier_up.auto and "checked against eager: worst relative difference" in " ".join(outer.tier_up.notes)
