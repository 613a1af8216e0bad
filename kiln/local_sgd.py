"""Local SGD: each process steps its own copy of the model on its own gradients, and the copies are
averaged every few steps instead of the gradients every step (Accelerate's `accelerate.local_sgd`).

Depends on torch only (the facade for type hints alone): it drives the Accelerator it is given,
through its `no_sync` and its strategy's `average_parameters`, and never imports a strategy.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from kiln.accelerator import Accelerator


class LocalSGD:
    """Skip the gradient all-reduce and average the parameters every `local_sgd_steps` calls of `step()`.

    Inside the `with` block the prepared model runs under `accelerator.no_sync`, so each process's
    optimizer steps on that process's gradients alone; every `local_sgd_steps`-th call of `step()`,
    and once more on leaving the block, every parameter becomes its mean over the processes. With
    `enabled=False`, or on a single process, it changes nothing: plain data parallel training.

    `step()` counts calls, as Accelerate's does: called once per micro-batch inside
    `accelerator.accumulate`, as Accelerate's example does, a window of `local_sgd_steps`
    micro-batches; pick a multiple of the gradient accumulation steps to average right after
    optimizer steps. Optimizer states (AdamW's moments) stay per process; only parameters average.

    >>> with LocalSGD(accelerator=accelerator, model=model, local_sgd_steps=8) as local_sgd:
    ...     for batch in loader:
    ...         with accelerator.accumulate(model):
    ...             accelerator.backward(model(**batch).loss)
    ...             optimizer.step()
    ...             optimizer.zero_grad()
    ...             local_sgd.step()
    """

    def __init__(self, accelerator: Accelerator, model: nn.Module, local_sgd_steps: int | None,
                 enabled: bool = True) -> None:
        self.accelerator = accelerator
        self.model = model
        self.local_sgd_steps = local_sgd_steps
        self.num_steps = 0  # step() calls, as Accelerate counts them (also when disabled)
        self._steps_since_average = 0
        self._no_sync: contextlib.ExitStack | None = None
        if enabled:
            _check_arguments(accelerator, model, local_sgd_steps)
        # One process has nothing to average and no gradient sync to skip (as in Accelerate).
        self.enabled = bool(enabled) and accelerator.num_processes > 1

    def __enter__(self) -> LocalSGD:
        if self.enabled:
            self._no_sync = contextlib.ExitStack()
            self._no_sync.enter_context(self.accelerator.no_sync(self.model))
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        if not self.enabled or self._no_sync is None:
            return
        try:
            # No average after an error: the other processes may not reach this collective, and
            # one waiting for them would hang until the process group's timeout.
            if kind is None and self._steps_since_average:
                self._average()
        finally:
            self._no_sync.close()
            self._no_sync = None

    def step(self) -> None:
        """Count one step (call it after each `optimizer.step()`); average when a window is full."""
        self.num_steps += 1
        if not self.enabled:
            return
        if self._no_sync is None:
            raise RuntimeError("LocalSGD.step() was called outside its `with` block, where gradients are "
                               "still all-reduced; use `with LocalSGD(...) as local_sgd:` around the loop")
        self._steps_since_average += 1
        if self.num_steps % self.local_sgd_steps == 0:
            self._average()

    def _average(self) -> None:
        self.accelerator.strategy.average_parameters(self.model)
        self._steps_since_average = 0


def _check_arguments(accelerator: Any, model: nn.Module, local_sgd_steps: Any) -> None:
    if not isinstance(local_sgd_steps, int) or isinstance(local_sgd_steps, bool) or local_sgd_steps < 1:
        raise ValueError(f"local_sgd_steps must be a positive int (steps between parameter averages), got "
                         f"{local_sgd_steps!r}; pass enabled=False to train without local SGD")
    strategy = accelerator.strategy
    if not strategy.replicated:
        raise NotImplementedError(
            f"LocalSGD is not supported with {strategy.name}: local SGD needs every process to hold the whole "
            "model and step it from its own gradients, while FSDP2 steps each process's shard from "
            "reduce-scattered gradients and DeepSpeed's engine reduces gradients inside its own backward "
            "and step (Accelerate refuses these too); train with DDP (no fsdp_plugin or deepspeed_plugin) "
            "or pass enabled=False")
    if not any(model is prepared for prepared in accelerator._models):
        raise ValueError(
            f"LocalSGD got a {type(model).__name__} that this Accelerator did not return from prepare(); pass "
            "the model prepare() returned (under DDP the wrapper, whose no_sync is what skips the gradient "
            "all-reduce)")
