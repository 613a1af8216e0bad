"""CUDA: regional compilation with Inductor, through `Accelerator.prepare`, computes what eager
PyTorch computes on transformers Llama and GPT-2 under fp32, bf16 and fp16 (with gradient scaling).

Needs a CUDA GPU (skipped without one); the oracle is a plain PyTorch loop, never Kiln's own code.
"""

import contextlib

import pytest
import torch

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile.regions import compiled_regions
from toy_models import tiny_gpt2, tiny_llama

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = torch.device("cuda")
LAYERS = 3
STEPS = 5
LR = 1e-2  # large enough that five steps move the loss far more than the tolerance (checked below)
MODELS = {"llama": (tiny_llama, "LlamaDecoderLayer"), "gpt2": (tiny_gpt2, "GPT2Block")}
DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}
# Relative error (of the loss, and of the logits as a whole) allowed against eager.
# fp32: Inductor only fuses and reorders float32 arithmetic, about 1e-6 apart.
# bf16/fp16: compiled kernels keep fused intermediates in fp32 where eager rounds each op's output
# to 16 bits (bf16 carries 8 mantissa bits: 4e-3 per rounding), across 3 layers and then through
# five AdamW steps (on a CPU with Inductor: logits 3e-3 apart, losses up to 5e-3); 2e-2 still
# fails a model that trained differently (the loss moves about 10x that).
TOLERANCE = {"no": 1e-4, "bf16": 2e-2, "fp16": 2e-2}


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """|actual - expected| / |expected| over the whole tensor: one number, not thrown by the
    near-zero elements an elementwise rtol trips on."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return ((actual - expected).norm() / expected.norm()).item()


def make_batches() -> list[torch.Tensor]:
    """The batches of token ids, one per step: the same one each time, so the model memorises it
    and the loss falls (about 4.6 to 3.5 in five steps)."""
    ids = torch.randint(0, 97, (2, 32), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    return [ids] * STEPS


def train_eagerly(model, batches, precision):
    """The oracle: a plain PyTorch loop with torch.autocast, and torch.amp.GradScaler for fp16."""
    dtype = DTYPES[precision]
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler(DEVICE.type) if precision == "fp16" else None
    first_logits, losses, scales = None, [], []
    for step in range(STEPS):
        ids = batches[step]
        autocast = torch.autocast(DEVICE.type, dtype=dtype) if dtype else contextlib.nullcontext()
        with autocast:
            out = model(input_ids=ids, labels=ids, use_cache=False)
        loss = out.loss.float()
        if step == 0:
            first_logits = out.logits.detach().float()
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            scales.append(scaler.get_scale())
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return first_logits, losses, scales


def train_with_kiln(model, batches, precision):
    plugin = TorchDynamoPlugin(backend="inductor", fullgraph=True, dynamic=False,
                               use_regional_compilation=True, recompile="error")
    accelerator = Accelerator(dynamo_plugin=plugin, mixed_precision=precision)
    assert accelerator.device.type == DEVICE.type  # Accelerator() picks the GPU by itself
    assert (accelerator.scaler is not None) == (precision == "fp16")
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR))
    first_logits, losses, scales = None, [], []
    for step in range(STEPS):
        ids = batches[step]
        out = model(input_ids=ids, labels=ids, use_cache=False)
        if step == 0:
            first_logits = out.logits.detach()
            assert first_logits.dtype == torch.float32  # handed back in fp32 under every precision
        accelerator.backward(out.loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
        if accelerator.scaler is not None:
            scales.append(accelerator.scaler.get_scale())
    return accelerator, model, first_logits, losses, scales


@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("name", list(MODELS))
def test_regional_inductor_training_matches_eager_and_runs_one_compiled_graph_per_block(name, precision):
    build, block = MODELS[name]
    tolerance = TOLERANCE[precision]
    model = build(LAYERS)
    reference = build(LAYERS)
    reference.load_state_dict(model.state_dict())
    reference.to(DEVICE)
    batches = make_batches()

    expected_logits, expected_losses, expected_scales = train_eagerly(reference, batches, precision)
    accelerator, model, logits, losses, scales = train_with_kiln(model, batches, precision)

    # The comparison means something only if training moved the loss well past the tolerance.
    assert expected_losses[0] - expected_losses[-1] > 5 * tolerance * expected_losses[0], expected_losses
    assert relative_error(logits, expected_logits) <= tolerance
    errors = [abs(a - b) / abs(b) for a, b in zip(losses, expected_losses)]
    assert max(errors) <= tolerance, f"losses {losses} against eager {expected_losses}"
    # fp16: the scaler saw the same finite or overflowing gradients as eager's, step by step.
    assert scales == expected_scales

    regions = compiled_regions(model)
    assert [(r.name, r.instances) for r in regions] == [(block, LAYERS)]
    assert all(r.calls > 0 for r in regions)
    report = accelerator.compile_report()
    (region,) = report.regions
    assert (region.name, region.kind, region.instances, region.graphs) == (block, "block", LAYERS, 1)
    assert (region.compiled_calls, region.eager_calls) == (LAYERS * STEPS, 0), report.table()
    assert (region.recompiles, region.graph_breaks) == (0, {}), report.table()
    assert report.silent_regions == []
