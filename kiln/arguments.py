"""The Accelerator's arguments read into its parts: the compile plugin, the accumulation state, the
dataloader settings, what a kwargs handler passes on.

Depends on kiln.accumulation, kiln.plugins and kiln.parallel.deepspeed's plugin; never on the facade.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from typing import Any

from kiln.accumulation import GradientAccumulationPlugin, GradientState
from kiln.parallel.deepspeed import DeepSpeedPlugin
from kiln.plugins import DISABLED_BACKENDS, DataLoaderConfiguration, TorchDynamoPlugin, parse_bool


def choose_dynamo_plugin(plugin: TorchDynamoPlugin | None, backend: str | None) -> TorchDynamoPlugin | None:
    if plugin is not None and backend is not None:
        raise ValueError(
            "pass either dynamo_plugin or dynamo_backend, not both "
            "(dynamo_backend='x' is short for dynamo_plugin=TorchDynamoPlugin(backend='x'))"
        )
    if plugin is not None:
        if not isinstance(plugin, TorchDynamoPlugin):
            raise TypeError(f"dynamo_plugin must be a TorchDynamoPlugin, got {type(plugin).__name__}")
        return plugin
    backend = backend if backend is not None else os.environ.get("KILN_DYNAMO_BACKEND")
    if backend is None or str(backend).strip().lower() in DISABLED_BACKENDS:
        return None
    return TorchDynamoPlugin(backend=backend)


def gradient_state(steps: int, plugin: GradientAccumulationPlugin | None,
                    deepspeed_plugin: DeepSpeedPlugin | None) -> GradientState:
    """Accumulation from gradient_accumulation_steps, or a GradientAccumulationPlugin (not both, as in
    Accelerate), or a DeepSpeedPlugin's steps."""
    if plugin is not None:
        if steps != 1:
            raise ValueError("pass gradient_accumulation_steps or gradient_accumulation_plugin, not both")
        steps = plugin.num_steps if plugin.num_steps is not None else 1
        return GradientState(_accumulation_steps(steps, deepspeed_plugin), plugin.sync_with_dataloader,
                             plugin.sync_each_batch)
    return GradientState(_accumulation_steps(steps, deepspeed_plugin))


def dataloader_settings(config: DataLoaderConfiguration | None, split_batches: bool | None) -> DataLoaderConfiguration:
    """Accelerator(split_batches=) is Accelerate's older spelling of DataLoaderConfiguration(split_batches=):
    honoured, with a warning naming the new one."""
    config = config or DataLoaderConfiguration()
    if split_batches is None:
        return config
    if config.split_batches != bool(split_batches) and config != DataLoaderConfiguration():
        raise ValueError(f"split_batches={split_batches} disagrees with dataloader_config.split_batches="
                         f"{config.split_batches}; set it in DataLoaderConfiguration only")
    warnings.warn("Accelerator(split_batches=) is deprecated in Accelerate; Kiln honours it: use "
                  "DataLoaderConfiguration(split_batches=) instead", FutureWarning, stacklevel=3)
    return dataclasses.replace(config, split_batches=bool(split_batches))


def handler_kwargs(handlers: dict, kind: type) -> dict[str, Any] | None:
    return handlers[kind].to_kwargs() if kind in handlers else None


def _accumulation_steps(given: int, deepspeed_plugin: DeepSpeedPlugin | None) -> int:
    """The Accelerator's accumulation steps, or DeepSpeedPlugin's when only that was set (as in Accelerate)."""
    planned = deepspeed_plugin.gradient_accumulation_steps if deepspeed_plugin is not None else None
    if planned is None or planned == given:
        return given
    if given != 1:
        raise ValueError(f"gradient_accumulation_steps={given}, but DeepSpeedPlugin(gradient_accumulation_steps="
                         f"{planned}); set it in one place")
    return planned


def env_flag(name: str) -> bool:
    raw = os.environ.get(name)
    return parse_bool(raw, name) if raw is not None else False
