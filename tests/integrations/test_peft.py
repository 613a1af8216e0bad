"""PEFT on Kiln: a LoRA adapter on a tiny GPT-2 trained through Accelerator.prepare with regional
compilation, checked against the plain loop, resumed, and reloaded by PEFT's own loader; a LoRA on a
diffusers UNet saved the way train_text_to_image_lora.py saves it.

Depends on peft, transformers and diffusers, and on Kiln's public API only.
"""

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kiln import Accelerator, TorchDynamoPlugin

pytest.importorskip("peft")
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

STEPS, SAVE_AFTER, BATCH, SEQ, VOCAB = 6, 3, 4, 16, 64


def base_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def lora_model(seed: int):
    model = base_model()
    torch.manual_seed(seed)  # LoRA's A matrices are drawn here
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], lora_dropout=0.0,
                        fan_in_fan_out=True, init_lora_weights="gaussian")
    return get_peft_model(model, config)


def batches() -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": t, "labels": t} for t in tokens]


def loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(batches(), batch_size=BATCH)


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def train_eagerly(model) -> list[float]:
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    losses = []
    for batch in loader():
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def train_with_kiln(model, *, checkpoint_dir=None, resume_from=None, skip: int = 0):
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    optimizer = torch.optim.AdamW(trainable(model), lr=1e-2)
    model, optimizer, data = accelerator.prepare(model, optimizer, loader())
    if resume_from is not None:
        accelerator.load_state(resume_from)
        data = accelerator.skip_first_batches(data, skip)
    losses = []
    for step, batch in enumerate(data, start=skip):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if checkpoint_dir is not None and step + 1 == SAVE_AFTER:
            accelerator.save_state(checkpoint_dir)
    return accelerator, model, losses


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("peft")
    eager = train_eagerly(lora_model(seed=1))
    accelerator, model, losses = train_with_kiln(lora_model(seed=1), checkpoint_dir=folder / "checkpoint")
    _, resumed_model, resumed = train_with_kiln(lora_model(seed=2), resume_from=folder / "checkpoint",
                                                skip=SAVE_AFTER)
    return dict(folder=folder, eager=eager, accelerator=accelerator, model=model, losses=losses,
                resumed_model=resumed_model, resumed=resumed)


def test_lora_trains_compiled_with_the_eager_losses(lora_runs):
    assert len(lora_runs["losses"]) == STEPS
    assert lora_runs["losses"] == pytest.approx(lora_runs["eager"], abs=1e-6, rel=0)
    lora_b = [p for name, p in lora_runs["model"].named_parameters() if "lora_B" in name]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)  # B starts at zero: the adapter trained
    report = lora_runs["accelerator"].compile_report()
    assert {r.block_class for r in report.regions} == {"GPT2Block"}
    assert sum(r.instances for r in report.regions) == 2
    assert all(r.compiled_calls > 0 for r in report.regions)
    assert sum(r.eager_calls for r in report.regions) == 0


def test_resumed_lora_run_continues_with_the_uninterrupted_losses(lora_runs):
    assert len(lora_runs["resumed"]) == STEPS - SAVE_AFTER
    assert lora_runs["resumed"] == pytest.approx(lora_runs["losses"][SAVE_AFTER:], abs=1e-6, rel=0)


def test_adapter_reloads_with_peft_from_pretrained(lora_runs):
    accelerator, model = lora_runs["accelerator"], lora_runs["model"]
    folder = lora_runs["folder"] / "adapter"
    accelerator.unwrap_model(model).save_pretrained(folder)
    keys = load_file(folder / "adapter_model.safetensors").keys()
    assert keys and all("lora_" in k for k in keys)
    assert not [k for k in keys if "_orig_mod." in k or "module." in k.split("base_model.model.")[0]]
    reloaded = PeftModel.from_pretrained(base_model(), folder)
    trained_lora = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    reloaded_lora = {k: v for k, v in reloaded.state_dict().items() if "lora_" in k}
    assert trained_lora.keys() == reloaded_lora.keys()
    tokens = batches()[0]["input_ids"][None]
    model.eval(), reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=tokens).logits, reloaded(input_ids=tokens).logits,
                                   atol=1e-6, rtol=0)
    model.train()


def test_lora_on_a_diffusers_unet_saves_clean_adapter_keys(tmp_path):
    pytest.importorskip("diffusers")
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel
    from diffusers.utils import convert_state_dict_to_diffusers

    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        norm_num_groups=8, cross_attention_dim=16, attention_head_dim=4)
    # As train_text_to_image_lora.py: freeze the UNet, then add the adapter (whose weights train).
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
                                target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    lora_before = {k: v.clone() for k, v in get_peft_model_state_dict(unet).items()}
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    optimizer = torch.optim.AdamW(trainable(unet), lr=1e-2)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    for _ in range(2):
        latents, noise = torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8)
        loss = F.mse_loss(unet(latents + noise, torch.tensor([3, 30]), torch.randn(2, 4, 16)).sample, noise)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    report = accelerator.compile_report()
    assert report.regions and all(r.compiled_calls > 0 for r in report.regions)

    lora = get_peft_model_state_dict(accelerator.unwrap_model(unet))
    assert lora.keys() == lora_before.keys()
    assert not [k for k in lora if "_orig_mod." in k or k.startswith("module.")]
    assert any(not torch.equal(lora[k], lora_before[k]) for k in lora)  # the adapter trained
    StableDiffusionPipeline.save_lora_weights(save_directory=tmp_path, safe_serialization=True,
                                              unet_lora_layers=convert_state_dict_to_diffusers(lora))
    saved = load_file(tmp_path / "pytorch_lora_weights.safetensors")
    assert len(saved) == len(lora) and all(k.startswith("unet.") for k in saved)
    assert not [k for k in saved if "_orig_mod." in k or ".module." in k]
