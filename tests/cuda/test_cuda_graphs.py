"""CUDA: regional compilation with CUDA graphs (mode="reduce-overhead"), for inference and for
AdamW training: no overwritten outputs, the same numbers as eager, and cloned outputs stay right.

Needs a CUDA GPU (skipped without one); the oracle is the same model run eagerly, never Kiln's code.
"""

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from toy_models import tiny_llama

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = torch.device("cuda")
LAYERS = 3
STEPS = 10
PLUGIN = dict(backend="inductor", mode="reduce-overhead", fullgraph=True, dynamic=False,
              use_regional_compilation=True)
# fp32 throughout: CUDA graphs replay the kernels of mode="default", which only fuse and reorder
# float32 arithmetic (about 1e-6 apart); ten AdamW steps at lr 1e-3 stay well inside 1e-4.
TOLERANCE = 1e-4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """|actual - expected| / |expected| over the whole tensor."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).norm() / expected.norm()).item()


def model_and_reference():
    model = tiny_llama(LAYERS)
    reference = tiny_llama(LAYERS)
    reference.load_state_dict(model.state_dict())
    return model, reference.to(DEVICE)


def record_first_block_output(model) -> list[torch.Tensor]:
    """The outputs of the model's first decoder layer, one per call, as a user's forward hook sees
    them. (Not `output_hidden_states=True`: transformers 5 collects those with hooks on the attention
    modules too, inside the compiled block, and Dynamo cannot trace their ContextVar.get.)"""
    outputs = []

    def keep(module, args, output):
        outputs.append(output[0] if isinstance(output, tuple) else output)

    model.model.layers[0].register_forward_hook(keep)
    return outputs


def check_replayed_in_place(addresses: list[int]) -> None:
    """Layer 0's output is a CUDA-graph buffer when the graph replays: the same address at every
    replay, although the caller still holds the previous steps' outputs. Eager memory could not
    reuse an address still held, so this proves CUDA graphs ran (Inductor may skip them with no
    more than a log line)."""
    assert len(set(addresses[-3:])) == 1, f"layer 0's output moved between steps: {addresses}"


def check_report(accelerator: Accelerator) -> None:
    report = accelerator.compile_report()
    (region,) = report.regions
    assert (region.name, region.instances, region.graphs) == ("LlamaDecoderLayer", LAYERS, 1), report.table()
    assert (region.compiled_calls, region.eager_calls) == (LAYERS * STEPS, 0), report.table()


def test_cudagraph_inference_matches_eager_and_a_cloned_output_survives_later_steps():
    model, reference = model_and_reference()
    model.eval()
    reference.eval()
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(**PLUGIN))
    model = accelerator.prepare(model)
    block_outputs, expected_block_outputs = record_first_block_output(model), record_first_block_output(reference)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randint(0, 97, (2, 32), generator=generator).to(DEVICE) for _ in range(STEPS)]
    held, addresses = [], []
    with torch.no_grad():
        for step, ids in enumerate(inputs):
            # A new input each step: a stale block output would show up as wrong logits.
            out = model(input_ids=ids, use_cache=False)
            expected = reference(input_ids=ids, use_cache=False)
            assert relative_error(out.logits, expected.logits) <= TOLERANCE, f"step {step}"
            block_output = block_outputs[step]  # layer 0's output, straight from its graph
            assert relative_error(block_output, expected_block_outputs[step]) <= TOLERANCE, f"step {step}"
            addresses.append(block_output.data_ptr())
            held.append(block_output)  # not cloned: the next step may overwrite it
            if step == 0:
                kept = block_output.clone()
    # The README's rule for CUDA graphs: clone what you keep across calls; the clone is still right.
    assert relative_error(kept, expected_block_outputs[0]) <= TOLERANCE
    check_replayed_in_place(addresses)
    check_report(accelerator)


def test_cudagraph_training_with_adamw_matches_eager_for_ten_steps():
    model, reference = model_and_reference()
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(**PLUGIN))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    block_outputs, expected_block_outputs = record_first_block_output(model), record_first_block_output(reference)
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 97, (2, 32), generator=generator).to(DEVICE) for _ in range(2)]
    losses, expected_losses, held, addresses = [], [], [], []
    for step in range(STEPS):
        ids = batches[step % 2]
        out = model(input_ids=ids, labels=ids, use_cache=False)
        block_output = block_outputs[step].detach()  # layer 0's output: the same memory, no autograd graph
        block_outputs[step] = None  # let the step's autograd graph go after backward
        addresses.append(block_output.data_ptr())
        held.append(block_output)  # not cloned: the next step may overwrite it
        if step == 0:
            kept = block_output.clone()
        accelerator.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()

        expected = reference(input_ids=ids, labels=ids, use_cache=False)
        expected.loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)

        assert relative_error(out.logits, expected.logits) <= TOLERANCE, f"step {step}"
        losses.append(out.loss.item())
        expected_losses.append(expected.loss.item())
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, expected_losses)]
    assert max(errors) <= TOLERANCE, f"losses {losses} against eager {expected_losses}"
    assert expected_losses[-1] < expected_losses[0] - 0.1  # the steps trained: the weights changed
    assert relative_error(kept, expected_block_outputs[0]) <= TOLERANCE
    for (name, a), b in zip(reference.named_parameters(), model.parameters()):
        assert relative_error(b, a) <= TOLERANCE, name
    check_replayed_in_place(addresses)
    check_report(accelerator)
