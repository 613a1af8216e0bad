"""The strategy interface, and the strategy for one process (which changes nothing).

Depends on torch, kiln.state, kiln.optim, kiln.collectives and kiln.checkpoint.sharded only.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from kiln import collectives
from kiln.accumulation import GradientState
from kiln.checkpoint.sharded import load_dcp
from kiln.optim import PreparedOptimizer
from kiln.state import DistributedType


class Strategy:
    """Spreads a model over the processes: wrap it, skip a gradient sync, unwrap it, and read or
    write its weights whole or (for sharding strategies) per process."""

    name = "base"
    distributed_type: DistributedType | None = None  # None: the process state's own type
    sharded_checkpoints = False  # True: the weights live in shards; whole checkpoints are loaded into them
    activation_checkpointing = False  # True: prepare checkpoints each repeated block first
    owns_backward = False  # True: backward, the optimizer step, clipping and loss scaling are its own
    # True: every process holds the whole model and, inside no_sync, steps it from its own gradients
    # alone, so its parameters can be averaged (local SGD).
    replicated = False

    def check_compile(self, dynamo_plugin: Any) -> None:
        """Refuse, at construction, a compile setting this strategy cannot run."""

    @property
    def precompiles_by_default(self) -> bool:
        """Whether precompiled regions are the default under this strategy (precompile left unset
        becomes "auto"): where several processes compile the same blocks and share the result."""
        return False

    def begin_prepare(self, objects: tuple[Any, ...]) -> None:
        """Told everything one prepare() call holds, before any of it is prepared."""

    def wrap_model(self, model: nn.Module, block_paths: list[str]) -> nn.Module:
        """Called by `prepare` after compile and precision: returns what the user trains."""
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's own module inside whatever `wrap_model` returned."""
        return model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                       scaler: torch.amp.GradScaler | None,
                       on_step: Callable[[], None] | None) -> PreparedOptimizer:
        """What the user steps: waits for the end of an accumulation window, scales for fp16."""
        self.prepare_optimizer(optimizer)
        return PreparedOptimizer(optimizer, gradient_state, scaler, on_step=on_step)

    def backward(self, loss: torch.Tensor, sync_gradients: bool, **kwargs: Any) -> None:
        """Only for strategies that own the backward pass (`owns_backward`)."""
        raise NotImplementedError(f"{self.name} leaves backward to the accelerator")

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | None:
        """Only for strategies that own the backward pass, and so the clipping."""
        raise NotImplementedError(f"{self.name} leaves clipping to the accelerator")

    def parallelize(self, model: nn.Module, block_paths: list[str]) -> None:
        """Split the blocks across processes (tensor parallel) before they are compiled; nothing by default."""

    def clip_grad_norm_of(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The accelerator's `clip_grad_norm_` (gradients already unscaled): torch's."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Gradients computed inside are not synchronised yet (accumulation)."""
        yield

    def average_parameters(self, model: nn.Module) -> None:
        """Local SGD's average: each parameter becomes its mean over the processes, in place (a
        collective; the identity on one process). Only for `replicated` strategies."""
        if not self.replicated:
            raise NotImplementedError(f"{self.name} cannot average parameters across processes: each process "
                                      "must hold the whole model and step it from its own gradients")
        with torch.no_grad():
            for param in self.unwrap(model).parameters():
                param.copy_(collectives.reduce(param, "mean"))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point the optimizer at the parameters the strategy made (sharding replaces them)."""

    @property
    def saves_shards(self) -> bool:
        """True: save_state writes each process's shards (DCP); False: whole files, from the main process."""
        return self.sharded_checkpoints

    def receives_weights_from_main(self) -> bool:
        """True: this process's weights are replaced by the main process's at prepare, so they may be
        empty (meta) until then."""
        return False

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The whole model's weights under its plain names (a collective for sharded models)."""
        return self.unwrap(model).state_dict()

    def whole_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """`optimizer.state_dict()` as one process of the plain loop would hold it (a collective for
        sharded models; the main process's is the one written)."""
        return optimizer.state_dict()

    def save_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer]) -> str:
        raise NotImplementedError(f"{self.name} writes whole checkpoints")

    def load_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer], strict: bool = True,
                     saved_processes: int | None = None) -> None:
        """Shards written by FSDP2 (DCP), on any number of processes, into this run's whole model:
        every process reads every tensor. A strategy with its own shard format overrides this.
        `saved_processes`: how many processes wrote them (DCP's metadata makes it irrelevant here)."""
        load_dcp(folder / f"sharded_model_{index}", self.unwrap(model), optimizers, strict=strict)

    def load_whole(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                   model_state: dict[str, torch.Tensor], optimizer_states: list[dict],
                   strict: bool = True) -> None:
        """Whole weights and `optimizer.state_dict()`s, as a whole-checkpoint strategy saved them."""
        self.unwrap(model).load_state_dict(model_state, strict=strict)
        for optimizer, state in zip(optimizers, optimizer_states):
            optimizer.load_state_dict(state)


class SingleProcess(Strategy):
    name = "single"
    replicated = True


def refuse_outer_graph(dynamo_plugin: Any, strategy: str) -> None:
    """A strategy whose hooks gather or shard around each block (FSDP2, DeepSpeed) needs each block
    its own region: one graph around them would have to trace those hooks."""
    if dynamo_plugin is not None and dynamo_plugin.enabled and dynamo_plugin.outer_graph_asked:
        raise NotImplementedError(f"TorchDynamoPlugin(outer_graph={dynamo_plugin.outer_graph!r}) is not supported under "
                                  f"{strategy}, whose hooks "
                                  "run around each block; use regional compilation without it (outer_graph=False)")
