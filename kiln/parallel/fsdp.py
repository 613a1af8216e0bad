"""FSDP2 (`fully_shard`): each repeated block is sharded on its own, then the root; parameters,
gradients and optimizer state live in shards, and checkpoints are written per process with
torch.distributed.checkpoint.

Depends on torch, kiln.checkpoint.sharded and kiln.parallel.base only. The blocks arrive compiled in place; FSDP2's hooks
gather each block's parameters around its compiled forward (DESIGN.md: compile each block, then
shard each block, then the root).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from kiln.checkpoint.sharded import load_dcp, load_whole_into_sharded, save_dcp
from kiln.parallel.base import Strategy
from kiln.state import DistributedType

_DTYPES = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class FullyShardedDataParallelPlugin:
    """FSDP2 settings.

    reshard_after_forward: free each block's gathered parameters after its forward (less memory,
    one more all-gather in backward; the arithmetic is the same). mixed_precision: None or "no"
    keeps the parameters fp32, and the Accelerator's `mixed_precision` autocasts around them, the
    plain loop's arithmetic (Accelerate's FSDP2 default too); "bf16" or "fp16" has FSDP cast the
    gathered parameters to that dtype (half the all-gather traffic, but every op then runs on half
    weights: embeddings and the residual stream too, not only what autocast casts). Gradients are
    always reduced in fp32. activation_checkpointing: recompute each block's activations in
    backward (applied before compile, so it lives inside each compiled block).
    """

    reshard_after_forward: bool = True
    mixed_precision: str | None = None
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        if self.mixed_precision is not None and self.mixed_precision not in _DTYPES:
            raise ValueError(f"unknown FSDP mixed_precision {self.mixed_precision!r}; choose one of: "
                             f"{', '.join(_DTYPES)}")


class FSDPStrategy(Strategy):
    name = "fsdp"
    distributed_type = DistributedType.FSDP
    sharded_checkpoints = True

    def __init__(self, plugin: FullyShardedDataParallelPlugin) -> None:
        self.plugin = plugin
        self.activation_checkpointing = plugin.activation_checkpointing
        self.param_dtype = _DTYPES[plugin.mixed_precision or "no"]
        self._new_parameter: dict[int, nn.Parameter] = {}  # id(old parameter) -> its sharded successor

    def wrap_model(self, model: nn.Module, block_paths: list[str]) -> nn.Module:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        names = {id(p): name for name, p in model.named_parameters()}
        # Blocks first, each its own unit, so only one block's parameters are gathered at a time.
        for path in block_paths:
            fully_shard(model.get_submodule(path), mp_policy=policy,
                        reshard_after_forward=self.plugin.reshard_after_forward)
        fully_shard(model, mp_policy=policy, reshard_after_forward=self.plugin.reshard_after_forward)
        sharded = dict(model.named_parameters())
        self._new_parameter.update({old: sharded[name] for old, name in names.items()})
        return model

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:
            raise ValueError("this optimizer already has state; with FSDP, prepare the optimizer before "
                             "its first step (its parameters are replaced by sharded ones)")
        for group in optimizer.param_groups:
            group["params"] = [self._new_parameter.get(id(p), p) for p in group["params"]]

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Every process takes part in gathering; full tensors, on the CPU, on every process.
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        return {k: v.cpu() for k, v in get_model_state_dict(model, options=options).items()}

    def save_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer]) -> str:
        name = f"sharded_model_{index}"
        save_dcp(folder / name, model, optimizers)
        return name

    def load_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer], strict: bool = True,
                     saved_processes: int | None = None) -> None:
        load_dcp(folder / f"sharded_model_{index}", model, optimizers, strict=strict)  # on any number of processes

    def load_whole(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                   model_state: dict[str, torch.Tensor], optimizer_states: list[dict],
                   strict: bool = True) -> None:
        load_whole_into_sharded(model, optimizers, model_state, optimizer_states, strict=strict)
