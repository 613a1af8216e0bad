"""Prepared optimizers and schedulers: they step only at the end of an accumulation window.

Depends on torch and kiln.accumulation only.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kiln.accumulation import GradientState


class DelegatesToWrapped:
    """Reads and writes of what the wrapper does not define itself go to the object the user gave,
    as with Lightning's wrappers: a custom optimizer's own methods and attributes, a scheduler's
    `last_epoch`. (Accelerate's optimizer forwards only `train()`/`eval()`; its dataloader reads.)

    `_wrapped` names the instance attribute holding the user's object. A write goes to that object
    when the wrapper has no attribute of that name and the object has one; otherwise the wrapper
    keeps it. `__init__` sets the wrapped object last, so that everything it sets before is the
    wrapper's own even where the user's object has an attribute of the same name.
    """

    _wrapped: str

    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails. While pickle or copy rebuild an instance its
        # __dict__ is still empty: reading self.<_wrapped> here would recurse without end.
        wrapped = self.__dict__.get(self._wrapped, _MISSING)
        if wrapped is _MISSING:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        try:
            return getattr(wrapped, name)
        except AttributeError as error:
            if error.name is not None and error.name != name:
                raise  # raised inside one of the user's properties, about something else: theirs to see
            missing = AttributeError(f"'{type(self).__name__}' object has no attribute '{name}', nor has the "
                                     f"{type(wrapped).__name__} it wraps", name=name, obj=self)
            raise missing from (None if error.obj is wrapped else error)

    def __setattr__(self, name: str, value: Any) -> None:
        wrapped = self.__dict__.get(self._wrapped, _MISSING)
        if (wrapped is _MISSING or name in self.__dict__ or hasattr(type(self), name)
                or not hasattr(wrapped, name)):
            object.__setattr__(self, name, value)
        else:
            setattr(wrapped, name, value)

    def __delattr__(self, name: str) -> None:
        wrapped = self.__dict__.get(self._wrapped, _MISSING)
        if wrapped is _MISSING or name in self.__dict__ or hasattr(type(self), name):
            object.__delattr__(self, name)
        else:
            delattr(wrapped, name)


_MISSING = object()


class PreparedOptimizer(DelegatesToWrapped, torch.optim.Optimizer):
    """Wraps the user's optimizer; `step` and `zero_grad` wait for `sync_gradients`.

    With fp16 it steps through the gradient scaler and records whether the step was skipped
    for inf/NaN gradients (the scheduler then skips too). Subclasses `Optimizer` so that
    `isinstance` checks in user code and schedulers keep working, but holds no state of its own:
    everything else it is asked for (a schedule-free optimizer's `train()`, a custom attribute)
    is the user's optimizer's.
    """

    _wrapped = "optimizer"

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                 scaler: torch.amp.GradScaler | None = None,
                 on_step: Callable[[], None] | None = None) -> None:
        self.on_step = on_step  # told after each real step (the accelerator counts warm-up steps)
        self.gradient_state = gradient_state
        self.scaler = scaler
        self.step_was_skipped = False
        self._unscaled = False
        self.optimizer = optimizer  # last: see DelegatesToWrapped

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.gradient_state.sync_gradients:
            self.optimizer.zero_grad(set_to_none=set_to_none)

    def train(self) -> None:
        """Training mode of a schedule-free optimizer (`schedulefree.AdamWScheduleFree`: parameters
        at the point where gradients are taken). As Accelerate's, it does nothing for an optimizer
        without modes, so one script serves both kinds."""
        mode = getattr(self.optimizer, "train", None)
        if callable(mode):
            mode()

    def eval(self) -> None:
        """Evaluation mode of a schedule-free optimizer (parameters at the averaged point, the ones
        to evaluate and to save); nothing for an optimizer without modes."""
        mode = getattr(self.optimizer, "eval", None)
        if callable(mode):
            mode()

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


class PreparedScheduler(DelegatesToWrapped):
    """Wraps the user's LR scheduler; steps only when its optimizers really stepped.

    As Accelerate's does, it steps the scheduler `ticks_per_step` times per optimizer step: the
    number of processes, unless batches are split (then once). Scripts written for Accelerate
    size their schedules for this (`num_warmup_steps * accelerator.num_processes`), so their
    learning rate per optimizer step is the same on any number of processes.
    """

    _wrapped = "scheduler"

    def __init__(self, scheduler: Any, optimizers: list[PreparedOptimizer],
                 gradient_state: GradientState, step_with_optimizer: bool = True, ticks_per_step: int = 1) -> None:
        self.optimizers = optimizers
        self.gradient_state = gradient_state
        self.step_with_optimizer = step_with_optimizer
        self.ticks_per_step = ticks_per_step
        self.scheduler = scheduler  # last: see DelegatesToWrapped

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
