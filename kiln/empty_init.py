"""Build a model without memory for its weights (`init_empty_weights`, `init_on_device`), and the
check that no parameter is still empty when training starts (`refuse_empty_tensors`).

Depends on torch and kiln.plugins (one environment flag); never imports the facade or a strategy.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (register_module_buffer_registration_hook,
                                      register_module_parameter_registration_hook)

from kiln.plugins import parse_bool

# Accelerate reads ACCELERATE_INIT_INCLUDE_BUFFERS; Kiln's settings all start with KILN_.
INCLUDE_BUFFERS_ENV = "KILN_INIT_INCLUDE_BUFFERS"
_SHOWN = 5  # names an error lists before "and N more"

_open_contexts = threading.local()  # per thread: the _BuildOnDevice blocks entered, innermost last


def init_empty_weights(include_buffers: bool | None = None) -> _BuildOnDevice:
    """A context under which models are built with their parameters on the meta device: no memory
    is allocated for them and no initialisation runs, whatever the model's size.

    Buffers stay on the CPU unless `include_buffers=True` (default: the environment variable
    KILN_INIT_INCLUDE_BUFFERS, else False), so computed buffers such as a rotary embedding's
    `inv_freq` keep their values; a checkpoint never holds non-persistent buffers, so with
    `include_buffers=True` those stay empty. Fill the model afterwards with `kiln.load_model(model,
    folder)` or `model.load_state_dict(state_dict, assign=True)`.

    Only parameters that a module's constructor creates go to meta: a loader called inside the
    block (`from_pretrained`, `load_state_dict(..., assign=True)`) keeps the weights it assigns.

    >>> with kiln.init_empty_weights():
    ...     model = AutoModelForCausalLM.from_config(config)   # every parameter is_meta
    >>> kiln.load_model(model, "out/")                         # now on the CPU, with the saved values
    """
    return init_on_device(torch.device("meta"), include_buffers=include_buffers)


def init_on_device(device: torch.device | str, include_buffers: bool | None = None) -> _BuildOnDevice:
    """A context under which models are built with their parameters on `device` (and their buffers
    too with `include_buffers=True`); `init_empty_weights` is this with the meta device.

    >>> with kiln.init_on_device("cuda"):
    ...     model = MyModel()   # parameters created on the GPU
    """
    if include_buffers is None:
        raw = os.environ.get(INCLUDE_BUFFERS_ENV)
        include_buffers = parse_bool(raw, INCLUDE_BUFFERS_ENV) if raw is not None else False
    if not isinstance(include_buffers, bool):
        raise TypeError(f"include_buffers must be True, False or None, got {include_buffers!r}")
    return _BuildOnDevice(torch.device(device), include_buffers)


class _BuildOnDevice:
    """The `with` block of `init_on_device`. Parameters (and buffers) pass through torch's global
    registration hooks, so no torch function is patched and leaving restores everything, even when
    the block raises. Only the innermost open block of the thread that entered it acts."""

    def __init__(self, device: torch.device, include_buffers: bool) -> None:
        self.device = device
        self.include_buffers = include_buffers
        self._exit_stack: contextlib.ExitStack | None = None
        self._caller: Any = None

    def __enter__(self) -> None:
        if self._exit_stack is not None:
            raise RuntimeError("this init_empty_weights()/init_on_device() block is already open; "
                               "create a new one for each `with`")
        self._caller = sys._getframe(1)  # the frame holding the `with`: where the search for a constructor stops
        stack = contextlib.ExitStack()
        try:
            blocks = _open_blocks()
            blocks.append(self)
            stack.callback(blocks.remove, self)
            stack.callback(self._forget_caller)
            stack.callback(register_module_parameter_registration_hook(self._place_parameter).remove)
            if self.include_buffers:
                stack.callback(register_module_buffer_registration_hook(self._place_buffer).remove)
                # torch's default-device mode: factory calls (torch.empty, torch.arange, ...) create
                # on the device directly, so not even a transient CPU tensor is made
                stack.enter_context(self.device)
        except BaseException:
            stack.close()
            raise
        self._exit_stack = stack

    def __exit__(self, *exc: Any) -> bool:
        stack, self._exit_stack = self._exit_stack, None
        return bool(stack.__exit__(*exc))

    def _forget_caller(self) -> None:
        self._caller = None  # a frame keeps its locals alive

    def _place_parameter(self, module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        if torch.nn.parameter.is_lazy(param) or _is_on(param, self.device) or not self._building_a_module():
            return None
        moved = param.detach().to(self.device)
        try:
            placed = type(param)(moved, requires_grad=param.requires_grad)
        except TypeError as error:
            raise TypeError(f"init_on_device({str(self.device)!r}) cannot rebuild parameter {name!r} of "
                            f"{type(module).__name__}: its class {type(param).__name__} does not take "
                            f"(data, requires_grad=...); build this module outside the block") from error
        placed.__dict__.update(param.__dict__)  # attributes set on the parameter (e.g. _is_hf_initialized)
        return placed

    def _place_buffer(self, module: nn.Module, name: str, buffer: torch.Tensor | None) -> torch.Tensor | None:
        if buffer is None or _is_on(buffer, self.device) or not self._building_a_module():
            return None
        return buffer.to(self.device)

    def _building_a_module(self) -> bool:
        """Whether this block acts here: it is the innermost block open in this thread (the list
        is per thread), and an `nn.Module.__init__` runs below its `with` (a loader assigning
        weights is not a constructor)."""
        blocks = _open_blocks()
        if not blocks or blocks[-1] is not self:
            return False
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
                return True
            if frame is self._caller:
                return False
            frame = frame.f_back
        return False


def _open_blocks() -> list[_BuildOnDevice]:
    if not hasattr(_open_contexts, "blocks"):
        _open_contexts.blocks = []
    return _open_contexts.blocks


def _is_on(tensor: torch.Tensor, device: torch.device) -> bool:
    return tensor.device.type == device.type and (device.index is None or tensor.device.index == device.index)


def empty_tensor_names(module: nn.Module) -> tuple[list[str], list[str]]:
    """The names of `module`'s parameters and of its buffers that are on the meta device."""
    return ([name for name, p in module.named_parameters() if p.is_meta],
            [name for name, b in module.named_buffers() if b.is_meta])


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def refuse_empty_tensors(model: nn.Module) -> None:
    """A ValueError when parameters or buffers of `model` are still on the meta device (built under
    `init_empty_weights` and never loaded): they hold no values, and training on them is garbage."""
    params, buffers = empty_tensor_names(model)
    if params:
        raise ValueError(
            f"{len(params)} parameter(s) of {type(model).__name__} are on the meta device and hold no values "
            f"(built under init_empty_weights and not loaded): {_listed(params)}. Load the weights before "
            "prepare: kiln.load_model(model, folder) or model.load_state_dict(state_dict, assign=True)")
    if buffers:
        raise ValueError(
            f"{len(buffers)} buffer(s) of {type(model).__name__} are on the meta device and hold no values: "
            f"{_listed(buffers)}. init_empty_weights(include_buffers=True) leaves buffers that no checkpoint "
            "holds (non-persistent ones such as rotary inv_freq) empty: build with include_buffers=False "
            "(the default), or load or re-create them before prepare")


def refuse_empty_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """A ValueError when an optimizer's parameters are on the meta device: it was built on the empty
    model, and `load_state_dict(..., assign=True)` then gave the model new parameter objects."""
    empty = sum(1 for group in optimizer.param_groups for p in group["params"] if p.is_meta)
    if empty:
        raise ValueError(
            f"the optimizer holds {empty} parameter(s) on the meta device: it was created from a model built "
            "under init_empty_weights before its weights were loaded (load_state_dict(..., assign=True) replaces "
            "the parameter objects). Create the optimizer after loading, or load with kiln.load_model, which "
            "fills the parameters in place")
