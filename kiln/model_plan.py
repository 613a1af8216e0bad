"""One plan per prepared model: its blocks, chosen once, which every transformation of `prepare`
takes in turn (float8, tensor parallel, activation checkpointing, compile, the strategy's shards).

Depends on kiln.compile.regions (how blocks are chosen) only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from kiln.compile.regions import find_repeated_blocks, select_blocks


@dataclass(frozen=True)
class ModelPlan:
    """blocks: each block class and the paths of its instances, in model order. regional: they are
    the compiled regions too (under a full compile, or none, they are still the units the
    strategy shards and checkpoints)."""

    blocks: dict[type, list[str]]
    regional: bool

    @property
    def block_paths(self) -> list[str]:
        return [path for paths in self.blocks.values() for path in paths]


def plan_model(model: nn.Module, dynamo_plugin: Any) -> ModelPlan:
    """The blocks the user chose (`block_classes`, `block_paths`), else the ones the model declares,
    else its repeated ones (kiln.compile.regions.select_blocks)."""
    regional = dynamo_plugin is not None and dynamo_plugin.enabled and dynamo_plugin.use_regional_compilation
    if regional:
        return ModelPlan(select_blocks(model, dynamo_plugin.block_classes, dynamo_plugin.block_paths), True)
    return ModelPlan(find_repeated_blocks(model), False)
