"""DeepSpeed ZeRO stages 0-3: the engine owns backward, the optimizer step, mixed precision and its
own checkpoints; Kiln fills the engine's config from the Accelerator's settings.

Depends on torch, kiln.optim, kiln.checkpoint, kiln.parallel.base and kiln.parallel.deepspeed_config_optimizer
(DummyOptim, DummyScheduler); DeepSpeed itself is imported only when a DeepSpeed strategy is built
(`pip install 'kiln-torch[deepspeed]'`), and its checkpoint converter runs as a child process when a
checkpoint is resumed on another number of processes. The model arrives compiled in place, so
`engine.module` is the user's module running its compiled blocks (DESIGN.md).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from kiln.accumulation import GradientState
from kiln.checkpoint.weights import load_state_dict, save_state_dict
from kiln.optim import PreparedOptimizer, PreparedScheduler
from kiln.parallel.base import Strategy, refuse_outer_graph
from kiln.parallel.deepspeed_config_optimizer import (DummyOptim, DummyScheduler, check_config_sections,
                                                      fill_config_sections)
from kiln.state import DistributedType

OFFLOAD_DEVICES = ("none", "cpu")


def import_deepspeed() -> Any:
    try:
        import deepspeed
    except ImportError as error:
        raise ImportError("DeepSpeed was asked for but is not installed: pip install 'kiln-torch[deepspeed]'") from error
    return deepspeed


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed settings; anything left None comes from the config or from the Accelerator.

    hf_ds_config: a DeepSpeed config as a dict or the path of a JSON file ("auto" values are
    filled by Kiln); its `optimizer` and `scheduler` sections are built by the engine, with a
    DummyOptim and a DummyScheduler prepared in their place. zero_stage: 0-3 (default 2).
    gradient_accumulation_steps: used when the Accelerator's is left at 1. gradient_clipping: max
    gradient norm, applied by the engine inside its step. offload_optimizer_device /
    offload_param_device: "none" or "cpu" (parameters only with stage 3).

    >>> Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, gradient_clipping=1.0))
    """

    hf_ds_config: dict | str | os.PathLike | None = None
    zero_stage: int | None = None
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    offload_optimizer_device: str | None = None
    offload_param_device: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.hf_ds_config, (str, os.PathLike)):
            self.hf_ds_config = _read_config_file(Path(self.hf_ds_config))
        elif self.hf_ds_config is not None and not isinstance(self.hf_ds_config, dict):
            raise TypeError(f"hf_ds_config must be a dict or a JSON file path, got {type(self.hf_ds_config).__name__}")
        if self.zero_stage is not None:
            if isinstance(self.zero_stage, bool) or int(self.zero_stage) != self.zero_stage or not 0 <= self.zero_stage <= 3:
                raise ValueError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
            self.zero_stage = int(self.zero_stage)
        steps = self.gradient_accumulation_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"gradient_accumulation_steps must be a positive int, got {steps!r}")
        if self.gradient_clipping is not None:
            value = float(self.gradient_clipping)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"gradient_clipping must be a norm >= 0, got {self.gradient_clipping!r}")
            self.gradient_clipping = value
        for name in ("offload_optimizer_device", "offload_param_device"):
            value = getattr(self, name)
            if value is not None and str(value).lower() not in OFFLOAD_DEVICES:
                raise ValueError(f"{name} must be one of {', '.join(OFFLOAD_DEVICES)}, got {value!r}")
            setattr(self, name, None if value is None else str(value).lower())

    @property
    def deepspeed_config(self) -> dict:
        """The DeepSpeed config as a dict that scripts may change before `prepare` (Accelerate's
        `deepspeed_plugin.deepspeed_config`); Kiln fills its "auto" values when the engine is built."""
        if self.hf_ds_config is None:
            self.hf_ds_config = {}
        return self.hf_ds_config

    @classmethod
    def from_env(cls) -> "DeepSpeedPlugin":
        """The settings `kiln launch` passes to every process (KILN_DEEPSPEED_*)."""
        def read(name: str, parse: Callable[[str], Any]) -> Any:
            raw = os.environ.get(f"KILN_DEEPSPEED_{name}")
            try:
                return parse(raw) if raw not in (None, "") else None
            except ValueError:
                raise ValueError(f"KILN_DEEPSPEED_{name}={raw!r} is not valid") from None

        return cls(hf_ds_config=read("CONFIG_FILE", str), zero_stage=read("ZERO_STAGE", int),
                   gradient_clipping=read("GRADIENT_CLIPPING", float),
                   offload_optimizer_device=read("OFFLOAD_OPTIMIZER_DEVICE", str),
                   offload_param_device=read("OFFLOAD_PARAM_DEVICE", str))


def _read_config_file(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"no DeepSpeed config file at {path}")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"DeepSpeed config {path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise ValueError(f"DeepSpeed config {path} must hold a JSON object")
    return config


def _parent(config: dict, keys: tuple[str, ...]) -> dict:
    """The dict that holds config[keys...], made where missing."""
    node = config
    for key in keys[:-1]:
        node = node.setdefault(key, {})
    return node


def _fill(config: dict, keys: tuple[str, ...], value: Any, source: str) -> None:
    """Set config[keys...] to value where it is missing or "auto"; a different value is an error."""
    if value is None:
        return
    node = _parent(config, keys)
    current = node.get(keys[-1], "auto")
    if current == "auto":
        node[keys[-1]] = value
    elif current != value:
        raise ValueError(f"the DeepSpeed config sets {'.'.join(keys)}={current!r}, but {source} says {value!r}; "
                         "make them agree or set the config's value to \"auto\"")


def build_config(plugin: DeepSpeedPlugin, *, mixed_precision: str, gradient_accumulation_steps: int,
                 micro_batch_size: int | None, optimizer: Any = None, scheduler: Any = None,
                 ticks_per_step: int = 1) -> dict:
    """The engine's config: the user's, with "auto" and missing values filled from Kiln's settings
    and every conflict an error (DeepSpeed would otherwise train with a setting nobody chose).
    `optimizer` and `scheduler`: the model's in the prepare() call, a torch one or a DummyOptim /
    DummyScheduler standing for the config's `optimizer` / `scheduler` section (which fill its "auto"
    values); `ticks_per_step`: scheduler ticks per optimizer step (processes, or 1 with split batches)."""
    config = json.loads(json.dumps(plugin.hf_ds_config or {}))  # a deep copy, kept JSON-clean
    check_config_sections(config, optimizer, scheduler)
    fill_config_sections(config, optimizer, scheduler, ticks_per_step)
    config.setdefault("zero_optimization", {})
    _fill(config, ("zero_optimization", "stage"), plugin.zero_stage, "DeepSpeedPlugin.zero_stage")
    config["zero_optimization"]["stage"] = planned_zero_stage(plugin)
    _fill(config, ("gradient_clipping",), plugin.gradient_clipping, "DeepSpeedPlugin.gradient_clipping")
    _fill(config, ("gradient_accumulation_steps",), gradient_accumulation_steps,
          "Accelerator(gradient_accumulation_steps=)")
    for section, device in (("offload_optimizer", plugin.offload_optimizer_device),
                            ("offload_param", plugin.offload_param_device)):
        _fill(config, ("zero_optimization", section, "device"), device, f"DeepSpeedPlugin.{section}_device")
    _fill_precision(config, mixed_precision)
    _fill_plain_loop_arithmetic(config)
    if config.get("train_micro_batch_size_per_gpu", "auto") == "auto" and config.get("train_batch_size", "auto") == "auto":
        if micro_batch_size is None:
            raise ValueError("DeepSpeed needs the batch size per process: prepare the dataloader in the same "
                             "prepare() call as the model, or set train_micro_batch_size_per_gpu in the config")
        config["train_micro_batch_size_per_gpu"] = micro_batch_size
    if config.get("train_batch_size") == "auto":
        del config["train_batch_size"]  # DeepSpeed derives it from the micro batch size
    config.setdefault("zero_allow_untested_optimizer", True)
    config.setdefault("steps_per_print", 2**31 - 1)  # Kiln's and the user's logs, not DeepSpeed's
    leftover = _auto_keys(config)
    if leftover:
        raise ValueError(f"Kiln cannot fill these \"auto\" values of the DeepSpeed config: {', '.join(leftover)}")
    stage = config["zero_optimization"]["stage"]
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if config["zero_optimization"].get("offload_param", {}).get("device", "none") != "none" and stage != 3:
        raise ValueError(f"offload_param needs ZeRO stage 3; this config uses stage {stage}")
    return config


# The arithmetic of the plain PyTorch loop, for the DeepSpeed settings that would change a step
# where the user's config leaves them out (values checked against deepspeed 0.19 runtime/constants.py).
_PLAIN_LOOP_SETTINGS = {
    ("gradient_clipping",): 0.0,  # DeepSpeed's default is 1.0: it would clip every step nobody asked to clip
    ("prescale_gradients",): False,  # average after the reduction, as DDP does
    ("gradient_predivide_factor",): 1.0,
}
# Under DeepSpeed's own fp16 or bf16: reduce gradients in fp32, as the plain loop's fp32 gradients are
# (DeepSpeed's default is the half dtype).
_HALF_SETTINGS = {("communication_data_type",): "fp32"}
# DeepSpeed's fp16 loss scaler set to behave as torch.amp.GradScaler() does: start at 2**16, halve on
# every overflow (DeepSpeed's default waits for 2), double after 2000 clean steps (DeepSpeed: 1000).
# One difference stays: DeepSpeed's scale cannot fall below min_loss_scale (an int >= 1), GradScaler's can.
_FP16_SCALER_SETTINGS = {
    ("fp16", "loss_scale"): 0,  # 0: dynamic
    ("fp16", "initial_scale_power"): 16,
    ("fp16", "loss_scale_window"): 2000,
    ("fp16", "hysteresis"): 1,
    ("fp16", "consecutive_hysteresis"): False,
}


def _fill_precision(config: dict, mixed_precision: str) -> None:
    """bf16 runs as Kiln's autocast around an fp32 engine, the plain loop's arithmetic (fp32 weights,
    gradients and reductions), unless the config turns DeepSpeed's own bf16 on (bf16 weights with fp32
    master copies). fp16 turns DeepSpeed's fp16 on: its loss scaler is the one that works with ZeRO."""
    for name in ("fp16", "bf16"):
        section = config.setdefault(name, {})
        current = section.get("enabled", "auto")
        if current == "auto":
            section["enabled"] = mixed_precision == "fp16" if name == "fp16" else False
            continue
        if name == "fp16":
            agrees = bool(current) == (mixed_precision == "fp16")
        else:  # off is Kiln's own choice for bf16; on needs mixed_precision="bf16"
            agrees = not current or mixed_precision == "bf16"
        if not agrees:
            raise ValueError(f"the DeepSpeed config sets {name}.enabled={current}, but the Accelerator's "
                             f"mixed_precision is {mixed_precision!r}; make them agree")


def _fill_plain_loop_arithmetic(config: dict) -> None:
    settings = dict(_PLAIN_LOOP_SETTINGS)
    if config["fp16"]["enabled"] or config["bf16"]["enabled"]:
        settings.update(_HALF_SETTINGS)
    if config["fp16"]["enabled"]:
        settings.update(_FP16_SCALER_SETTINGS)
    for keys, value in settings.items():
        node = _parent(config, keys)
        if node.get(keys[-1], "auto") == "auto":
            node[keys[-1]] = value


def planned_zero_stage(plugin: DeepSpeedPlugin) -> Any:
    """The stage the engine will use: the config's, else the plugin's, else 2."""
    stage = (plugin.hf_ds_config or {}).get("zero_optimization", {}).get("stage", "auto")
    if stage != "auto":
        return stage
    return plugin.zero_stage if plugin.zero_stage is not None else 2


def _auto_keys(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [key for name, value in node.items() for key in _auto_keys(value, f"{prefix}{name}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


class DeepSpeedStrategy(Strategy):
    """One DeepSpeed engine around the prepared model and its optimizer.

    Follows Accelerate's contract so scripts written for it run unchanged: `backward` runs the
    engine's backward and step (the step acts only at an accumulation boundary, which Kiln sets
    from `sync_gradients`); `optimizer.step()` and `zero_grad()` only record what the engine did;
    gradient clipping is the engine's, configured by `gradient_clipping`. A DummyOptim / DummyScheduler
    in place of the optimizer / scheduler makes the engine build them from its config's sections.
    """

    name = "deepspeed"
    distributed_type = DistributedType.DEEPSPEED
    sharded_checkpoints = True
    owns_backward = True

    def __init__(self, plugin: DeepSpeedPlugin, mixed_precision: str, gradient_accumulation_steps: int,
                 split_batches: bool = False) -> None:
        self.deepspeed = import_deepspeed()
        self.plugin = plugin
        self.mixed_precision = mixed_precision
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.split_batches = split_batches
        self.engine: Any = None
        self._call_optimizers: list[torch.optim.Optimizer] = []
        self._call_schedulers: list[Any] = []
        self._micro_batch_size: int | None = None
        self._engine_optimizer: torch.optim.Optimizer | None = None

    @property
    def zero_stage(self) -> int:
        return int(planned_zero_stage(self.plugin))

    def check_compile(self, dynamo_plugin: Any) -> None:
        refuse_outer_graph(dynamo_plugin, "DeepSpeed")
        if self.zero_stage != 3 or dynamo_plugin is None or not dynamo_plugin.enabled:
            return
        if dynamo_plugin.fullgraph and not dynamo_plugin.use_regional_compilation:
            raise ValueError("ZeRO-3 gathers parameters in hooks around submodules, which one whole-model graph "
                             "cannot hold: use regional compilation (use_regional_compilation=True) or fullgraph=False")

    def begin_prepare(self, objects: tuple[Any, ...]) -> None:
        """DeepSpeed builds its engine from the model and optimizer together, and its config wants
        the batch size: remember what this prepare() call holds."""
        self._call_optimizers = [obj for obj in objects if isinstance(obj, torch.optim.Optimizer)]
        self._call_schedulers = [obj for obj in objects if hasattr(obj, "step") and hasattr(obj, "optimizer")
                                 and not isinstance(obj, (nn.Module, torch.optim.Optimizer))]
        for obj in objects:
            if isinstance(obj, torch.utils.data.DataLoader) and obj.batch_size is not None:
                self._micro_batch_size = self._micro_batch_size or obj.batch_size

    def wrap_model(self, model: nn.Module, block_paths: list[str]) -> nn.Module:
        if not any(p.requires_grad for p in model.parameters()):
            return model  # a frozen model (a teacher, a reference): replicated on every process, no engine
        if self.engine is not None:
            raise ValueError("DeepSpeed trains one model per Accelerator, and one was already prepared "
                             "(a frozen model, with requires_grad=False everywhere, can be prepared too)")
        params = {id(p) for p in model.parameters()}
        owned = [opt for opt in self._call_optimizers
                 if any(id(p) in params for group in opt.param_groups for p in group["params"])]
        if len(owned) != 1:
            raise ValueError("with DeepSpeed, pass the model and its one optimizer to the same prepare() call "
                             f"(found {len(owned)} optimizer(s) for this model): the engine is built from both")
        optimizer = owned[0]
        schedulers = [s for s in self._call_schedulers if s.optimizer is optimizer or isinstance(s, DummyScheduler)]
        scheduler = schedulers[0] if schedulers else None
        ticks = 1 if self.split_batches else torch.distributed.get_world_size()
        config = build_config(self.plugin, mixed_precision=self.mixed_precision,
                              gradient_accumulation_steps=self.gradient_accumulation_steps,
                              micro_batch_size=self._micro_batch_size, optimizer=optimizer, scheduler=scheduler,
                              ticks_per_step=ticks)
        if config["zero_optimization"]["stage"] == 3 and block_paths:
            # ZeRO-3 gathers parameters in compiler-disabled hooks on every submodule, which would
            # break each compiled block into pieces (deepspeed 0.19). As leaf modules, whole blocks
            # are gathered by one hook that runs outside the compiled forward.
            from deepspeed.utils.z3_leaf_module import set_z3_leaf_modules_by_name

            set_z3_leaf_modules_by_name(model, block_paths)
        # A DummyOptim: the engine builds the config's optimizer over the user's parameters or groups.
        built_here = {"model_parameters": optimizer.params} if isinstance(optimizer, DummyOptim) else \
            {"optimizer": optimizer}
        if isinstance(scheduler, DummyScheduler) and scheduler.lr_scheduler_callable is not None:
            built_here["lr_scheduler"] = scheduler.lr_scheduler_callable  # called with the engine's optimizer
        engine, _, _, _ = self.deepspeed.initialize(model=model, config=config, **built_here)
        self.engine = engine
        self._engine_optimizer = optimizer
        return engine

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if model is self.engine and self.engine is not None else model

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState,
                       scaler: torch.amp.GradScaler | None,
                       on_step: Callable[[], None] | None) -> PreparedOptimizer:
        if self.engine is None or optimizer is not self._engine_optimizer:
            raise ValueError("with DeepSpeed, prepare the optimizer together with its model in one prepare() call")
        # The torch optimizer the engine steps: the user's, or the one it built for a DummyOptim.
        return EngineOptimizer(self.engine.basic_optimizer, gradient_state, self.engine, on_step)

    def wrap_config_scheduler(self, scheduler: DummyScheduler, optimizers: list[PreparedOptimizer],
                              gradient_state: GradientState) -> PreparedScheduler:
        """The scheduler the engine built for a DummyScheduler (from its config, or its callable)."""
        if self.engine is None or scheduler.optimizer is not self._engine_optimizer:
            raise ValueError("with DeepSpeed, create the DummyScheduler from the optimizer prepared with the model "
                             "(DummyScheduler(optimizer, ...)), and prepare it after or with them")
        if self.engine.lr_scheduler is None:
            raise ValueError("prepare() got a DummyScheduler, and the DeepSpeed engine was built without a "
                             "scheduler: add a `scheduler` section to the config, or pass the DummyScheduler to the "
                             "prepare() call that holds the model")
        engine_optimizers = [opt for opt in optimizers if isinstance(opt, EngineOptimizer)]
        return EngineScheduler(self.engine.lr_scheduler, engine_optimizers, gradient_state)

    def backward(self, loss: torch.Tensor, sync_gradients: bool, **kwargs: Any) -> None:
        if self.engine is None:
            raise RuntimeError("backward() before a model was prepared with DeepSpeed")
        self.engine.set_gradient_accumulation_boundary(sync_gradients)
        self.engine.backward(loss, **kwargs)  # divides by the accumulation steps itself
        self.engine.step()  # reduces, clips and steps only at the boundary set above

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor | None:
        """The engine clipped inside its step (in `backward`); check the user asked for the same norm."""
        configured = self.engine.gradient_clipping() if self.engine is not None else 0.0
        if not math.isclose(configured, float(max_norm)):
            how = f"to gradient_clipping={configured}" if configured else "and this engine was built without clipping"
            raise ValueError(f"DeepSpeed clips gradients inside its step (in backward, before clip_grad_norm_ "
                             f"runs), {how}; clip_grad_norm_ asked for {max_norm}. Set "
                             f"DeepSpeedPlugin(gradient_clipping={max_norm}) (or `kiln launch --gradient_clipping "
                             f"{max_norm}`) so the engine clips to that norm")
        norm = self.engine.get_global_grad_norm()
        return None if norm is None else torch.as_tensor(float(norm))

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """fp32 weights under the plain names on every process: the optimizer's master copy where
        there is one, else the module's; a collective under ZeRO-3 (call it on every process)."""
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.unwrap(model)
        by_id: dict[int, torch.Tensor] = {}
        for _, param in module.named_parameters():  # the same order on every process
            full = safe_get_full_fp32_param(param)
            if full is None:
                full = self._gathered(param)
            by_id[id(param)] = full.detach().to("cpu", copy=True)
        return {name: by_id.get(id(value), value.detach().cpu())
                for name, value in module.state_dict(keep_vars=True).items()}

    def _gathered(self, param: nn.Parameter) -> torch.Tensor:
        if not hasattr(param, "ds_id"):
            return param.data
        with self.deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.data.clone()

    def save_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer]) -> str:
        name = f"sharded_model_{index}"
        if model is not self.engine:  # a frozen model: its weights, whole, from the main process
            if torch.distributed.get_rank() == 0:
                save_state_dict(self.full_state_dict(model), folder / name)
            return name
        self.engine.save_checkpoint(str(folder), tag=name, save_latest=False)
        return name

    def load_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer], strict: bool = True,
                     saved_processes: int | None = None) -> None:
        """The engine's checkpoint; written by another number of processes, it is converted first
        into DeepSpeed's universal checkpoint, which ZeRO reads on any number of processes."""
        name = f"sharded_model_{index}"
        if model is not self.engine:
            model.load_state_dict(load_state_dict(folder / name), strict=strict)
            return
        if saved_processes is None or saved_processes == torch.distributed.get_world_size():
            self._load_engine(folder, name, strict)
            return
        universal = folder.with_name(f".{folder.name}.{name}.universal")
        if torch.distributed.get_rank() == 0:
            convert_to_universal(folder / name, universal, saved_processes)
        torch.distributed.barrier()
        config = self.engine._config
        before = config.load_universal_checkpoint
        # The engine reads this flag only while loading (DeepSpeed 0.19.8), so it is set for this load alone.
        config.load_universal_checkpoint = True
        try:
            self._load_engine(universal.parent, universal.name, strict)
        finally:
            config.load_universal_checkpoint = before
            torch.distributed.barrier()
            if torch.distributed.get_rank() == 0:
                shutil.rmtree(universal, ignore_errors=True)

    def _load_engine(self, load_dir: Path, tag: str, strict: bool) -> None:
        path, _ = self.engine.load_checkpoint(str(load_dir), tag=tag, load_module_strict=strict,
                                              load_optimizer_states=True, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"DeepSpeed found no checkpoint {tag} in {load_dir}")


def convert_to_universal(shards: Path, out: Path, saved_processes: int) -> None:
    """DeepSpeed's own converter (`deepspeed.checkpoint.ds_to_universal`) from one engine
    checkpoint's ZeRO shards to its universal layout. Engines outside Megatron-DeepSpeed write no
    `universal_checkpoint_info`, which the converter requires, so it is told to add it."""
    shutil.rmtree(out, ignore_errors=True)
    done = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(shards),
                           "--output_folder", str(out), "--inject_missing_state"],
                          capture_output=True, text=True)
    if done.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the DeepSpeed checkpoint {shards} was written by {saved_processes} processes, and "
                           f"DeepSpeed's converter to its universal checkpoint, which loads on another number, "
                           f"failed: {last} (it reads Adam-family optimizer state only). Resume on "
                           f"{saved_processes} processes, or take the weights with zero_to_fp32.py beside the "
                           "checkpoint and start a new optimizer")


class EngineOptimizer(PreparedOptimizer):
    """The optimizer handed back under DeepSpeed: the engine already stepped in `backward`, so
    `step` records whether it applied (fp16 overflow skips) and `zero_grad` has nothing to do."""

    def __init__(self, optimizer: torch.optim.Optimizer, gradient_state: GradientState, engine: Any,
                 on_step: Callable[[], None] | None) -> None:
        super().__init__(optimizer, gradient_state, scaler=None, on_step=on_step)
        self.engine = engine

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # the engine zeroes gradients after each of its steps

    def unscale_gradients(self) -> None:
        pass  # the engine unscales fp16 gradients itself

    def step(self, closure: Any = None) -> Any:
        if closure is not None:
            raise ValueError("optimizer.step(closure) is not supported with DeepSpeed: the engine steps in backward()")
        if not self.gradient_state.sync_gradients:
            return None
        self.step_was_skipped = not self.engine.was_step_applied()
        if self.on_step is not None:
            self.on_step()
        return None

    def state_dict(self) -> dict[str, Any]:
        return self.engine.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.engine.optimizer.load_state_dict(state_dict)

    def __repr__(self) -> str:
        return f"EngineOptimizer({self.optimizer!r})"


class EngineScheduler(PreparedScheduler):
    """The scheduler handed back for a DummyScheduler: the engine steps it at the end of each
    accumulation window (inside `backward`, skipped with the step on fp16 overflow), so `step` has
    nothing left to do; its rates, `get_last_lr` and state are the engine scheduler's."""

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __repr__(self) -> str:
        return f"EngineScheduler({self.scheduler!r})"
