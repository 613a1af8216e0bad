"""diffusers on Kiln: a UNet with Stable Diffusion 1.5's block layout (tiny widths) trained the way
diffusers' training scripts train it, with their save/load-state hooks, resumed and reloaded by diffusers.

Depends on diffusers (which imports the real accelerate's loading helpers) and Kiln's public API only.
"""

import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from kiln import Accelerator, TorchDynamoPlugin
from kiln.compile.monitor import KilnRecompileWarning
from toy_models import SD_UNET_LAYOUT, tiny_sd_unet

pytest.importorskip("diffusers")
from diffusers import DDPMScheduler, UNet2DConditionModel, UNet2DModel  # noqa: E402

STEPS, SAVE_AFTER, BATCH, TEXT_TOKENS = 6, 3, 2, 8
TRAIN_TIMESTEPS = 100


def batches() -> list[dict[str, torch.Tensor]]:
    """Random latents and text embeddings in place of a VAE and a text encoder."""
    generator = torch.Generator().manual_seed(123)
    return [{"latents": torch.randn(BATCH, 4, 16, 16, generator=generator),
             "encoder_hidden_states": torch.randn(BATCH, TEXT_TOKENS, 16, generator=generator)}
            for _ in range(STEPS)]


def noise_prediction_loss(unet, batch, scheduler: DDPMScheduler) -> torch.Tensor:
    """The loss of train_text_to_image.py (epsilon prediction): noise and timesteps from the global RNG."""
    latents = batch["latents"]
    noise = torch.randn_like(latents)
    timesteps = torch.randint(0, scheduler.config.num_train_timesteps, (latents.shape[0],)).long()
    noisy_latents = scheduler.add_noise(latents, noise, timesteps)
    prediction = unet(noisy_latents, timesteps, batch["encoder_hidden_states"], return_dict=False)[0]
    return F.mse_loss(prediction.float(), noise.float(), reduction="mean")


def register_diffusers_hooks(accelerator: Accelerator, model_class: type) -> None:
    """train_text_to_image.py's hooks, without the `accelerate.__version__ >= 0.16.0` test in front
    of them (against Kiln's version it fails, and the checkpoint would lack `unet/`)."""

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            for model in models:
                model.save_pretrained(os.path.join(output_dir, "unet"))
                weights.pop()  # so that Kiln does not write this model again

    def load_model_hook(models, input_dir):
        for _ in range(len(models)):
            model = models.pop()  # so that Kiln does not load it again
            load_model = model_class.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**load_model.config)
            model.load_state_dict(load_model.state_dict())
            del load_model

    accelerator.register_save_state_pre_hook(save_model_hook)
    accelerator.register_load_state_pre_hook(load_model_hook)


def train_with_kiln(unet, *, checkpoint_dir=None, resume_from=None, skip: int = 0):
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    register_diffusers_hooks(accelerator, type(unet))
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(batches(), batch_size=None)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    scheduler = DDPMScheduler(num_train_timesteps=TRAIN_TIMESTEPS)
    torch.manual_seed(1)
    if resume_from is not None:
        accelerator.load_state(resume_from)  # brings back the RNG state, hence the noise, too
        loader = accelerator.skip_first_batches(loader, skip)
    unet.train()
    losses = []
    for step, batch in enumerate(loader, start=skip):
        with accelerator.accumulate(unet):
            loss = noise_prediction_loss(unet, batch, scheduler)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        if checkpoint_dir is not None and step + 1 == SAVE_AFTER:
            accelerator.save_state(checkpoint_dir)
    return accelerator, unet, losses


def train_eagerly(unet) -> list[float]:
    """The plain PyTorch loop: no Kiln, no compile."""
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    scheduler = DDPMScheduler(num_train_timesteps=TRAIN_TIMESTEPS)
    torch.manual_seed(1)
    unet.train()
    losses = []
    for batch in batches():
        loss = noise_prediction_loss(unet, batch, scheduler)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def regions_by_class(report) -> dict[str, list]:
    """The report's regions under their block class: Kiln may split one class's instances into
    groups that compile apart ("ResnetBlock2D#2")."""
    by_class: dict[str, list] = {}
    for region in report.regions:
        by_class.setdefault(region.block_class, []).append(region)
    return by_class


def calls(regions) -> tuple[int, int]:
    """(compiled, eager) calls of these regions together."""
    return sum(r.compiled_calls for r in regions), sum(r.eager_calls for r in regions)


@pytest.fixture(scope="module")
def sd_runs(tmp_path_factory):
    """One eager run, one Kiln run saving a checkpoint after step SAVE_AFTER, one resumed from it."""
    folder = tmp_path_factory.mktemp("diffusers")
    eager = train_eagerly(tiny_sd_unet(0))
    accelerator, unet, losses = train_with_kiln(tiny_sd_unet(0), checkpoint_dir=folder / "checkpoint")
    training_report = accelerator.compile_report()
    _, resumed_unet, resumed = train_with_kiln(tiny_sd_unet(7), resume_from=folder / "checkpoint", skip=SAVE_AFTER)
    return dict(folder=folder, eager=eager, accelerator=accelerator, unet=unet, losses=losses,
                training_report=training_report, resumed_unet=resumed_unet, resumed=resumed)


def test_sd_unet_trains_compiled_with_the_eager_losses(sd_runs):
    assert len(sd_runs["losses"]) == STEPS
    assert sd_runs["losses"] == pytest.approx(sd_runs["eager"], abs=1e-5, rel=0)
    regions = regions_by_class(sd_runs["training_report"])
    # diffusers 0.42 declares UNet2DConditionModel._repeated_blocks = ["BasicTransformerBlock"] and
    # Kiln honours it: the ResnetBlock2D instances are not regions of their own.
    assert set(regions) == {"BasicTransformerBlock"}
    blocks = regions["BasicTransformerBlock"]
    assert all(r.chosen_by.startswith("the model's _repeated_blocks") for r in blocks)
    assert sum(r.instances for r in blocks) == 16
    assert all(r.graphs >= 1 and r.compiled_calls > 0 for r in blocks)
    assert calls(blocks) == (16 * STEPS, 0)  # every block call ran compiled


def test_checkpoint_holds_the_unet_that_diffusers_hooks_wrote(sd_runs):
    checkpoint = sd_runs["folder"] / "checkpoint"
    assert (checkpoint / "unet" / "config.json").is_file()
    assert (checkpoint / "unet" / "diffusion_pytorch_model.safetensors").is_file()
    assert not (checkpoint / "model_0").exists()  # the hook popped its weights
    keys = load_file(checkpoint / "unet" / "diffusion_pytorch_model.safetensors").keys()
    assert not [k for k in keys if "_orig_mod." in k or k.startswith("module.")]


def test_resumed_run_continues_with_the_uninterrupted_losses(sd_runs):
    assert len(sd_runs["resumed"]) == STEPS - SAVE_AFTER
    assert sd_runs["resumed"] == pytest.approx(sd_runs["losses"][SAVE_AFTER:], abs=1e-6, rel=0)
    trained, resumed = sd_runs["unet"].state_dict(), sd_runs["resumed_unet"].state_dict()
    assert max((trained[k] - resumed[k]).abs().max().item() for k in trained) < 1e-6


def validation_inputs() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(5)
    return (torch.randn(BATCH, 4, 16, 16, generator=generator), torch.tensor([5, 50]),
            torch.randn(BATCH, TEXT_TOKENS, 16, generator=generator))


def validate(unet) -> torch.Tensor:
    """A validation pass as the scripts run one: eval mode, no_grad."""
    unet.eval()
    try:
        with torch.no_grad():
            return unet(*validation_inputs()).sample
    finally:
        unet.train()


def test_saved_unet_reloads_in_plain_diffusers_with_the_same_outputs(sd_runs):
    accelerator, unet = sd_runs["accelerator"], sd_runs["unet"]
    folder = sd_runs["folder"] / "final"
    accelerator.unwrap_model(unet).save_pretrained(folder)
    keys = load_file(folder / "diffusion_pytorch_model.safetensors").keys()
    assert not [k for k in keys if "_orig_mod." in k or k.startswith("module.")]
    plain, info = UNet2DConditionModel.from_pretrained(folder, output_loading_info=True)
    assert not (info["missing_keys"] or info["unexpected_keys"] or info["mismatched_keys"])
    assert set(keys) == set(UNet2DConditionModel(**SD_UNET_LAYOUT).state_dict())
    torch.testing.assert_close(validate(unet), validate(plain), atol=1e-6, rtol=0)


def test_validation_under_no_grad_runs_compiled_regions(sd_runs):
    accelerator, unet = sd_runs["accelerator"], sd_runs["unet"]
    before, _ = calls(regions_by_class(accelerator.compile_report())["BasicTransformerBlock"])
    with warnings.catch_warnings():
        # A new grad mode and eval mode after warm-up: new graphs, no recompile warning.
        warnings.simplefilter("error", KilnRecompileWarning)
        prediction = validate(unet)
    assert prediction.shape == (BATCH, 4, 16, 16) and torch.isfinite(prediction).all()
    blocks = regions_by_class(accelerator.compile_report())["BasicTransformerBlock"]
    assert calls(blocks) == (before + sum(r.instances for r in blocks), 0)
    assert not any(r.recompile_limit_hit for r in blocks)


def test_unconditional_unet2d_model_trains_and_reloads_clean(tmp_path):
    torch.manual_seed(0)
    config = dict(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                  down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                  norm_num_groups=8, attention_head_dim=8)
    unet = UNet2DModel(**config)
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    scheduler = DDPMScheduler(num_train_timesteps=TRAIN_TIMESTEPS)
    for _ in range(2):
        images = torch.randn(BATCH, 3, 16, 16)
        noise = torch.randn_like(images)
        timesteps = torch.randint(0, TRAIN_TIMESTEPS, (BATCH,))
        loss = F.mse_loss(unet(scheduler.add_noise(images, noise, timesteps), timesteps).sample, noise)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    report = accelerator.compile_report()
    assert report.regions and all(r.compiled_calls > 0 and r.eager_calls == 0 for r in report.regions)

    accelerator.unwrap_model(unet).save_pretrained(tmp_path / "unet")
    keys = load_file(tmp_path / "unet" / "diffusion_pytorch_model.safetensors").keys()
    assert not [k for k in keys if "_orig_mod." in k or k.startswith("module.")]
    plain, info = UNet2DModel.from_pretrained(tmp_path / "unet", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    sample, timestep = torch.randn(1, 3, 16, 16), torch.tensor([10])
    with torch.no_grad():
        torch.testing.assert_close(unet(sample, timestep).sample, plain(sample, timestep).sample, atol=1e-6, rtol=0)


def train_with_ema(*, checkpoint_dir=None, resume_from=None, steps=4, save_after=2):
    """train_text_to_image.py --use_ema: an EMAModel of the UNet stepped after each optimizer step,
    saved and loaded by the script's hooks as `unet_ema/`."""
    from diffusers.training_utils import EMAModel

    unet = tiny_sd_unet(0)
    torch.manual_seed(0)
    ema_unet = EMAModel(tiny_sd_unet(0).parameters(), decay=0.9, model_cls=UNet2DConditionModel, model_config=unet.config)
    accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(backend="aot_eager", use_regional_compilation=True))

    def save_ema(models, weights, output_dir):
        if accelerator.is_main_process:
            ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))

    def load_ema(models, input_dir):
        loaded = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel)
        ema_unet.load_state_dict(loaded.state_dict())

    accelerator.register_save_state_pre_hook(save_ema)
    accelerator.register_load_state_pre_hook(load_ema)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(batches()[:steps], batch_size=None)
    unet, optimizer, loader = accelerator.prepare(unet, optimizer, loader)
    scheduler = DDPMScheduler(num_train_timesteps=TRAIN_TIMESTEPS)
    skip = 0
    if resume_from is not None:
        accelerator.load_state(resume_from)
        skip = save_after
        loader = accelerator.skip_first_batches(loader, skip)
    for step, batch in enumerate(loader, start=skip):
        with accelerator.accumulate(unet):
            accelerator.backward(noise_prediction_loss(unet, batch, scheduler))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            ema_unet.step(unet.parameters())
        if checkpoint_dir is not None and step + 1 == save_after:
            accelerator.save_state(checkpoint_dir)
    return unet, ema_unet


def test_ema_of_a_compiled_unet_saves_and_resumes_with_the_scripts_hooks(tmp_path):
    unet, ema = train_with_ema(checkpoint_dir=tmp_path / "checkpoint")
    assert (tmp_path / "checkpoint" / "unet_ema" / "diffusion_pytorch_model.safetensors").is_file()
    _, resumed = train_with_ema(resume_from=tmp_path / "checkpoint")
    assert ema.optimization_step == resumed.optimization_step == 4
    for a, b in zip(ema.shadow_params, resumed.shadow_params):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # The average lags the trained weights: the EMA really stepped on the compiled model's parameters.
    assert any((s - p).abs().max() > 1e-4 for s, p in zip(ema.shadow_params, unet.parameters()))
