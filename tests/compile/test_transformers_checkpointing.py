"""transformers' gradient checkpointing on a prepared, regionally compiled model: switched on, changed
and off after prepare, each block call compiled with the recompute in the block's own graph, and the
losses and gradients of eager with the same checkpointing."""

import copy

import torch

import kiln
from kiln import Accelerator, TorchDynamoPlugin
from toy_models import tiny_llama

PHASES = ("off", "non-reentrant", "reentrant", "off")
LAYERS = 3


def _set(model, phase: str) -> None:
    if phase == "off":
        model.gradient_checkpointing_disable()
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": phase == "reentrant"})


def _steps(model, accelerator, optimizer) -> list[tuple[float, dict]]:
    """One step per phase, the checkpointing switched on the prepared model before it."""
    ids = torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    out = []
    for phase in PHASES:
        _set(accelerator.unwrap_model(model), phase)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        out.append((loss.item(), grads))
    return out


def test_switching_checkpointing_after_prepare_recompiles_and_keeps_eagers_losses_and_gradients():
    torch.manual_seed(0)
    base = tiny_llama(layers=LAYERS, width=64, init_std=0.08)  # gradient norm about 3: not toy-small
    results = []
    for plugin in (None, TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True)):
        accelerator = Accelerator(dynamo_plugin=plugin)
        model = copy.deepcopy(base)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        model, optimizer = accelerator.prepare(model, optimizer)
        results.append(_steps(model, accelerator, optimizer))
    for phase, (eager_loss, eager_grads), (loss, grads) in zip(PHASES, *results):
        assert abs(loss - eager_loss) <= 1e-5, phase
        for name, grad in eager_grads.items():
            torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=0, msg=f"{phase}: {name}")
    (region,) = kiln.compile_report(model).regions
    assert region.compiled_calls == LAYERS * len(PHASES) and region.eager_calls == 0
    # Each switch is a recompile Dynamo names (the flag, then the checkpoint function), not a break.
    assert not region.graph_breaks
    assert any("gradient_checkpointing" in reason for reason in region.recompile_reasons), region.recompile_reasons
    assert region.graphs == 3  # off, non-reentrant, reentrant; the last phase reuses the first graph


def test_activation_checkpointing_of_every_nth_layer_compiles_each_kind_of_layer_once_with_eagers_gradients():
    # transformers 5.25's `activation_checkpointing_enable(every_n_layers=2)` (the new name of
    # gradient_checkpointing_enable) checkpoints layers 0 and 2 of 4: two kinds of the same class.
    if not hasattr(tiny_llama(layers=1), "activation_checkpointing_enable"):
        import pytest

        pytest.skip("this transformers has no activation_checkpointing_enable")
    torch.manual_seed(0)
    eager = tiny_llama(layers=4, width=64, init_std=0.08)
    model = copy.deepcopy(eager)
    for net in (eager, model):
        net.activation_checkpointing_enable(every_n_layers=2)
    kiln.compile_regions(model, backend="aot_eager", outer_graph=False)
    ids = torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(1))
    for net in (eager, model):
        net(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    for (name, a), b in zip(eager.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, atol=1e-6, rtol=1e-5, msg=name)
    regions = kiln.compile_report(model).regions
    assert [r.paths for r in regions] == [["model.layers.0", "model.layers.2"], ["model.layers.1", "model.layers.3"]]
    assert all(r.compiled_calls == 2 and r.eager_calls == 0 and r.graphs == 1 for r in regions)
