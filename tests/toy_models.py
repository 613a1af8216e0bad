"""Small models for the tests: an in-repo encoder-decoder with two block stacks, and tiny
transformers and diffusers configs (random weights, nothing downloaded)."""

from __future__ import annotations

import torch
from torch import nn


class EncoderBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class DecoderBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(torch.cat([self.norm(x), memory], dim=-1)))


class EncoderDecoder(nn.Module):
    """Two stacks of different block classes, a ModuleList and a Sequential."""

    def __init__(self, width: int = 16, depth: int = 3, classes: int = 4) -> None:
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.encoder = nn.Sequential(*(EncoderBlock(width) for _ in range(depth)))
        self.decoder = nn.ModuleList(DecoderBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        memory = self.encoder(h)
        for block in self.decoder:
            h = block(h, memory)
        return self.head(h)


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, step: int, accelerator=None) -> float:
    """One training step of an EncoderDecoder-shaped model (8 features in, 4 classes out) on the
    seeded batch `step`, through `accelerator.backward` when given: the loss."""
    generator = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 6, 8, generator=generator), torch.randint(0, 4, (4, 6), generator=generator)
    loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    accelerator.backward(loss) if accelerator is not None else loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


def llama_run_with_checkpoint(accelerator, checkpoint, mode: str, steps: int = 4, saved_at: int = 2,
                              **load_kwargs) -> list[float]:
    """A 2-layer `tiny_llama` prepared with SGD and trained on seeded batches; its losses. 'save': steps
    0..steps-1 with `save_state(checkpoint)` after `saved_at` steps; 'resume': `load_state(checkpoint,
    **load_kwargs)`, then steps saved_at..steps-1; anything else: steps 0..steps-1."""
    torch.manual_seed(0)
    model = tiny_llama(2)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    start = 0
    if mode == "resume":
        accelerator.load_state(checkpoint, **load_kwargs)
        start = saved_at
    losses = []
    for step in range(start, steps):
        ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(step))
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if mode == "save" and step == saved_at - 1:
            accelerator.save_state(checkpoint)
    return losses


class BreakingEncoderBlock(EncoderBlock):
    """An encoder block whose forward has a graph break (as a print or a `.item()` makes one)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        torch._dynamo.graph_break()
        return x + self.mlp(h)


class BreakingEncoderDecoder(EncoderDecoder):
    """EncoderDecoder whose encoder blocks break the graph: it compiles only under fullgraph=False."""

    def __init__(self, width: int = 16, depth: int = 3, classes: int = 4) -> None:
        super().__init__(width, depth, classes)
        self.encoder = nn.Sequential(*(BreakingEncoderBlock(width) for _ in range(depth)))


class Regressor(nn.Module):
    """Takes a batch dict and returns a dict with a loss, like a transformers model."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.body = EncoderDecoder(width, depth, classes=1)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> dict:
        prediction = self.body(x).squeeze(-1)
        out = {"prediction": prediction}
        if y is not None:
            out["loss"] = torch.nn.functional.mse_loss(prediction, y)
        return out


class Flat(nn.Module):
    """No repeated blocks at all."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def tiny_gpt2(layers: int = 3):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=layers, n_embd=32, n_head=4, vocab_size=97, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"
    return model


def tiny_llama(layers: int = 3, width: int = 32, init_std: float = 0.02):
    """width=64, init_std=0.08 gives a gradient norm of about 3 at the start (parity tests need
    gradients that clipping at 1.0 would change)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(num_hidden_layers=layers, hidden_size=width, intermediate_size=2 * width,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                         initializer_range=init_std)
    model = LlamaForCausalLM(config)
    model.loss_type = "ForCausalLM"
    return model


# Stable Diffusion 1.5's UNet block layout (4 down and 4 up blocks, 2 resnets a block, cross-attention
# at three levels) at tiny widths: 22 ResnetBlock2D in 12 shapes, 16 BasicTransformerBlock.
SD_UNET_LAYOUT = dict(sample_size=16, in_channels=4, out_channels=4, layers_per_block=2,
                      block_out_channels=(16, 32, 64, 64), norm_num_groups=8,
                      down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
                      up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
                      cross_attention_dim=16, attention_head_dim=4)


def tiny_sd_unet(seed: int = 0):
    """A diffusers UNet2DConditionModel of SD_UNET_LAYOUT with weights seeded by `seed`."""
    from diffusers import UNet2DConditionModel

    torch.manual_seed(seed)
    return UNet2DConditionModel(**SD_UNET_LAYOUT)
