"""The compile suite's diffusion rows: a diffusers UNet with random weights and one noise-prediction
training step (or a no_grad call), for kiln.bench.measure.

Depends on torch, diffusers and kiln.bench.plan only; imported by kiln.bench.measure for the
models in DIFFUSION_MODELS, so the Llama rows never need diffusers.
"""

from __future__ import annotations

from typing import Any, Callable

from kiln.bench.plan import DIFFUSION_MODELS

TEXT_TOKENS = 8  # the conditioning sequence of the SD-layout UNet (CLIP's is 77)


def build_unet(row: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(model, config, inputs): a seeded UNet in the row's dtype on the row's device, and one batch
    of latents (`seq` x `seq`), timesteps, text states (SD layout) and the noise to predict."""
    import torch
    from diffusers import UNet2DConditionModel, UNet2DModel

    settings = DIFFUSION_MODELS[row["model"]]
    conditioned = "cross_attention_dim" in settings
    torch.manual_seed(row["seed"])
    with torch.device(row["device"]):
        cls = UNet2DConditionModel if conditioned else UNet2DModel
        model = cls(sample_size=row["seq"], **settings).to(getattr(torch, row["dtype"]))
        shape = (row["batch"], settings["in_channels"], row["seq"], row["seq"])
        inputs = {"sample": torch.randn(shape, dtype=model.dtype),
                  "timestep": torch.randint(0, 1000, (row["batch"],)),
                  "target": torch.randn(shape, dtype=model.dtype)}
        if conditioned:
            inputs["encoder_hidden_states"] = torch.randn(row["batch"], TEXT_TOKENS, settings["cross_attention_dim"],
                                                          dtype=model.dtype)
    return model, model.config, inputs


def unet_loss(model: Any, inputs: dict[str, Any]) -> Any:
    """The noise-prediction loss of one batch (the start-up suite's training job)."""
    import torch

    call = {k: v for k, v in inputs.items() if k != "target"}
    return torch.nn.functional.mse_loss(model(**call).sample, inputs["target"])


def make_unet_step(run_model: Any, model: Any, inputs: dict[str, Any], row: dict[str, Any]) -> Callable[[], None]:
    """One training step (predict the noise, MSE, backward, AdamW, zero_grad) or one no_grad call."""
    import torch

    train = row["workload"] == "train"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5) if train else None
    call = {k: v for k, v in inputs.items() if k != "target"}

    def step() -> None:
        if train:
            loss = torch.nn.functional.mse_loss(run_model(**call).sample, inputs["target"])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                run_model(**call)

    return step
