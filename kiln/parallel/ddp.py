"""DistributedDataParallel: every process holds the whole model; gradients are averaged in backward.

Depends on torch only. The model arrives compiled in place (regions or whole), so DDP wraps the
same module the user built and its hooks see the compiled forward run inside (DESIGN.md: compile
in place inside the module DDP wraps).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from kiln.parallel.base import Strategy


class DDPStrategy(Strategy):
    name = "ddp"
    replicated = True

    def __init__(self, device: torch.device, ddp_kwargs: dict[str, Any] | None = None,
                 comm_hook: Callable[[DistributedDataParallel], None] | None = None) -> None:
        self.device = device
        self.ddp_kwargs = dict(ddp_kwargs or {})  # DistributedDataParallelKwargs' non-default fields
        self.comm_hook = comm_hook

    # Every process runs the same regions: one compiles each ahead of time, the others load it.
    precompiles_by_default = True

    def wrap_model(self, model: nn.Module, block_paths: list[str]) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (a frozen or evaluation-only model)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        wrapped = DistributedDataParallel(model, device_ids=device_ids, **self.ddp_kwargs)
        if self.comm_hook is not None:
            self.comm_hook(wrapped)
        return wrapped

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DistributedDataParallel) else model

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if isinstance(model, DistributedDataParallel):
            with model.no_sync():
                yield
        else:
            yield
