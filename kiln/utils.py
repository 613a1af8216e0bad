"""What scripts import from `kiln.utils`, as they do from `accelerate.utils`: the configuration classes,
seeding, collectives on Python objects, memory helpers, availability checks.

Depends on torch and the Kiln modules whose names it re-exports; nothing imports it back.
"""

from __future__ import annotations

import enum
import functools
import gc
import importlib.util
import inspect
import os
import random
from typing import Any, Callable

import torch

from kiln.accumulation import GradientAccumulationPlugin
from kiln.collectives import broadcast_object, gather, gather_object, pad_across_processes, reduce
from kiln.compat import FP8RecipeKwargs, MegatronLMDummyScheduler, MSAMPRecipeKwargs, TERecipeKwargs
from kiln.empty_init import init_empty_weights
from kiln.local_sgd import LocalSGD  # Accelerate has it in accelerate.local_sgd only; kept here too
from kiln.kwargs_handlers import (AORecipeKwargs, AutocastKwargs, DDPCommunicationHookType,
                                  DistributedDataParallelKwargs, GradScalerKwargs, InitProcessGroupKwargs,
                                  KwargsHandler, ProfileKwargs)
from kiln.parallel.context_parallel import TorchContextParallelConfig
from kiln.parallel.deepspeed import DeepSpeedPlugin
from kiln.parallel.deepspeed_config_optimizer import DummyOptim, DummyScheduler
from kiln.parallel.fsdp import FullyShardedDataParallelPlugin
from kiln.plugins import DataLoaderConfiguration, TorchDynamoPlugin
from kiln.project import ProjectConfiguration
from kiln.state import DistributedType
from kiln.tracking import LoggerType

__all__ = [
    "AORecipeKwargs", "AutocastKwargs", "DDPCommunicationHookType", "DataLoaderConfiguration", "DeepSpeedPlugin",
    "DistributedDataParallelKwargs", "DistributedType", "DummyOptim", "DummyScheduler", "FP8RecipeKwargs",
    "FullyShardedDataParallelPlugin", "GradScalerKwargs", "GradientAccumulationPlugin", "InitProcessGroupKwargs",
    "KwargsHandler", "LocalSGD", "LoggerType", "MSAMPRecipeKwargs", "MegatronLMDummyScheduler", "PrecisionType",
    "ProfileKwargs", "ProjectConfiguration", "TERecipeKwargs", "TorchContextParallelConfig", "TorchDynamoPlugin", "broadcast_object_list",
    "find_executable_batch_size", "gather", "gather_object", "init_empty_weights", "pad_across_processes",
    "reduce", "release_memory", "set_seed", "tqdm",
]


class PrecisionType(str, enum.Enum):
    """The `mixed_precision` values, as Accelerate spells them (FP8 is torchao's float8 training)."""

    NO = "no"
    FP8 = "fp8"
    FP16 = "fp16"
    BF16 = "bf16"


def set_seed(seed: int, device_specific: bool = False, deterministic: bool = False) -> None:
    """Seed Python, NumPy (if installed) and torch on every device; `device_specific` adds the
    process index to the seed (each process draws differently); `deterministic` asks torch for
    deterministic kernels."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, got {seed!r}")
    if device_specific:
        seed += int(os.environ.get("RANK", "0"))
    random.seed(seed)
    os.environ["PYTHONHASHSEED"] = str(seed)
    try:
        import numpy

        numpy.random.seed(seed % 2**32)
    except ImportError:
        pass
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if deterministic:
        torch.use_deterministic_algorithms(True)


def broadcast_object_list(object_list: list[Any], from_process: int = 0) -> list[Any]:
    """Every entry replaced, in place, by process `from_process`'s; returns the list."""
    object_list[:] = broadcast_object(list(object_list), from_process)
    return object_list


def release_memory(*objects: Any) -> list[None]:
    """Drop the references given (assign the result back to them), collect garbage, and empty the
    CUDA cache: `model, optimizer = release_memory(model, optimizer)`."""
    objects = list(objects)
    for i in range(len(objects)):
        objects[i] = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return objects


def tqdm(*args: Any, main_process_only: bool = True, **kwargs: Any) -> Any:
    """`tqdm.auto.tqdm`, shown on each machine's first process only (unless main_process_only=False)."""
    from tqdm.auto import tqdm as progress

    if main_process_only:
        kwargs["disable"] = kwargs.get("disable", False) or int(os.environ.get("LOCAL_RANK", "0")) != 0
    return progress(*args, **kwargs)


def _is_out_of_memory(error: BaseException) -> bool:
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return True
    messages = ("CUDA out of memory.", "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED.",
                "DefaultCPUAllocator: can't allocate memory")
    return isinstance(error, RuntimeError) and len(error.args) == 1 and any(m in str(error.args[0]) for m in messages)


def find_executable_batch_size(function: Callable | None = None, starting_batch_size: int = 128,
                               reduce_batch_size_fn: Callable[[int], int] | None = None) -> Callable:
    """Decorator: call `function(batch_size, ...)` from `starting_batch_size`, halving the batch size
    (or applying `reduce_batch_size_fn`) after each out-of-memory error, until it runs.

    >>> @find_executable_batch_size(starting_batch_size=64)
    ... def train(batch_size, model, optimizer): ...
    >>> train(model, optimizer)   # called without batch_size
    """
    if function is None:
        return functools.partial(find_executable_batch_size, starting_batch_size=starting_batch_size,
                                 reduce_batch_size_fn=reduce_batch_size_fn)
    reduce_fn = reduce_batch_size_fn or (lambda size: size // 2)

    @functools.wraps(function)
    def run(*args: Any, **kwargs: Any) -> Any:
        parameters = list(inspect.signature(function).parameters)
        if len(args) + 1 > len(parameters) and not any(
                p.kind is inspect.Parameter.VAR_POSITIONAL for p in inspect.signature(function).parameters.values()):
            raise TypeError(f"{function.__name__} was called with its batch size: find_executable_batch_size "
                            "passes it as the first argument, so call it without")
        batch_size = starting_batch_size
        while True:
            if batch_size <= 0:
                raise RuntimeError("no executable batch size found: even a batch of 1 ran out of memory")
            try:
                return function(batch_size, *args, **kwargs)
            except Exception as error:  # noqa: BLE001 (only out-of-memory errors are retried)
                if not _is_out_of_memory(error):
                    raise
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                batch_size = reduce_fn(batch_size)

    return run


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def is_cuda_available() -> bool:
    return torch.cuda.is_available()


def is_mps_available() -> bool:
    return torch.backends.mps.is_available()


def is_xpu_available() -> bool:
    return hasattr(torch, "xpu") and torch.xpu.is_available()


def is_npu_available() -> bool:
    return False  # Kiln runs on CUDA GPUs and CPUs


def is_bf16_available() -> bool:
    return torch.cuda.is_bf16_supported() if torch.cuda.is_available() else True


def is_deepspeed_available() -> bool:
    return _installed("deepspeed")


def is_transformers_available() -> bool:
    return _installed("transformers")


def is_datasets_available() -> bool:
    return _installed("datasets")


def is_tensorboard_available() -> bool:
    return _installed("tensorboard")


def is_wandb_available() -> bool:
    return _installed("wandb")


def is_mlflow_available() -> bool:
    return _installed("mlflow")


def is_schedulefree_available() -> bool:
    return _installed("schedulefree")
