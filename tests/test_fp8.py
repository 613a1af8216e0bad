"""mixed_precision="fp8": torchao's float8 linear layers, compiled per block, plain checkpoints, resume.

Needs torchao (pinned in requirements-dev.txt); where it is not importable (the torch matrix venvs)
the tests that train skip, and those about refusals still run.
"""

import contextlib
import importlib
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from kiln import Accelerator, TorchDynamoPlugin, load_model
from kiln.fp8 import convert_to_fp8, default_linear_filter, first_and_last_linear
from kiln.precision import Precision
from kiln.utils import AORecipeKwargs, FP8RecipeKwargs, MSAMPRecipeKwargs, TERecipeKwargs
from toy_models import tiny_llama


def _torchao_error() -> str | None:
    try:
        importlib.import_module("torchao.float8")
    except Exception as error:  # not installed, or built for another torch
        return repr(error)
    return None


TORCHAO_ERROR = _torchao_error()
needs_torchao = pytest.mark.skipif(TORCHAO_ERROR is not None,
                                   reason=f"torchao.float8 is not importable here: {TORCHAO_ERROR}")

STEPS, SAVE_AFTER, LAYERS = 6, 3, 3
# Measured on this CPU (torch 2.13, torchao 0.18, width 64, AdamW 3e-3): fp8 and bf16 losses differ
# by at most 0.013 over the 6 steps while both fall from 4.6 to 3.8; 0.04 leaves a 3x margin. (Six
# steps, not more: torch's CPU _scaled_mm takes 25 ms a call here, 1.5 s of each fp8 step.)
FP8_VS_BF16_LOSS_TOLERANCE = 0.04
# Each float8 linear runs three float8 matmuls a step: output, input gradient, weight gradient.
MATMULS_PER_LINEAR = 3


def batches() -> list[torch.Tensor]:
    """Counting sequences mod 97 from random starts: learnable, so the losses fall."""
    generator = torch.Generator().manual_seed(1)
    starts = [torch.randint(0, 97, (4, 1), generator=generator) for _ in range(STEPS)]
    return [(start + torch.arange(32)) % 97 for start in starts]


def llama(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return tiny_llama(layers=LAYERS, width=64)  # block widths 32, 64 and 128: all divisible by 16


def train(precision: str, *, seed: int = 0, compiled: bool = True, checkpoint=None, resume_from=None,
          profile_step: int | None = None) -> dict:
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True) if compiled else None
    accelerator = Accelerator(mixed_precision=precision, dynamo_plugin=plugin)
    model = llama(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    first = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        first = SAVE_AFTER
    losses, scaled_mm_calls = [], None
    for step, ids in enumerate(batches()[first:], start=first):
        with torch.profiler.profile() if step == profile_step else contextlib.nullcontext() as profiler:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if step == profile_step:
            scaled_mm_calls = sum(e.count for e in profiler.key_averages() if e.key == "aten::_scaled_mm")
        losses.append(loss.item())
        if checkpoint is not None and step + 1 == SAVE_AFTER:
            accelerator.save_state(checkpoint)
    return dict(accelerator=accelerator, model=model, losses=losses, scaled_mm_calls=scaled_mm_calls)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """bf16 and fp8 eagerly (the references), fp8 compiled with a checkpoint after SAVE_AFTER steps
    and a profiled last step, and fp8 resumed from that checkpoint in a model of other initial weights."""
    folder = tmp_path_factory.mktemp("fp8")
    bf16 = train("bf16", compiled=False)
    fp8_eager = train("fp8", compiled=False)
    fp8 = train("fp8", checkpoint=folder / "checkpoint", profile_step=STEPS - 1)
    fp8["report"] = fp8["accelerator"].compile_report()
    fp8["accelerator"].save_model(fp8["model"], folder / "saved")
    torch._dynamo.reset()
    resumed = train("fp8", seed=7, resume_from=folder / "checkpoint")
    return dict(folder=folder, bf16=bf16, fp8_eager=fp8_eager, fp8=fp8, resumed=resumed)


@needs_torchao
def test_fp8_losses_stay_within_tolerance_of_bf16(runs):
    bf16, fp8 = runs["bf16"]["losses"], runs["fp8"]["losses"]
    assert len(fp8) == STEPS
    assert fp8[-1] < fp8[0] - 0.8  # it learns
    assert max(abs(a - b) for a, b in zip(fp8, bf16)) < FP8_VS_BF16_LOSS_TOLERANCE


@needs_torchao
def test_compiled_fp8_losses_equal_the_eager_fp8_run(runs):
    assert runs["fp8"]["losses"] == pytest.approx(runs["fp8_eager"]["losses"], abs=1e-5, rel=0)


@needs_torchao
def test_block_linears_become_float8_and_the_first_and_last_stay_plain(runs):
    from torchao.float8.float8_linear import Float8Linear

    assert runs["fp8"]["accelerator"].fp8_backend == "AO"  # as Accelerate's FP8BackendType.AO
    model = runs["fp8"]["accelerator"].unwrap_model(runs["fp8"]["model"])
    kinds = {path: type(m) for path, m in model.named_modules() if isinstance(m, nn.Linear)}
    plain = {path for path, kind in kinds.items() if kind is nn.Linear}
    assert plain == {"model.layers.0.self_attn.q_proj", "lm_head"}  # first, and last (97 outputs too)
    assert all(issubclass(kinds[path], Float8Linear) for path in kinds.keys() - plain)
    assert len(kinds) - len(plain) == 7 * LAYERS - 1


@needs_torchao
def test_every_block_call_runs_compiled_with_float8_matmuls(runs):
    regions = runs["fp8"]["report"].regions
    # Layer 0 keeps a plain q_proj, so its instance group compiles apart from layers 1 and 2.
    assert sorted(r.instances for r in regions) == [1, 2]
    assert {r.block_class for r in regions} == {"LlamaDecoderLayer"}
    assert sum(r.compiled_calls for r in regions) == LAYERS * STEPS
    assert sum(r.eager_calls for r in regions) == 0
    float8_linears = 7 * LAYERS - 1
    assert runs["fp8"]["scaled_mm_calls"] == MATMULS_PER_LINEAR * float8_linears


@needs_torchao
def test_saved_weights_are_plain_and_load_into_an_unconverted_model(runs):
    accelerator, model = runs["fp8"]["accelerator"], runs["fp8"]["model"]
    plain_keys = set(llama().state_dict())
    state = accelerator.get_state_dict(model)
    assert set(state) == plain_keys
    assert {type(t) for t in state.values()} == {torch.Tensor}  # no torchao tensor subclass
    for path in (runs["folder"] / "saved" / "model.safetensors",
                 runs["folder"] / "checkpoint" / "model_0" / "model.safetensors"):
        tensors = load_file(path)
        assert set(tensors) == plain_keys, path
        assert {t.dtype for t in tensors.values()} == {torch.float32}, path
    plain = load_model(llama(seed=3), runs["folder"] / "saved")
    assert not any(type(m) is not nn.Linear for m in plain.modules() if isinstance(m, nn.Linear))
    for key, value in plain.state_dict().items():
        assert torch.equal(value, state[key]), key


@needs_torchao
def test_resume_after_load_state_gives_the_uninterrupted_losses(runs):
    resumed, uninterrupted = runs["resumed"]["losses"], runs["fp8"]["losses"][SAVE_AFTER:]
    assert len(resumed) == STEPS - SAVE_AFTER
    assert resumed == pytest.approx(uninterrupted, abs=1e-6, rel=0)


def output_dtypes(precision: str) -> dict[str, torch.dtype]:
    """The dtype of each module's output in one eager forward of a prepared model, and the logits'."""
    accelerator = Accelerator(mixed_precision=precision)
    model = accelerator.prepare(llama())
    seen = {}

    def record(path: str, out) -> None:
        tensor = out[0] if isinstance(out, tuple) else out
        if isinstance(tensor, torch.Tensor):
            seen.setdefault(path, tensor.dtype)

    for path, module in model.named_modules():
        module.register_forward_hook(lambda m, i, out, path=path: record(path, out))
    seen["logits"] = model(input_ids=batches()[0], use_cache=False).logits.dtype
    return seen


@needs_torchao
def test_fp8_runs_the_other_ops_under_bf16_autocast_and_returns_fp32():
    fp8, bf16 = output_dtypes("fp8"), output_dtypes("bf16")
    assert fp8 == bf16  # float8 linears hand back what autocast's bf16 linears would
    assert fp8["lm_head"] == fp8["model.layers.1.mlp"] == torch.bfloat16
    assert fp8["logits"] == torch.float32


class Stack(nn.Module):
    """Linear layers of sizes that torch._scaled_mm takes (multiples of 16) and some it does not."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.kept = nn.Linear(32, 32)
        self.odd_out = nn.Linear(32, 40)
        self.odd_in = nn.Linear(40, 32)
        self.last = nn.Linear(32, 16)

    def forward(self, x):
        for layer in (self.first, self.kept, self.odd_out, self.odd_in, self.last):
            x = layer(x)
        return x


@needs_torchao
def test_default_filter_leaves_first_last_and_non_divisible_linears_plain():
    model = Stack()
    assert first_and_last_linear(model) == ("first", "last")
    keep = default_linear_filter(model)
    assert [path for path, m in model.named_children() if keep(m, path)] == ["kept"]
    assert convert_to_fp8(model) == ["kept"]
    assert [path for path, m in model.named_children() if type(m) is nn.Linear] == ["first", "odd_out", "odd_in",
                                                                                     "last"]
    assert convert_to_fp8(model) == []  # a Float8Linear is not converted again


@needs_torchao
def test_ao_recipe_module_filter_func_replaces_the_default_rule():
    recipe = AORecipeKwargs(module_filter_func=lambda module, path: path.endswith("q_proj"))
    accelerator = Accelerator(mixed_precision="fp8", kwargs_handlers=[recipe])
    model = accelerator.prepare(llama())
    converted = [path for path, m in model.named_modules() if isinstance(m, nn.Linear) and type(m) is not nn.Linear]
    assert converted == [f"model.layers.{i}.self_attn.q_proj" for i in range(LAYERS)]  # the first one too


@needs_torchao
def test_ao_recipe_without_mixed_precision_fp8_is_refused():
    with pytest.raises(ValueError, match="mixed_precision is 'bf16'; pass mixed_precision='fp8'"):
        Accelerator(mixed_precision="bf16", kwargs_handlers=[AORecipeKwargs()])
    with pytest.raises(ValueError, match="mixed_precision is 'no'"):
        Accelerator(kwargs_handlers=[AORecipeKwargs()])


@needs_torchao
def test_fsdp_float8_all_gather_and_deepspeed_are_refused():
    # fp8 under FSDP2 (the weights gathered, then cast) runs in tests/distributed/test_strategies.py.
    with pytest.raises(ValueError, match="enable_fsdp_float8_all_gather=True"):
        AORecipeKwargs(enable_fsdp_float8_all_gather=True)
    precision = Precision("fp8", torch.device("cpu"))
    with pytest.raises(NotImplementedError, match="mixed_precision='fp8' with DeepSpeed is not supported"):
        precision.convert_linears(llama(), "deepspeed")


def test_fp8_without_torchao_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now fails as if not installed
    with pytest.raises(ImportError, match="pip install torchao"):
        Accelerator(mixed_precision="fp8")
    with pytest.raises(ImportError, match="pip install torchao"):
        AORecipeKwargs()


@pytest.mark.parametrize("recipe", [FP8RecipeKwargs, TERecipeKwargs, MSAMPRecipeKwargs])
def test_transformer_engine_and_ms_amp_recipes_point_to_ao_recipe_kwargs(recipe):
    with pytest.raises(NotImplementedError, match=f"{recipe.__name__} is not supported.*AORecipeKwargs"):
        recipe()
