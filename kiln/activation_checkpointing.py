"""Activation checkpointing per block: each block's activations are recomputed in backward instead
of kept, trading compute for memory.

Depends on torch only. It replaces each block's forward in place (class, keys and hooks stay), with
one shared function per block class, so a regional compile afterwards compiles the checkpointed
forward once per class (DESIGN.md order: checkpointing, then compile, then sharding).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpointed_forward(forward: Callable) -> Callable:
    """`forward(module, ...)` run under non-reentrant checkpointing (the variant Dynamo traces);
    without grad there is no backward to recompute for, and it runs as is (evaluation, generation)."""

    def forward_with_checkpointing(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(module, *args, **kwargs)
        return checkpoint(forward, module, *args, use_reentrant=False, **kwargs)

    forward_with_checkpointing._kiln_checkpointed = forward
    return forward_with_checkpointing


def apply_activation_checkpointing(model: nn.Module, block_paths: list[str]) -> None:
    """Checkpoint each block at `block_paths`; all blocks of one class share one forward function."""
    shared: dict[type, Callable] = {}
    for path in block_paths:
        block = model.get_submodule(path)
        if "forward" in vars(block):
            raise ValueError(f"block {path} already has its forward replaced (compiled or checkpointed); "
                             "apply activation checkpointing before compiling, once")
        cls = type(block)
        if cls not in shared:
            shared[cls] = checkpointed_forward(cls.forward)
        block.forward = types.MethodType(shared[cls], block)
