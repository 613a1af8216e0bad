"""A small residual MLP stack whose blocks the background helper cannot compile ahead of time, as
torch 2.11 cannot save aot_eager's output ("expected OutputCode, got function"): the helper's
fallback (a JIT compile into the shared caches) is then tested on any torch.

The refusal is made where the helper imports this module to rebuild a block (it runs with
KILN_BACKGROUND_PARENT set); the training process that imports it is left as it is.
"""

import os

import torch
from torch import nn


class RefusedBlock(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class RefusedStack(nn.Module):
    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RefusedBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return nn.functional.mse_loss(self.head(x).squeeze(-1), target)


def _refuse(*args, **kwargs):
    raise RuntimeError("expected OutputCode, got function (refused by tests/compile/artifacts/refusing_block.py, "
                       "as torch 2.11 refuses aot_eager's output)")


if os.environ.get("KILN_BACKGROUND_PARENT"):
    from kiln.compile.artifacts import precompiled

    precompiled.compile_ahead_of_time = _refuse
