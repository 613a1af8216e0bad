"""The facade a training loop talks to: `Accelerator` holds the settings and delegates each step.

Depends on every Kiln module; nothing in Kiln imports it back.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import warnings
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from kiln import collectives
from kiln.accumulation import GradientAccumulationPlugin, check_steps
from kiln.arguments import choose_dynamo_plugin, dataloader_settings, env_flag, gradient_state, handler_kwargs
from kiln.checkpoint.api import CheckpointAPI
from kiln.checkpoint.weights import clean_state_dict, save_state_dict
from kiln.compile.regions import uncompile
from kiln.compile.report import CompileReport
from kiln.compile.session import CompileSession
from kiln.data import PreparedDataLoader, skip_first_batches
from kiln.empty_init import refuse_empty_optimizer, refuse_empty_tensors
from kiln.optim import PreparedOptimizer, PreparedScheduler
from kiln.parallel import DDPStrategy, SingleProcess, Strategy
from kiln.parallel.deepspeed import DeepSpeedPlugin, DeepSpeedStrategy
from kiln.parallel.deepspeed_config_optimizer import DummyScheduler, refuse_without_engine
from kiln.parallel.fsdp import FSDPStrategy, FullyShardedDataParallelPlugin
from kiln.model_plan import PrepareParts, plan_model, transform
from kiln.parallel.parallelism_config import ParallelismConfig, build_parallelism, data_shard
from kiln.plugins import DataLoaderConfiguration, TorchDynamoPlugin
from kiln.precision import Precision, remove_precision_wrapper
from kiln.process_api import ProcessAPI
from kiln.project import ProjectConfiguration
from kiln.state import ProcessState, set_current
from kiln.compat import AccelerateCompat, refuse_unsupported_arguments
from kiln.kwargs_handlers import (AORecipeKwargs, AutocastKwargs, DistributedDataParallelKwargs, GradScalerKwargs,
                                  InitProcessGroupKwargs, KwargsHandler, ProfileKwargs, sort_handlers)
from kiln.tracking import TrackingAPI


class Accelerator(ProcessAPI, CheckpointAPI, TrackingAPI, AccelerateCompat):
    """Makes a PyTorch training loop run compiled, in mixed precision, with gradient accumulation.

    >>> accelerator = Accelerator(dynamo_plugin=TorchDynamoPlugin(use_regional_compilation=True),
    ...                           mixed_precision="bf16", gradient_accumulation_steps=4)
    >>> model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    """

    def __init__(
        self,
        device_placement: bool = True,
        split_batches: bool | None = None,
        mixed_precision: str | None = None,
        gradient_accumulation_steps: int = 1,
        cpu: bool = False,
        dataloader_config: DataLoaderConfiguration | None = None,
        deepspeed_plugin: DeepSpeedPlugin | None = None,
        fsdp_plugin: FullyShardedDataParallelPlugin | None = None,
        rng_types: list[str] | None = None,
        log_with: str | list[str] | None = None,
        project_dir: str | os.PathLike | None = None,
        project_config: ProjectConfiguration | None = None,
        gradient_accumulation_plugin: GradientAccumulationPlugin | None = None,
        step_scheduler_with_optimizer: bool = True,
        kwargs_handlers: list[KwargsHandler] | None = None,
        dynamo_backend: str | None = None,
        dynamo_plugin: TorchDynamoPlugin | None = None,
        parallelism_config: ParallelismConfig | None = None,
        **unsupported: Any,
    ) -> None:
        refuse_unsupported_arguments(unsupported, rng_types=rng_types, deepspeed_plugin=deepspeed_plugin)
        handlers = sort_handlers(kwargs_handlers)
        group = handlers.get(InitProcessGroupKwargs, InitProcessGroupKwargs()).to_kwargs()
        self.state = ProcessState(cpu=cpu or env_flag("KILN_USE_CPU"), **group)
        set_current(self.state)
        self.device_placement = device_placement
        self.precision = Precision(mixed_precision or os.environ.get("KILN_MIXED_PRECISION"), self.device,
                                   scaler_kwargs=handler_kwargs(handlers, GradScalerKwargs),
                                   autocast_kwargs=handler_kwargs(handlers, AutocastKwargs),
                                   fp8_recipe=handlers.get(AORecipeKwargs))
        self.gradient_state = gradient_state(gradient_accumulation_steps, gradient_accumulation_plugin,
                                              deepspeed_plugin)
        self.dynamo_plugin = choose_dynamo_plugin(dynamo_plugin, dynamo_backend)
        self.step_scheduler_with_optimizer = step_scheduler_with_optimizer
        self.dataloader_config = dataloader_settings(dataloader_config, split_batches)
        self.profile_handler = handlers.get(ProfileKwargs)
        self.strategy = self._choose_strategy(fsdp_plugin, deepspeed_plugin,
                                              handlers.get(DistributedDataParallelKwargs))
        # The mesh of the parallel dimensions (a collective): FSDP2 shards over it (HSDP on two
        # dimensions), tensor parallel splits the blocks over its `tp` dimension.
        self.state.parallelism_config, self.state.device_mesh, self.strategy = build_parallelism(
            parallelism_config, self.num_processes, self.strategy, self.device.type)
        if self.strategy.owns_backward:
            if GradScalerKwargs in handlers:
                raise ValueError("GradScalerKwargs has no effect under DeepSpeed, whose engine scales fp16 losses "
                                 "itself: set its loss scaling in the DeepSpeed config's fp16 section")
            self.precision.scaler = None  # the engine scales fp16 losses itself
        self.strategy.check_compile(self.dynamo_plugin)
        if self.dynamo_plugin is not None and self.dynamo_plugin.enabled and self.strategy.precompiles_by_default:
            self.dynamo_plugin.precompile_by_default(f"the {self.strategy.name} strategy")
        self.state.mixed_precision = self.precision.mode
        self.state.dynamo_plugin = self.dynamo_plugin
        self.state.fsdp_plugin = self.strategy.plugin if self.is_fsdp2 else None
        self.state.deepspeed_plugin = deepspeed_plugin if self.strategy.name == "deepspeed" else None
        if self.strategy.distributed_type is not None:
            self.state.distributed_type = self.strategy.distributed_type
        self._models: list[nn.Module] = []
        self._optimizers: list[PreparedOptimizer] = []
        self._schedulers: list[PreparedScheduler] = []
        self._dataloaders: list[PreparedDataLoader] = []
        # Both what the user passed and what prepare returned, so neither is prepared twice.
        self._prepared: weakref.WeakSet = weakref.WeakSet()
        self._trigger = False  # set_trigger / check_trigger
        self._init_tracking(log_with)
        self._init_checkpointing(project_config, project_dir)
        self.compiler = CompileSession(self.dynamo_plugin, is_writer=self.is_main_process,
                                       is_local_main=self.is_local_main_process)

    @property
    def data_seed(self) -> int:
        """The shuffle seed of the dataloaders prepared now: DataLoaderConfiguration(data_seed=), else
        torch's initial seed, which follows `set_seed` (scripts call it after making the Accelerator)
        without drawing from, and so shifting, the user's RNG."""
        seed = self.dataloader_config.data_seed
        return torch.initial_seed() % 2**31 if seed is None else seed

    @property
    def native_amp(self) -> bool:
        """Whether prepared models run under autocast; set it to False before `prepare` to leave
        them without (as diffusers scripts do on Apple's MPS)."""
        return self.precision.native_amp

    @native_amp.setter
    def native_amp(self, value: bool) -> None:
        if self._models and bool(value) != self.precision.native_amp:
            raise ValueError("native_amp changes how prepare wraps models: set it before the first prepare()")
        self.precision.native_amp = bool(value) and self.precision.enabled

    @property
    def mixed_precision(self) -> str:
        return self.precision.mode

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.precision.scaler

    @property
    def gradient_accumulation_steps(self) -> int:
        return self.gradient_state.num_steps

    @gradient_accumulation_steps.setter
    def gradient_accumulation_steps(self, steps: int) -> None:
        if self.strategy.owns_backward:
            raise ValueError("the DeepSpeed engine was built with its accumulation steps; they cannot change")
        self.gradient_state.num_steps = check_steps(steps)

    @property
    def sync_gradients(self) -> bool:
        return self.gradient_state.sync_gradients

    @sync_gradients.setter
    def sync_gradients(self, value: bool) -> None:
        self.gradient_state.sync_gradients = bool(value)

    @property
    def optimizer_step_was_skipped(self) -> bool:
        return any(opt.step_was_skipped for opt in self._optimizers)

    def _choose_strategy(self, fsdp_plugin: FullyShardedDataParallelPlugin | None,
                         deepspeed_plugin: DeepSpeedPlugin | None,
                         ddp_handler: DistributedDataParallelKwargs | None) -> Strategy:
        """From the plugins passed, else the launcher's KILN_DISTRIBUTED_TYPE, else DDP."""
        requested = os.environ.get("KILN_DISTRIBUTED_TYPE", "").strip().upper()
        known = ("", "NO", "MULTI_CPU", "MULTI_GPU", "DDP", "FSDP", "DEEPSPEED")
        if requested not in known:
            raise ValueError(f"KILN_DISTRIBUTED_TYPE={requested!r} is not one of: {', '.join(known[1:])}")
        if fsdp_plugin is not None and deepspeed_plugin is not None:
            raise ValueError("pass fsdp_plugin or deepspeed_plugin, not both: they are two ways to shard one model")
        if fsdp_plugin is None and deepspeed_plugin is None:
            if requested == "FSDP":
                fsdp_plugin = FullyShardedDataParallelPlugin()
            elif requested == "DEEPSPEED":
                deepspeed_plugin = DeepSpeedPlugin.from_env()
        if self.num_processes == 1:
            if fsdp_plugin is not None or deepspeed_plugin is not None:
                asked = "FSDP" if fsdp_plugin is not None else "DeepSpeed"
                warnings.warn(f"{asked} was asked for, but this is a single process: training unsharded",
                              UserWarning, stacklevel=3)
            return SingleProcess()
        if fsdp_plugin is not None:
            return FSDPStrategy(fsdp_plugin, self.device)
        if deepspeed_plugin is not None:
            return DeepSpeedStrategy(deepspeed_plugin, self.precision.mode, self.gradient_accumulation_steps,
                                     split_batches=self.dataloader_config.split_batches)
        if ddp_handler is None:
            return DDPStrategy(self.device)
        return DDPStrategy(self.device, ddp_handler.ddp_arguments(), ddp_handler.register_comm_hook)

    # ----- prepare -------------------------------------------------------------------------
    def prepare(self, *objects: Any, device_placement: list[bool] | None = None) -> Any:
        """Make models, optimizers, dataloaders and schedulers ready; returned in the order given.

        Schedulers are prepared last, whatever their position, so they find their optimizer.
        """
        if device_placement is not None and len(device_placement) != len(objects):
            raise ValueError(f"device_placement has {len(device_placement)} entries for {len(objects)} objects")
        placements = device_placement or [None] * len(objects)
        for obj in objects:
            self._refuse_second_prepare(obj)
        if len({id(o) for o in objects}) != len(objects):
            raise ValueError("the same object was passed to prepare twice in one call")
        results: list[Any] = [None] * len(objects)
        refuse_without_engine(objects, self.strategy.name, self.num_processes)  # DummyOptim, DummyScheduler
        self.strategy.begin_prepare(objects)
        # Models first: a sharding strategy replaces their parameters, and optimizers must follow.
        for i, (obj, place) in enumerate(zip(objects, placements)):
            if isinstance(obj, nn.Module):
                results[i] = self.prepare_model(obj, device_placement=place)
        for i, (obj, place) in enumerate(zip(objects, placements)):
            if isinstance(obj, nn.Module):
                continue
            if isinstance(obj, torch.optim.Optimizer):
                results[i] = self.prepare_optimizer(obj, device_placement=place)
            elif isinstance(obj, DataLoader):
                results[i] = self.prepare_data_loader(obj, device_placement=place)
        for i, obj in enumerate(objects):
            if results[i] is None:
                if not _is_scheduler(obj):
                    raise TypeError(
                        f"prepare() got a {type(obj).__name__}; it takes nn.Module, torch.optim.Optimizer, "
                        "DataLoader and LR schedulers"
                    )
                results[i] = self.prepare_scheduler(obj)
        return results[0] if len(results) == 1 else tuple(results)

    def prepare_model(self, model: nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> nn.Module:
        """Device, fp8's float8 linear layers, then the model's plan and its transformations in
        order (kiln/model_plan.py): tensor parallel, context parallel's hooks, activation
        checkpointing, compile (in place), the precision wrapper around the compiled forward, and
        last the strategy (DDP wrapper, FSDP2 shards)."""
        self._refuse_second_prepare(model)
        # cpu_ram_efficient_loading: a process other than the main one may hold empty (meta) weights,
        # which the strategy replaces with the main process's once sharded.
        receives = self.strategy.receives_weights_from_main() and not evaluation_mode
        if not receives:
            refuse_empty_tensors(model)  # before .to(): a meta tensor fails there deep inside torch
        if (device_placement if device_placement is not None else self.device_placement) and \
                not (receives and any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))):
            model.to(self.device)
        # float8 first: it changes the modules the plan is made of (the first and last linears stay
        # in high precision, so the first block may differ from the others). Then one plan, the
        # blocks chosen once, and the transformations in their order (kiln/model_plan.py).
        self.precision.convert_linears(model, self.strategy.name)
        plan = plan_model(model, self.dynamo_plugin, training=not evaluation_mode,
                          parallelism_config=self.parallelism_config)
        wrapped = transform(model, plan, PrepareParts(self.precision, self.strategy, self.compiler, self.device))
        self._models.append(wrapped)
        self._prepared.add(model)
        self._prepared.add(wrapped)
        return wrapped

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          device_placement: bool | None = None) -> PreparedOptimizer:
        self._refuse_second_prepare(optimizer)
        if not self.strategy.receives_weights_from_main():  # its meta parameters are replaced at prepare
            refuse_empty_optimizer(optimizer)
        if (device_placement if device_placement is not None else self.device_placement) and optimizer.state:
            # Loaded optimizer state may sit on another device; a state_dict round trip moves it
            # next to the parameters (Optimizer.load_state_dict casts to each parameter's device).
            optimizer.load_state_dict(optimizer.state_dict())
        prepared = self.strategy.wrap_optimizer(optimizer, self.gradient_state, self.scaler,
                                                on_step=self.compiler.after_optimizer_step)
        self._optimizers.append(prepared)
        self._prepared.add(optimizer)
        self._prepared.add(prepared)
        return prepared

    def prepare_data_loader(self, dataloader: DataLoader,
                            device_placement: bool | None = None) -> PreparedDataLoader:
        self._refuse_second_prepare(dataloader)
        place = device_placement if device_placement is not None else self.device_placement
        self.compiler.check_dataloader(dataloader)
        config = self.dataloader_config
        shards, shard = data_shard(self.parallelism_config, self.torch_device_mesh, self.num_processes,
                                   self.process_index)  # one tensor-parallel group reads one shard
        prepared = PreparedDataLoader(dataloader, self.device if place else None, self.gradient_state, shards, shard,
                                      # one seed for every process, so the sharded batches of an epoch agree
                                      collectives.broadcast_object(self.data_seed),
                                      stateful=config.use_stateful_dataloader, split_batches=config.split_batches,
                                      even_batches=config.even_batches, non_blocking=config.non_blocking)
        self._dataloaders.append(prepared)
        self._prepared.add(dataloader)
        self._prepared.add(prepared)
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> PreparedScheduler:
        self._refuse_second_prepare(scheduler)
        if isinstance(scheduler, DummyScheduler):  # the DeepSpeed engine built it from its config and steps it
            refuse_without_engine([scheduler], self.strategy.name, self.num_processes)
            prepared = self.strategy.wrap_config_scheduler(scheduler, self._optimizers, self.gradient_state)
            self._schedulers.append(prepared)
            self._prepared.update((scheduler, prepared))
            return prepared
        wrapped = getattr(scheduler, "optimizer", None)
        optimizers = [opt for opt in self._optimizers if opt.optimizer is wrapped or opt is wrapped]
        if wrapped is not None and not optimizers:
            warnings.warn(
                "this scheduler's optimizer was not prepared; prepare the optimizer too (in the same "
                "call is fine), or the scheduler cannot skip the steps that fp16 overflow skips",
                UserWarning,
                stacklevel=3,
            )
        ticks = 1 if self.dataloader_config.split_batches else self.num_processes
        prepared = PreparedScheduler(scheduler, optimizers, self.gradient_state, self.step_scheduler_with_optimizer,
                                     ticks_per_step=ticks)
        self._schedulers.append(prepared)
        self._prepared.add(scheduler)
        self._prepared.add(prepared)
        return prepared

    def _refuse_second_prepare(self, obj: Any) -> None:
        try:
            seen = obj in self._prepared
        except TypeError:  # not weak-referenceable: cannot have been recorded
            return
        if seen:
            raise ValueError(
                f"this {type(obj).__name__} was already prepared by this Accelerator; "
                "prepare each object once and keep using what prepare returned"
            )

    # ----- the training step ---------------------------------------------------------------
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`loss.backward()`, divided over the accumulation steps and scaled for fp16.

        Under DeepSpeed, the engine's backward and step (which acts at the end of an accumulation
        window), as Accelerate does."""
        if self.strategy.owns_backward:
            self.strategy.backward(loss, self.sync_gradients, **kwargs)
            return
        if self.gradient_accumulation_steps > 1:
            loss = loss / self.gradient_accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward(**kwargs)

    @contextlib.contextmanager
    def accumulate(self, *models: nn.Module) -> Iterator[None]:
        """One micro-batch: sets `sync_gradients` for the optimizer and scheduler steps inside it."""
        self.gradient_state.advance()
        with contextlib.ExitStack() as stack:
            if not (self.sync_gradients or self.gradient_state.sync_each_batch):
                for model in _flatten_models(models):
                    stack.enter_context(self.no_sync(model))
            yield

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """Skip gradient synchronisation across processes (nothing to skip on one process)."""
        with self.strategy.no_sync(model):
            yield

    def autocast(self, autocast_handler: AutocastKwargs | None = None) -> contextlib.AbstractContextManager:
        """Autocast as configured by `mixed_precision`, for code outside the prepared model; an
        AutocastKwargs overrides the Accelerator's for this block."""
        return self.precision.autocast(autocast_handler)

    def unscale_gradients(self, optimizer: PreparedOptimizer | None = None) -> None:
        for opt in [optimizer] if optimizer is not None else self._optimizers:
            opt.unscale_gradients()

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float,
                        norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient norm, after removing the fp16 loss scale; returns the total norm.

        Under DeepSpeed the engine clips inside its step to its configured `gradient_clipping`
        (which must equal `max_norm`) and this returns the norm it measured."""
        if self.strategy.owns_backward:
            return self.strategy.clip_grad_norm(max_norm)
        self.unscale_gradients()
        return self.strategy.clip_grad_norm_of(parameters, max_norm, norm_type=norm_type)

    def clip_grad_value_(self, parameters: Iterable[torch.Tensor], clip_value: float) -> None:
        if self.strategy.owns_backward:
            raise ValueError(f"{self.strategy.name} clips by norm inside its step; use clip_grad_norm_ "
                             "with its gradient_clipping")
        self.unscale_gradients()
        torch.nn.utils.clip_grad_value_(parameters, clip_value)

    # ----- models out ----------------------------------------------------------------------
    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True,
                     keep_torch_compile: bool = True) -> nn.Module:
        """The user's own module.

        Kiln compiles in place, so this is the very object that was prepared. With
        `keep_fp32_wrapper=False` its autocast wrapper is removed, and with `keep_torch_compile=False`
        its compiled forwards are, both in place.
        """
        model = self.strategy.unwrap(model)
        while isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or _is_parallel_wrapper(model):
            model = model._orig_mod if hasattr(model, "_orig_mod") else model.module
        if not (keep_fp32_wrapper and keep_torch_compile):
            # The autocast wrapper holds the compiled forward of a full compile: peel it off first.
            had_wrapper = remove_precision_wrapper(model)
            if not keep_torch_compile:
                uncompile(model)
            if keep_fp32_wrapper and had_wrapper:
                self.precision.wrap_forward(model)
        return model

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor]:
        """The model's weights under the plain model's names, whatever wrappers it went through."""
        if not unwrap:
            return model.state_dict()
        return clean_state_dict(self.strategy.full_state_dict(self.unwrap_model(model)))

    def save_model(self, model: nn.Module, save_directory: str | os.PathLike,
                   max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> None:
        """Write the weights as safetensors (shards past `max_shard_size`), loadable by `kiln.load_model`."""
        state_dict = self.get_state_dict(model)
        if self.is_main_process:
            save_state_dict(state_dict, save_directory, max_shard_size, safe_serialization)
        self.wait_for_everyone()

    # ----- data ----------------------------------------------------------------------------
    def skip_first_batches(self, dataloader: PreparedDataLoader, num_batches: int = 0) -> PreparedDataLoader:
        """A dataloader that starts after `num_batches` batches of this process (mid-epoch resume)."""
        return skip_first_batches(dataloader, num_batches)

    def compile_report(self) -> CompileReport:
        """Per compiled region: instances sharing it, graphs, graph breaks, recompiles and their
        reasons, compile seconds, cache hits, calls that ran compiled and eagerly.

        >>> print(accelerator.compile_report().table())   # or .as_dict() for a logger
        """
        return self.compiler.report()

    def free_memory(self, *objects: Any) -> list[None]:
        """Drop Kiln's references to prepared objects and release cached device memory."""
        import gc

        self._models.clear()
        self._optimizers.clear()
        self._schedulers.clear()
        self._dataloaders.clear()
        self.compiler.models.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return [None] * len(objects)

    def end_training(self) -> None:
        """The end of a run: finishes the trackers, prints the compile report on the main process and,
        as Accelerate does, leaves the process group Kiln started (no collective works after it)."""
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []
        self.compiler.save_cache()
        self.compiler.close()
        report = self.compiler.report()
        if report.regions:
            self.print(report.table())
        self.wait_for_everyone()
        self.state.end()


def _flatten_models(models: Iterable[Any]) -> list[nn.Module]:
    """accumulate(model), accumulate(a, b) and accumulate([a, b]) (diffusers passes a list)."""
    flat: list[nn.Module] = []
    for model in models:
        flat.extend(_flatten_models(model) if isinstance(model, (list, tuple)) else [model])
    return flat


def _is_scheduler(obj: Any) -> bool:
    lr_scheduler = torch.optim.lr_scheduler
    base = getattr(lr_scheduler, "LRScheduler", getattr(lr_scheduler, "_LRScheduler", None))
    return isinstance(obj, base) or isinstance(obj, lr_scheduler.ReduceLROnPlateau) or (
        hasattr(obj, "step") and hasattr(obj, "optimizer") and hasattr(obj, "state_dict")
    )


def _is_parallel_wrapper(model: nn.Module) -> bool:
    parallel = (nn.parallel.DistributedDataParallel, nn.DataParallel)
    return isinstance(model, parallel)
