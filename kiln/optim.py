"""Prepared optimizers and schedulers: they step only at the end of an accumulation window.

Depends on torch and kiln.accumulation only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kiln.accumulation import GradientState


class PreparedOptimizer(torch.optim.Optimizer):
    """Wraps the user's optimizer; `step` and `zero_grad` wait for `sync_gradients`.

    With fp16 it steps through the gradient scaler and records whether the step was skipped
    for inf/NaN gradients (the scheduler then skips too). Subclasses `Optimizer` so that
    `isinstance` checks in user code and schedulers keep working, but holds no state of its own.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                 scaler: torch.amp.GradScaler | None = None,
                 on_step: Callable[[], None] | None = None) -> None:
        self.optimizer = optimizer
        self.on_step = on_step  # told after each real step (the accelerator counts warm-up steps)
        self.gradient_state = gradient_state
        self.scaler = scaler
        self.step_was_skipped = False
        self._unscaled = False

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def unscale_gradients(self) -> None:
        """Divide the gradients by the fp16 loss scale, once per step (clipping needs true values)."""
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def step(self, closure: Any = None) -> Any:
        if not self.gradient_state.sync_gradients:
            return None
        self._unscaled = False
        if self.scaler is None:
            self.step_was_skipped = False
            result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        else:
            scale_before = self.scaler.get_scale()
            result = self.scaler.step(self.optimizer, closure) if closure is not None else self.scaler.step(self.optimizer)
            self.scaler.update()
            self.step_was_skipped = self.scaler.get_scale() < scale_before
        if self.on_step is not None:
            self.on_step()
        return result

    def __getstate__(self) -> dict[str, Any]:
        return self.__dict__.copy()

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"PreparedOptimizer({self.optimizer!r})"


class PreparedScheduler:
    """Wraps the user's LR scheduler; steps only when its optimizers really stepped.

    As Accelerate's does, it steps the scheduler `ticks_per_step` times per optimizer step: the
    number of processes, unless batches are split (then once). Scripts written for Accelerate
    size their schedules for this (`num_warmup_steps * accelerator.num_processes`), so their
    learning rate per optimizer step is the same on any number of processes.
    """

    def __init__(self, scheduler: Any, optimizers: list[PreparedOptimizer],
                 gradient_state: GradientState, step_with_optimizer: bool = True, ticks_per_step: int = 1) -> None:
        self.scheduler = scheduler
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.ticks_per_step = ticks_per_step

    def step(self, *args: Any, **kwargs: Any) -> None:
        if not self.step_with_optimizer:
            self.scheduler.step(*args, **kwargs)
            return
        if not self.gradient_state.sync_gradients:
            return
        if any(opt.step_was_skipped for opt in self.optimizers):
            return
        for _ in range(self.ticks_per_step):
            # OneCycleLR raises past its total_steps; a short last batch can take it there.
            total = getattr(self.scheduler, "total_steps", None)
            if total is not None and self.scheduler._step_count > total:
                return
            self.scheduler.step(*args, **kwargs)

    def get_last_lr(self) -> list[float]:
        return self.scheduler.get_last_lr()

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":
            raise AttributeError(name)
        return getattr(self.scheduler, name)
