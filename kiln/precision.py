"""Mixed precision: autocast around the model's forward, fp32 outputs, gradient scaling for fp16,
and for fp8 the swap of linear layers for torchao's float8 ones (kiln/fp8.py).

Depends on torch and kiln.fp8 only. The autocast wrapper goes around whatever `forward` the model
has, compiled or not, so compiled regions run inside it (DESIGN.md: Accelerate's wrapper hid them
under bf16).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kiln.fp8 import check_fp8_device, convert_to_fp8, require_torchao

# The autocast dtype of each mode. fp8 runs what is not a converted linear layer under bf16 autocast,
# as Accelerate's torchao path does (its autocast context treats "fp8" as "bf16").
PRECISIONS = {"no": None, "fp16": torch.float16, "bf16": torch.bfloat16, "fp8": torch.bfloat16}
# Strategies whose sharded weights torchao's Float8Linear is not wired to here.
_FP8_REFUSED_STRATEGIES = {"deepspeed": "DeepSpeed"}
_FORWARD_BEFORE = "_kiln_forward_before_precision"


def check_mixed_precision(value: str | None) -> str:
    """Normalise a `mixed_precision` value; unknown ones are an error that lists the choices."""
    if value is None:
        return "no"
    lowered = str(value).strip().lower()
    if lowered not in PRECISIONS:
        raise ValueError(f"unknown mixed_precision {value!r}; choose one of: {', '.join(PRECISIONS)}")
    return lowered


class Precision:
    """The autocast settings, (for fp16) the gradient scaler and (for fp8) the float8 recipe of one
    `Accelerator`."""

    def __init__(self, mixed_precision: str, device: torch.device, scaler_kwargs: dict[str, Any] | None = None,
                 autocast_kwargs: dict[str, Any] | None = None, fp8_recipe: Any = None) -> None:
        self.mode = check_mixed_precision(mixed_precision)
        if self.mode == "fp8":
            require_torchao()
            check_fp8_device(device)
        elif fp8_recipe is not None:  # Accelerate refuses this too (outside FSDP and DeepSpeed)
            raise ValueError(f"AORecipeKwargs configures fp8 training, but mixed_precision is {self.mode!r}; "
                             "pass mixed_precision='fp8' or drop the AORecipeKwargs")
        self.fp8_recipe = fp8_recipe  # an AORecipeKwargs, or None for the default recipe
        self.dtype = PRECISIONS[self.mode]
        self.device_type = device.type
        autocast_kwargs = dict(autocast_kwargs or {})
        # Accelerate's `native_amp`: whether prepared models run under autocast (AutocastKwargs(enabled=False)
        # or `accelerator.native_amp = False` before prepare turn it off).
        self.native_amp = self.dtype is not None and autocast_kwargs.pop("enabled", True)
        self.autocast_kwargs = autocast_kwargs
        self.scaler = torch.amp.GradScaler(device.type, **(scaler_kwargs or {})) if self.mode == "fp16" else None

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def convert_linears(self, model: nn.Module, strategy: str) -> list[str]:
        """Under fp8, swap the model's linear layers for torchao's Float8Linear, in place, and return
        their paths; nothing under the other modes. Call it before compiling, so that the compiled
        graphs hold the float8 matmuls."""
        if self.mode != "fp8":
            return []
        if strategy in _FP8_REFUSED_STRATEGIES:
            raise NotImplementedError(f"mixed_precision='fp8' with {_FP8_REFUSED_STRATEGIES[strategy]} is not "
                                      "supported by Kiln; train fp8 on one process, with DDP or with FSDP2, or use bf16")
        converted = convert_to_fp8(model, getattr(self.fp8_recipe, "config", None),
                                   getattr(self.fp8_recipe, "module_filter_func", None))
        if not converted:
            warnings.warn(f"mixed_precision='fp8': no linear layer of {type(model).__name__} qualified for float8 "
                          "(the first and last are left out, and those with a size not divisible by 16), so it "
                          "trains as bf16", UserWarning, stacklevel=3)
        return converted

    def autocast(self, autocast_handler: Any = None) -> contextlib.AbstractContextManager:
        """Autocast to the chosen dtype, or nothing when mixed precision is off; an AutocastKwargs
        given here overrides the Accelerator's for this block."""
        if not self.native_amp:  # mixed precision off, or autocast turned off (as Accelerate's native_amp)
            return contextlib.nullcontext()
        kwargs = dict(self.autocast_kwargs)
        if autocast_handler is not None:  # enabled=False switches autocast off inside an outer one too
            kwargs.update(autocast_handler.to_kwargs())
        return torch.autocast(device_type=self.device_type, dtype=self.dtype, **kwargs)

    def wrap_forward(self, model: nn.Module) -> None:
        """Run `model.forward` under autocast and hand back floating outputs in fp32, in place."""
        if not self.native_amp or _FORWARD_BEFORE in vars(model):
            return
        inner = model.forward
        precision = self

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            with precision.autocast():
                outputs = inner(*args, **kwargs)
            return outputs_to_fp32(outputs)

        # vars() lookup: the instance's own forward (a compiled one), or None for the class's.
        vars(model)[_FORWARD_BEFORE] = vars(model).get("forward")
        model.forward = forward


def remove_precision_wrapper(model: nn.Module) -> bool:
    """Undo `Precision.wrap_forward`: the model's forward is what it was before. False if unwrapped."""
    if _FORWARD_BEFORE not in vars(model):
        return False
    before = vars(model).pop(_FORWARD_BEFORE)
    if before is None:
        del model.forward
    else:
        model.forward = before
    return True


def outputs_to_fp32(value: Any) -> Any:
    """Half-precision floating tensors in `value` (nested dicts, lists, model outputs) become fp32."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in (torch.float16, torch.bfloat16) else value
    if isinstance(value, Mapping):
        converted = copy.copy(value)
        for key, item in value.items():
            converted[key] = outputs_to_fp32(item)
        return converted
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(outputs_to_fp32(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(outputs_to_fp32(v) for v in value)
    return value
