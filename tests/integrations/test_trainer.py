"""The transformers Trainer on a model compiled by `kiln.compile_regions`: the eager Trainer's
losses, checkpoints that resume and reload with clean keys, and compiled regions that ran.

Depends on transformers (whose Trainer runs on the real accelerate) and Kiln's public API only.
"""

import pytest
import torch
from safetensors.torch import load_file

import kiln

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

STEPS, SAVE_STEPS, BATCH, SEQ, VOCAB = 6, 3, 4, 16, 64


def tiny_llama(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ, use_cache=False)
    return LlamaForCausalLM(config)


def dataset() -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": t, "labels": t.clone()} for t in tokens]


class LossRecordingTrainer(Trainer):
    """The Trainer logs losses rounded to 4 digits; this keeps each training step's exact loss."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.losses: list[float] = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        loss = super().compute_loss(model, inputs, *args, **kwargs)
        if model.training:
            self.losses.append((loss[0] if isinstance(loss, tuple) else loss).item())
        return loss


def make_trainer(model, output_dir, **arguments) -> LossRecordingTrainer:
    args = TrainingArguments(output_dir=str(output_dir), max_steps=STEPS, save_steps=SAVE_STEPS,
                             per_device_train_batch_size=BATCH, learning_rate=1e-3, logging_steps=1,
                             report_to=[], use_cpu=True, seed=11, data_seed=11, disable_tqdm=True,
                             dataloader_num_workers=0, **arguments)
    return LossRecordingTrainer(model=model, args=args, train_dataset=dataset())


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("trainer")
    eager = make_trainer(tiny_llama(0), folder / "eager")
    eager.train()
    model = kiln.compile_regions(tiny_llama(0), backend="aot_eager")
    compiled = make_trainer(model, folder / "kiln")
    compiled.train()
    resumed_model = kiln.compile_regions(tiny_llama(5), backend="aot_eager")
    resumed = make_trainer(resumed_model, folder / "resumed")
    resumed.train(resume_from_checkpoint=str(folder / "kiln" / f"checkpoint-{SAVE_STEPS}"))
    return dict(folder=folder, eager=eager.losses, model=model, losses=compiled.losses,
                resumed_model=resumed_model, resumed=resumed.losses)


def test_trainer_on_compiled_regions_gives_the_eager_losses(trainer_runs):
    assert len(trainer_runs["losses"]) == STEPS
    assert trainer_runs["losses"] == pytest.approx(trainer_runs["eager"], abs=1e-6, rel=0)


def test_compiled_regions_ran_under_the_trainer(trainer_runs):
    report = kiln.compile_report(trainer_runs["model"])
    assert {r.block_class for r in report.regions} == {"LlamaDecoderLayer"}
    assert sum(r.instances for r in report.regions) == 2
    assert all(r.compiled_calls > 0 for r in report.regions)
    assert sum(r.eager_calls for r in report.regions) == 0
    assert report.silent_regions == []


def test_trainer_checkpoint_has_clean_keys_and_reloads(trainer_runs):
    checkpoint = trainer_runs["folder"] / "kiln" / f"checkpoint-{STEPS}"
    assert (trainer_runs["folder"] / "kiln" / f"checkpoint-{SAVE_STEPS}" / "model.safetensors").is_file()
    keys = load_file(checkpoint / "model.safetensors").keys()
    assert not [k for k in keys if "_orig_mod." in k or k.startswith("module.")]
    plain, info = AutoModelForCausalLM.from_pretrained(checkpoint, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    model = trainer_runs["model"]
    tokens = dataset()[0]["input_ids"][None]
    model.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, plain(input_ids=tokens).logits,
                                   atol=1e-6, rtol=0)


def test_resume_from_checkpoint_continues_with_the_same_losses(trainer_runs):
    assert len(trainer_runs["resumed"]) == STEPS - SAVE_STEPS
    assert trainer_runs["resumed"] == pytest.approx(trainer_runs["losses"][SAVE_STEPS:], abs=1e-6, rel=0)
    assert all(r.compiled_calls > 0 for r in kiln.compile_report(trainer_runs["resumed_model"]).regions)


def test_gradient_checkpointing_under_the_trainer_recomputes_the_compiled_blocks(tmp_path):
    def run(model, name):
        trainer = make_trainer(model, tmp_path / name, gradient_checkpointing=True, save_strategy="no")
        trainer.train()
        return trainer.losses

    eager = run(tiny_llama(0), "eager")
    model = kiln.compile_regions(tiny_llama(0), backend="aot_eager")
    losses = run(model, "kiln")
    assert model.is_gradient_checkpointing
    assert losses == pytest.approx(eager, abs=1e-6, rel=0)
    report = kiln.compile_report(model)
    # transformers 5 checkpoints inside the layer's own forward (module hooks stay outside), so the
    # checkpoint is traced into the compiled region: one compiled call per block and step.
    assert sum(r.compiled_calls for r in report.regions) == 2 * STEPS
    assert sum(r.eager_calls for r in report.regions) == 0
