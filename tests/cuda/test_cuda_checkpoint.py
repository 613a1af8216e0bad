"""CUDA: `Accelerator.save_model` of a model trained on the GPU (compiled regionally with Inductor)
loads with `kiln.load_model` into a fresh model on the CPU, with the same weights and outputs.

Needs a CUDA GPU (skipped without one); the oracle is the trained GPU model itself.
"""

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin, load_model
from toy_models import tiny_gpt2, tiny_llama

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = torch.device("cuda")
LAYERS = 3
# test_cuda_compile's fp32 settings and shapes: in one session the second to run finds its compile
# in Inductor's cache.
PLUGIN = dict(backend="inductor", fullgraph=True, dynamic=False, use_regional_compilation=True)
# fp32 on two devices: the GPU's and the CPU's kernels sum in other orders, about 1e-6 apart.
TOLERANCE = 1e-4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """|actual - expected| / |expected| over the whole tensor."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).norm() / expected.norm()).item()


def tied(model) -> bool:
    return model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_save_model_of_a_cuda_model_loads_into_a_fresh_cpu_model(tmp_path, build):
    model = build(LAYERS)
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(**PLUGIN))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # trained weights, not the initial ones a fresh model could also have
        accelerator.backward(model(input_ids=ids.to(DEVICE), labels=ids.to(DEVICE), use_cache=False).loss)
        optimizer.step()
        optimizer.zero_grad()
    assert next(model.parameters()).device.type == DEVICE.type
    expected_logits = model(input_ids=ids.to(DEVICE), use_cache=False).logits.detach().cpu()
    trained = {k: v.detach().cpu() for k, v in model.state_dict().items()}

    accelerator.save_model(model, tmp_path / "out")

    torch.manual_seed(1)  # other initial weights, so equal weights below come from the file
    fresh = build(LAYERS)
    assert not torch.equal(fresh.state_dict()["lm_head.weight"], trained["lm_head.weight"])
    assert load_model(fresh, tmp_path / "out") is fresh
    state = fresh.state_dict()
    assert list(state) == list(trained)  # the plain model's keys, strict load
    for key, value in state.items():
        assert value.device.type == "cpu", key
        assert torch.equal(value, trained[key]), key
    assert tied(fresh) == tied(model)  # GPT-2 ties its head to the embedding; Llama does not
    fresh.eval()
    with torch.no_grad():
        logits = fresh(input_ids=ids, use_cache=False).logits
    assert relative_error(logits, expected_logits) <= TOLERANCE
