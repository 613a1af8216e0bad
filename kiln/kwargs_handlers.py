"""Accelerate's kwargs handlers, `Accelerator(kwargs_handlers=[...])`: settings handed on to DDP, the
process group, autocast, the fp16 gradient scaler, the profiler and torchao's fp8 recipe.

Depends on torch only (AORecipeKwargs reads torchao, through kiln.fp8, when built). As in Accelerate,
a handler passes on only the fields set to something other than their default, and each handler
type may be given once.
"""

from __future__ import annotations

import copy
import datetime
import enum
from dataclasses import dataclass, field, fields
from typing import Any, Callable


class KwargsHandler:
    """A dataclass whose fields that differ from their defaults become keyword arguments."""

    def to_kwargs(self) -> dict[str, Any]:
        default = self.__class__()
        return {f.name: getattr(self, f.name) for f in fields(self)
                if getattr(self, f.name) != getattr(default, f.name)}


class DDPCommunicationHookType(str, enum.Enum):
    NO = "no"
    FP16 = "fp16"
    BF16 = "bf16"
    POWER_SGD = "power_sgd"
    BATCHED_POWER_SGD = "batched_power_sgd"


@dataclass
class DistributedDataParallelKwargs(KwargsHandler):
    """Arguments for `torch.nn.parallel.DistributedDataParallel`, e.g. `find_unused_parameters=True`.

    comm_hook: "fp16" or "bf16" compresses gradients for the all-reduce (a change of arithmetic
    the user asks for); PowerSGD hooks and comm wrappers are not supported.
    """

    dim: int = 0
    broadcast_buffers: bool = True
    bucket_cap_mb: int = 25
    find_unused_parameters: bool = False
    check_reduction: bool = False
    gradient_as_bucket_view: bool = False
    static_graph: bool = False
    comm_hook: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_wrapper: DDPCommunicationHookType | str = DDPCommunicationHookType.NO
    comm_state_option: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.comm_hook = DDPCommunicationHookType(self.comm_hook)
        self.comm_wrapper = DDPCommunicationHookType(self.comm_wrapper)
        if self.comm_hook in (DDPCommunicationHookType.POWER_SGD, DDPCommunicationHookType.BATCHED_POWER_SGD):
            raise NotImplementedError(f"comm_hook={self.comm_hook.value!r} is not supported; Kiln's DDP takes "
                                      "the fp16 or bf16 compression hooks, or none")
        if self.comm_wrapper is not DDPCommunicationHookType.NO or self.comm_state_option:
            raise NotImplementedError("comm_wrapper and comm_state_option are not supported (they go with the "
                                      "PowerSGD hooks)")

    def ddp_arguments(self) -> dict[str, Any]:
        """What goes to the DistributedDataParallel constructor."""
        kwargs = self.to_kwargs()
        for name in ("comm_hook", "comm_wrapper", "comm_state_option"):
            kwargs.pop(name, None)
        return kwargs

    def register_comm_hook(self, model: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hooks = {DDPCommunicationHookType.FP16: default_hooks.fp16_compress_hook,
                 DDPCommunicationHookType.BF16: default_hooks.bf16_compress_hook}
        if self.comm_hook in hooks:
            model.register_comm_hook(state=None, hook=hooks[self.comm_hook])


@dataclass
class InitProcessGroupKwargs(KwargsHandler):
    """Arguments for `torch.distributed.init_process_group`: a `timeout` (a timedelta, instead of
    KILN_PROCESS_GROUP_TIMEOUT), a `backend` other than the default, an `init_method`."""

    backend: str | None = "nccl"  # Accelerate's default; only another value is passed on
    init_method: str | None = None
    timeout: datetime.timedelta | None = None

    def __post_init__(self) -> None:
        if self.timeout is not None and not isinstance(self.timeout, datetime.timedelta):
            raise TypeError(f"timeout must be a datetime.timedelta, got {self.timeout!r}")


@dataclass
class AutocastKwargs(KwargsHandler):
    """`enabled=False` leaves the prepared models' forward without autocast; `cache_enabled` goes
    to `torch.autocast`."""

    enabled: bool = True
    cache_enabled: bool | None = None


@dataclass
class GradScalerKwargs(KwargsHandler):
    """Arguments for `torch.amp.GradScaler` under mixed_precision="fp16"."""

    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    enabled: bool = True


@dataclass
class ProfileKwargs(KwargsHandler):
    """What `accelerator.profile()` builds its `torch.profiler.profile` from.

    activities: "cpu", "cuda" (default: the CPU, and CUDA when available). schedule_option: the
    keywords of `torch.profiler.schedule` (wait, warmup, active, repeat, skip_first).
    on_trace_ready: handed to the torch profiler, which calls it as each scheduled recording ends.
    output_trace_dir: where every process writes its Chrome trace, `profile_<process_index>.json`
    (Accelerate's names), when the `profile()` block ends; the processes then wait for each other.
    """

    activities: list[str] | None = None
    schedule_option: dict[str, int] | None = None
    on_trace_ready: Callable | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False
    with_flops: bool = False
    with_modules: bool = False
    output_trace_dir: str | None = None

    def build(self) -> Any:
        import torch

        names = self.activities or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
        kinds = {"cpu": torch.profiler.ProfilerActivity.CPU, "cuda": torch.profiler.ProfilerActivity.CUDA}
        unknown = [n for n in names if n not in kinds]
        if unknown:
            raise ValueError(f"unknown profiler activities {unknown}; choose from: {', '.join(kinds)}")
        schedule = torch.profiler.schedule(**self.schedule_option) if self.schedule_option else None
        return torch.profiler.profile(activities=[kinds[n] for n in names], schedule=schedule,
                                      on_trace_ready=self.on_trace_ready, record_shapes=self.record_shapes,
                                      profile_memory=self.profile_memory, with_stack=self.with_stack,
                                      with_flops=self.with_flops, with_modules=self.with_modules)


@dataclass
class AORecipeKwargs(KwargsHandler):
    """The fp8 recipe of `mixed_precision="fp8"` (torchao's float8 training; kiln/fp8.py).

    config: a `torchao.float8.Float8LinearConfig`; by default one with `pad_inner_dim=True`.
    module_filter_func: `(module, path) -> bool`, which linear layers to convert; by default all but
    the first and last and those with a size not divisible by 16. pad_inner_dim: for the default
    config. enable_fsdp_float8_all_gather: only False (see the error it raises); unlike
    Accelerate's default True, which wraps every weight in a torchao tensor subclass.

    >>> Accelerator(mixed_precision="fp8", kwargs_handlers=[AORecipeKwargs(module_filter_func=keep_head)])
    """

    config: Any = None
    module_filter_func: Callable | None = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None

    def __post_init__(self) -> None:
        from kiln.fp8 import require_torchao

        require_torchao()  # as Accelerate, which fails here when torchao is missing
        if self.enable_fsdp_float8_all_gather:
            raise ValueError("AORecipeKwargs(enable_fsdp_float8_all_gather=True) (FSDP2's float8 all-gather) is not "
                             "supported by Kiln: with it, FSDP2 training on torchao 0.18 learned far slower than with "
                             "the plain all-gather; leave it unset (FSDP2 gathers the weights, then casts them)")
        if self.config is None:
            from torchao.float8 import Float8LinearConfig

            self.config = Float8LinearConfig(pad_inner_dim=self.pad_inner_dim is not False)
        elif self.pad_inner_dim is not None:
            raise ValueError("AORecipeKwargs got both config and pad_inner_dim; set pad_inner_dim in the "
                             "Float8LinearConfig you pass")


HANDLERS = (DistributedDataParallelKwargs, InitProcessGroupKwargs, AutocastKwargs, GradScalerKwargs, ProfileKwargs,
            AORecipeKwargs)


def sort_handlers(handlers: list[KwargsHandler] | None) -> dict[type, KwargsHandler]:
    """One handler per type, keyed by type; anything else is an error naming what is taken."""
    sorted_: dict[type, KwargsHandler] = {}
    for handler in handlers or []:
        kind = type(handler)
        if kind not in HANDLERS:
            raise TypeError(f"kwargs_handlers takes {', '.join(h.__name__ for h in HANDLERS)}; got "
                            f"{kind.__name__} (Kiln does not support it)")
        if kind in sorted_:
            raise ValueError(f"kwargs_handlers holds two {kind.__name__}; give each kind once")
        sorted_[kind] = copy.copy(handler)
    return sorted_
