"""Regional compile crossed with what users combine it with (issue 37's matrix; docs/compiling.md).

For each precision and each kind of activation checkpointing, one compiled model and its eager twin
(the same Accelerator without the dynamo plugin) take a training step, evaluate under no_grad and
generate with a KV cache (transformers' default dynamic cache, greedy). Every row asserts what a user
relies on: the regions are the model's decoder blocks, every block call ran compiled code, and the
loss and gradients, logits and tokens equal eager's under the same setting. PEFT's LoRA and
torchao's int8 weight-only inference are rows of their own.

aot_eager throughout: Dynamo traces for real (graph counts, recompiles and breaks are real), and one
model per precision and checkpointing serves all three uses.
"""

import importlib
import warnings

import pytest
import torch

import kiln
from kiln import Accelerator, TorchDynamoPlugin
from kiln.activation_checkpointing import apply_activation_checkpointing
from kiln.compile.regions import find_repeated_blocks
from toy_models import tiny_llama

PRECISIONS = ("no", "bf16", "fp16", "fp8")
CHECKPOINTING = ("none", "kiln", "transformers-reentrant", "transformers-non-reentrant")
USES = ("train", "eval", "generate")
LAYERS, NEW_TOKENS = 2, 3
# aot_eager runs the ops eager runs, so results agree to rounding; reduced precisions round coarser.
TOLERANCE = {"no": 1e-5, "bf16": 2e-2, "fp16": 2e-3, "fp8": 2e-2}


def _torchao_missing(module: str) -> str | None:
    try:
        importlib.import_module(module)
    except Exception as error:  # not installed, or built for another torch (the matrix venvs)
        return repr(error)
    return None


def _base_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_llama(layers=LAYERS, width=64, init_std=0.08)  # widths divisible by 16, for fp8


def _batch() -> torch.Tensor:
    return torch.randint(1, 97, (4, 32), generator=torch.Generator().manual_seed(1))


PROMPT = torch.randint(1, 97, (2, 16), generator=torch.Generator().manual_seed(2))
POSITIONS = torch.arange(PROMPT.shape[1]).expand(PROMPT.shape[0], -1)  # as generate makes them
GENERATE = dict(max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                attention_mask=torch.ones_like(PROMPT))


def _lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(1)  # LoRA's A matrices are drawn here; gaussian B too, so it changes outputs
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, init_lora_weights="gaussian"))


def _int8_weight_only(model):
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    quantize_(model, Int8WeightOnlyConfig())
    return model


ADAPTED = {"lora": (_lora, "peft"), "int8-weight-only": (_int8_weight_only, "torchao.quantization")}


def _run(precision: str, checkpointing: str, compiled: bool) -> dict:
    """Train, evaluate under no_grad and generate with one prepared model; what each use gave.
    `checkpointing` may instead name an adapted model (ADAPTED): a LoRA, or int8 weights (not trained)."""
    model = _base_model()
    trains = checkpointing != "int8-weight-only"
    if checkpointing in ADAPTED:
        model = ADAPTED[checkpointing][0](model)
    elif checkpointing.startswith("transformers"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": checkpointing == "transformers-reentrant"})
    elif checkpointing == "kiln":
        apply_activation_checkpointing(model, [p for ps in find_repeated_blocks(model).values() for p in ps])
    plugin = TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True) if compiled else None
    result = {}
    with warnings.catch_warnings(record=True) as caught:  # from prepare on: never "no repeated blocks"
        warnings.simplefilter("always")
        accelerator = Accelerator(mixed_precision=precision, dynamo_plugin=plugin, kwargs_handlers=_recipe(precision))
        if trains:
            optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
            model, optimizer = accelerator.prepare(model, optimizer)
        else:
            model = accelerator.prepare(model)
        result["model"] = model
        if trains:
            model.train()
            ids = _batch()
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            accelerator.backward(loss)
            # The loss and every gradient; the optimizer's step shows in the evaluation after it.
            trained = [loss.detach().float().view(1)] + [p.grad.float().flatten() for p in model.parameters()
                                                           if p.grad is not None]
            optimizer.step()
            optimizer.zero_grad()
            result["train"] = ((0, 0), _calls(model), torch.cat(trained))
        model.eval()
        before = _calls(model)
        with torch.no_grad():
            # The prompt as generate's prefill sees it, so that the two share one graph.
            logits = model(input_ids=PROMPT, attention_mask=GENERATE["attention_mask"],
                           position_ids=POSITIONS).logits.float()
        result["eval"] = (before, _calls(model), logits)
        before = _calls(model)
        tokens = accelerator.unwrap_model(model).generate(PROMPT, **GENERATE)
        result["generate"] = (before, _calls(model), tokens)
    result["warnings"] = [str(w.message) for w in caught if issubclass(w.category, kiln.KilnCompileWarning)]
    return result


def _recipe(precision: str) -> list:
    """fp8 converts every block linear here, so both layers share one region and one set of graphs
    (half the compiles). The default recipe keeps layer 0's q_proj plain, two instance groups of
    one block each: its regions, parity and resume are tests/test_fp8.py's."""
    if precision != "fp8":
        return []
    from kiln.utils import AORecipeKwargs

    return [AORecipeKwargs(module_filter_func=lambda module, path: ".layers." in f".{path}")]


def _calls(model) -> tuple[int, int]:
    """(compiled, eager) block calls so far."""
    regions = kiln.compile_report(model).regions
    return sum(r.compiled_calls for r in regions), sum(r.eager_calls for r in regions)


_RUNS: dict = {}


def runs(precision: str, checkpointing: str) -> tuple[dict, dict]:
    """The eager and the compiled run of one precision and checkpointing, made at their first use."""
    key = (precision, checkpointing)
    if key not in _RUNS:
        needs = "torchao.float8" if precision == "fp8" else ADAPTED.get(checkpointing, (None, None))[1]
        if needs is not None and _torchao_missing(needs):
            pytest.skip(f"{needs} is not importable here: {_torchao_missing(needs)}")
        _RUNS[key] = (_run(precision, checkpointing, compiled=False), _run(precision, checkpointing, compiled=True))
    return _RUNS[key]


def _assert_compiled_like_eager(precision: str, checkpointing: str, use: str) -> None:
    eager, compiled = runs(precision, checkpointing)
    report = kiln.compile_report(compiled["model"])
    # The decoder blocks in block regions, never a whole-model compile.
    assert {r.block_class for r in report.regions} == {"LlamaDecoderLayer"}
    assert all(r.kind == "block" for r in report.regions)
    paths = sorted(p for r in report.regions for p in r.paths)  # a LoRA's sit under base_model.model
    assert [p[p.index("layers."):] for p in paths] == [f"layers.{i}" for i in range(LAYERS)], paths
    before, after, value = compiled[use]
    block_calls = {"train": LAYERS, "eval": LAYERS, "generate": NEW_TOKENS * LAYERS}[use]
    assert after[0] - before[0] == block_calls, report.table()
    assert after[1] == 0, report.table()  # no eager block call, in this use or before it
    assert not compiled["warnings"], compiled["warnings"]
    expected = eager[use][2]
    if use == "generate":
        assert torch.equal(value, expected)
    else:
        torch.testing.assert_close(value, expected, atol=TOLERANCE[precision], rtol=0)


class _Precision:
    """The rows of one precision; a class each, so that make test's two workers share the matrix."""

    precision: str

    @pytest.mark.parametrize("use", USES)
    @pytest.mark.parametrize("checkpointing", CHECKPOINTING)
    def test_every_block_call_is_compiled_and_equals_eager(self, checkpointing, use):
        _assert_compiled_like_eager(self.precision, checkpointing, use)


class TestFp32(_Precision):
    precision = "no"


class TestBf16(_Precision):
    precision = "bf16"


class TestFp16(_Precision):
    precision = "fp16"


class TestFp8(_Precision):
    precision = "fp8"


class TestAdapted:
    @pytest.mark.parametrize("use", USES)
    def test_a_peft_lora_model_is_compiled_per_block_like_eager(self, use):
        _assert_compiled_like_eager("no", "lora", use)

    @pytest.mark.parametrize("use", ("eval", "generate"))
    def test_torchao_int8_weight_only_inference_is_compiled_per_block_like_eager(self, use):
        _assert_compiled_like_eager("no", "int8-weight-only", use)
