"""The strategy interface, and the strategy for one process (which changes nothing).

Depends on torch and kiln.state only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from kiln.state import DistributedType


class Strategy:
    """Spreads a model over the processes: wrap it, skip a gradient sync, unwrap it, and read or
    write its weights whole or (for sharding strategies) per process."""

    name = "base"
    distributed_type: DistributedType | None = None  # None: the process state's own type
    sharded_checkpoints = False  # True: save_state writes each process's shard (DCP)
    activation_checkpointing = False  # True: prepare checkpoints each repeated block first

    def wrap_model(self, model: nn.Module, block_paths: list[str]) -> nn.Module:
        """Called by `prepare` after compile and precision: returns what the user trains."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever `wrap_model` returned."""
        return model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Gradients computed inside are not synchronised yet (accumulation)."""
        yield

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point the optimizer at the parameters the strategy made (sharding replaces them)."""

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights under its plain names (a collective for sharded models)."""
        return self.unwrap(model).state_dict()

    def save_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer]) -> str:
        raise NotImplementedError(f"{self.name} writes whole checkpoints")

    def load_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer]) -> None:
        raise NotImplementedError(f"{self.name} reads whole checkpoints")


class SingleProcess(Strategy):
    name = "single"
