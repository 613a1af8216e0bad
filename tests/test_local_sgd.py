"""kiln.local_sgd.LocalSGD on one process: a context that changes nothing, and clear errors for bad
input and for strategies that cannot average parameters (two processes: tests/distributed/)."""

import pytest
import torch

import kiln.utils
from kiln import Accelerator
from kiln.local_sgd import LocalSGD
from kiln.parallel.fsdp import FSDPStrategy, FullyShardedDataParallelPlugin
from toy_models import Regressor


def batches(n=5):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 3, 8, generator=generator), torch.randn(4, 3, generator=generator)) for _ in range(n)]


def prepared():
    acc = Accelerator()
    model = Regressor()
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return acc, model, optimizer


def test_local_sgd_on_one_process_trains_as_without_it():
    torch.manual_seed(0)
    acc, model, optimizer = prepared()
    torch.manual_seed(0)
    plain = Regressor()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    with LocalSGD(accelerator=acc, model=model, local_sgd_steps=2) as local_sgd:
        for x, y in batches():
            with acc.accumulate(model):
                loss = model(x, y)["loss"]
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                local_sgd.step()
            plain_loss = plain(x, y)["loss"]
            plain_loss.backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad()
            assert loss.item() == plain_loss.item()
    assert local_sgd.enabled is False and local_sgd.num_steps == 5
    for ours, theirs in zip(model.parameters(), plain.parameters()):
        assert torch.equal(ours, theirs)


def test_kiln_utils_exports_the_local_sgd_class():
    assert kiln.utils.LocalSGD is LocalSGD


@pytest.mark.parametrize("steps", [0, -3, 2.5, True, None, "8"])
def test_local_sgd_steps_must_be_a_positive_int(steps):
    acc, model, _ = prepared()
    with pytest.raises(ValueError, match=f"local_sgd_steps must be a positive int .*got {steps!r}; pass enabled=False"):
        LocalSGD(accelerator=acc, model=model, local_sgd_steps=steps)


def test_disabled_local_sgd_takes_no_steps_and_counts_calls():
    # Accelerate's example passes enabled=local_sgd_steps is not None.
    acc, model, _ = prepared()
    local_sgd = LocalSGD(accelerator=acc, model=model, local_sgd_steps=None, enabled=False)
    local_sgd.step()
    assert local_sgd.num_steps == 1 and local_sgd.enabled is False


def test_a_model_prepare_did_not_return_is_refused():
    acc, _, _ = prepared()
    with pytest.raises(ValueError, match="got a Regressor that this Accelerator did not return from prepare"):
        LocalSGD(accelerator=acc, model=Regressor(), local_sgd_steps=2)


def fsdp():
    return FSDPStrategy(FullyShardedDataParallelPlugin())


def deepspeed():
    from kiln.parallel.deepspeed import DeepSpeedPlugin, DeepSpeedStrategy

    return DeepSpeedStrategy(DeepSpeedPlugin(zero_stage=2), "no", 1)


@pytest.mark.parametrize("strategy", [fsdp, deepspeed])
def test_fsdp_and_deepspeed_are_refused_with_the_reason(strategy):
    acc, model, _ = prepared()
    acc.strategy = strategy()  # what two processes with fsdp_plugin= or deepspeed_plugin= choose
    name = acc.strategy.name
    with pytest.raises(NotImplementedError, match=f"LocalSGD is not supported with {name}: .*train with DDP"):
        LocalSGD(accelerator=acc, model=model, local_sgd_steps=2)
    with pytest.raises(NotImplementedError, match=f"{name} cannot average parameters across processes"):
        acc.strategy.average_parameters(model)
    LocalSGD(accelerator=acc, model=model, local_sgd_steps=2, enabled=False)  # disabled: nothing to refuse
