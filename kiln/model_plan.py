"""One plan per prepared model, and the transformations of `prepare` that take it in turn: the
blocks are chosen once; each transformation is one function of (model, plan, parts); `TRANSFORMS`
is the one place that orders them, so a new parallel dimension is one more function there.

Depends on kiln.compile.regions (how blocks are chosen), kiln.activation_checkpointing and
kiln.parallel.context_parallel; the Accelerator's parts (precision, strategy, compile session)
arrive as objects, so nothing here imports the facade or a strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from kiln.activation_checkpointing import apply_activation_checkpointing
from kiln.compile.regions import find_repeated_blocks, select_blocks
from kiln.parallel.context_parallel import check_inputs_under_context_parallel, check_model, drop_block_masks


@dataclass(frozen=True)
class ModelPlan:
    """blocks: each block class and the paths of its instances, in model order. regional: they are
    the compiled regions too (under a full compile, or none, they are still the units the
    strategy shards and checkpoints). training: prepared to train (False: `evaluation_mode`, which
    is neither split, checkpointed nor wrapped). context_parallel: its sequences are sliced over
    a `cp` group inside `maybe_context_parallel`."""

    blocks: dict[type, list[str]]
    regional: bool
    training: bool = True
    context_parallel: bool = False

    @property
    def block_paths(self) -> list[str]:
        return [path for paths in self.blocks.values() for path in paths]


@dataclass(frozen=True)
class PrepareParts:
    """What the transformations draw on: the Accelerator's precision, strategy and compile session."""

    precision: Any
    strategy: Any
    compiler: Any
    device: torch.device


def plan_model(model: nn.Module, dynamo_plugin: Any, training: bool = True,
               parallelism_config: Any = None) -> ModelPlan:
    """The blocks the user chose (`block_classes`, `block_paths`), else the ones the model declares,
    else its repeated ones (kiln.compile.regions.select_blocks)."""
    regional = dynamo_plugin is not None and dynamo_plugin.enabled and dynamo_plugin.use_regional_compilation
    blocks = (select_blocks(model, dynamo_plugin.block_classes, dynamo_plugin.block_paths) if regional
              else find_repeated_blocks(model))
    context_parallel = parallelism_config is not None and parallelism_config.cp_enabled
    return ModelPlan(blocks, regional, training, context_parallel)


# ----- the transformations, in their order (TRANSFORMS below) -----------------------------------
def split_tensor_parallel(model: nn.Module, plan: ModelPlan, parts: PrepareParts) -> nn.Module:
    """Each block's projections split over the `tp` group (the strategy keeps the mesh, and the
    names of the parameters it replaces, for the optimizer); nothing without tensor parallelism."""
    if plan.training:
        parts.strategy.parallelize(model, plan.block_paths)
    return model


def hook_context_parallel(model: nn.Module, plan: ModelPlan, parts: PrepareParts) -> nn.Module:
    """A model whose attention context parallelism cannot slice is refused; its inputs are checked,
    and its blocks' masks dropped, inside `maybe_context_parallel` (kiln.parallel.context_parallel)."""
    if plan.training and plan.context_parallel:
        check_model(model)
        check_inputs_under_context_parallel(model)
        drop_block_masks(model, plan.block_paths)
    return model


def checkpoint_blocks(model: nn.Module, plan: ModelPlan, parts: PrepareParts) -> nn.Module:
    if plan.training and parts.strategy.activation_checkpointing:
        apply_activation_checkpointing(model, plan.block_paths)
    return model


def compile_model(model: nn.Module, plan: ModelPlan, parts: PrepareParts) -> nn.Module:
    """In place, as the plugin says: the plan's blocks as regions, or the whole model."""
    parts.compiler.compile(model, parts.device, {"precision": parts.precision.mode, "strategy": parts.strategy.name},
                           blocks=plan.blocks if plan.regional else None)
    return model


def wrap_precision(model: nn.Module, plan: ModelPlan, parts: PrepareParts) -> nn.Module:
    parts.precision.wrap_forward(model)
    return model


def wrap_strategy(model: nn.Module, plan: ModelPlan, parts: PrepareParts) -> nn.Module:
    """What the user trains: DDP's wrapper, FSDP2's shards (of each block, then the root), the
    DeepSpeed engine's module; an evaluation-only model as it is, in eval mode."""
    if not plan.training:
        return model.eval()
    return parts.strategy.wrap_model(model, plan.block_paths)


# The order is torchtitan's. Split before compile, so each compiled block holds the split matmuls
# and their collectives; the context-parallel hooks sit on the blocks, outside their compiled
# forward; checkpoint before compile, so the recompute is inside each block's graph; compile before
# the precision wrapper, which then runs the compiled forward under autocast (DESIGN.md, "mixed
# precision must not hide"); the strategy last, so FSDP2 shards what was compiled.
TRANSFORMS: tuple[Callable[[nn.Module, ModelPlan, PrepareParts], nn.Module], ...] = (
    split_tensor_parallel, hook_context_parallel, checkpoint_blocks, compile_model, wrap_precision, wrap_strategy)


def transform(model: nn.Module, plan: ModelPlan, parts: PrepareParts) -> nn.Module:
    """Every transformation of `TRANSFORMS` in turn; returns what the user trains."""
    for step in TRANSFORMS:
        model = step(model, plan, parts)
    return model
