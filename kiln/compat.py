"""Accelerate names that Kiln does not support: each fails at once, with a NotImplementedError that
says so and what to use, rather than missing (an ImportError far from the cause) or doing nothing;
and `AccelerateCompat`, the Accelerator's smaller Accelerate attributes.

Depends on nothing in Kiln at import (profile() reads kiln.kwargs_handlers when called).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Iterator

# Accelerator() arguments of Accelerate that Kiln does not take, and what to do instead.
_UNSUPPORTED_ARGUMENTS = {
    "torch_tp_plugin": "Accelerate's deprecated tensor-parallel plugin; pass parallelism_config=ParallelismConfig("
                       "tp_size=...) instead",
    "megatron_lm_plugin": "Megatron-LM is not supported; use FSDP2 (fsdp_plugin=) or DeepSpeed",
    "deepspeed_plugins": "several DeepSpeed plugins (one per model) are not supported; Kiln trains one model "
                         "per DeepSpeed engine: pass deepspeed_plugin=",
}


def refuse_unsupported_arguments(unsupported: dict[str, Any], *, rng_types: Any, deepspeed_plugin: Any) -> None:
    """Accelerator arguments Kiln does not take: a NotImplementedError for Accelerate's, a TypeError
    for names Accelerate does not have either."""
    for name, value in unsupported.items():
        if name not in _UNSUPPORTED_ARGUMENTS:
            raise TypeError(f"Accelerator() got an unexpected keyword argument {name!r}")
        if value is not None:
            raise NotImplementedError(f"Accelerator({name}=...): {_UNSUPPORTED_ARGUMENTS[name]}")
    if rng_types is not None:
        raise NotImplementedError("rng_types is not supported: Kiln's shuffles depend on (seed, epoch) only, so "
                                  "every process draws the same order without synchronising generators; "
                                  "drop rng_types")
    if isinstance(deepspeed_plugin, dict):
        raise NotImplementedError("a dict of DeepSpeed plugins (one per model) is not supported; Kiln trains one "
                                  "model per DeepSpeed engine: pass one DeepSpeedPlugin")


class _Unsupported:
    """Importable, so a script fails where it uses the name, with the reason and the alternative."""

    reason = ""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} is not supported by Kiln: {self.reason}")


class MegatronLMDummyScheduler(_Unsupported):
    reason = "Megatron-LM is not supported; use a torch LR scheduler"


class FP8RecipeKwargs(_Unsupported):
    reason = ("it configures TransformerEngine or MS-AMP fp8, which Kiln does not run; Kiln's fp8 is torchao's: "
              "Accelerator(mixed_precision='fp8', kwargs_handlers=[AORecipeKwargs()])")


class TERecipeKwargs(_Unsupported):
    reason = ("TransformerEngine fp8 is not supported; Kiln's fp8 is torchao's: "
              "Accelerator(mixed_precision='fp8', kwargs_handlers=[AORecipeKwargs()])")


class MSAMPRecipeKwargs(_Unsupported):
    reason = ("MS-AMP fp8 is not supported; Kiln's fp8 is torchao's: "
              "Accelerator(mixed_precision='fp8', kwargs_handlers=[AORecipeKwargs()])")


class AccelerateCompat:
    """The Accelerator's smaller Accelerate attributes: settings read back, ranks of parallelism Kiln
    does not do, process decorators, uneven inputs, the profiler, and methods it refuses. Needs the
    Accelerator's `dataloader_config`, `strategy`, `state`, `_dataloaders`, `profile_handler` and
    process facts."""

    # ----- settings read back --------------------------------------------------------------
    @property
    def deepspeed_plugin(self) -> Any:
        return self.state.deepspeed_plugin

    @property
    def split_batches(self) -> bool:
        return self.dataloader_config.split_batches

    @property
    def even_batches(self) -> bool:
        return self.dataloader_config.even_batches

    @property
    def dispatch_batches(self) -> bool | None:
        return self.dataloader_config.dispatch_batches

    @property
    def non_blocking(self) -> bool:
        return self.dataloader_config.non_blocking

    @property
    def use_seedable_sampler(self) -> bool:
        return self.dataloader_config.use_seedable_sampler

    @property
    def use_stateful_dataloader(self) -> bool:
        return self.dataloader_config.use_stateful_dataloader

    @property
    def is_fsdp2(self) -> bool:
        return self.strategy.name == "fsdp" and self.strategy.shards  # not tensor parallel alone

    @property
    def multi_device(self) -> bool:
        return self.device.type == "cuda" and self.num_processes > 1

    @property
    def should_save_model(self) -> bool:
        """Whether this process writes model files (the main one; sharded saves gather there)."""
        return self.is_main_process

    # ----- parallel dimensions: data parallel only (replicated, sharded, both) ---------------
    @property
    def parallelism_config(self) -> Any:
        return self.state.parallelism_config

    @property
    def torch_device_mesh(self) -> Any:
        """The device mesh under Accelerate's dimension names (None without a ParallelismConfig)."""
        return self.state.device_mesh

    @property
    def data_parallel_rank(self) -> int:
        """With a ParallelismConfig, as Accelerate: the rank along `dp_replicate` (0 when it is off);
        without one, the process index."""
        return self._mesh_rank("dp_replicate")

    @property
    def data_parallel_shard_rank(self) -> int:
        """With a ParallelismConfig, the rank along `dp_shard` (0 when it is off); else the process index."""
        return self._mesh_rank("dp_shard")

    def _mesh_rank(self, dimension: str) -> int:
        config = self.parallelism_config
        if config is None:
            return self.process_index
        return self.torch_device_mesh.get_local_rank(dimension) if dimension in config.active_mesh_dims else 0

    @property
    def tensor_parallel_rank(self) -> int:
        """The rank along `tp` (0 without tensor parallelism)."""
        return self._mesh_rank("tp") if self.parallelism_config is not None else 0

    @property
    def context_parallel_rank(self) -> int:
        """The rank along `cp` (0 without context parallelism)."""
        return self._mesh_rank("cp") if self.parallelism_config is not None else 0

    pipeline_parallel_rank = property(lambda self: 0)

    @property
    def fp8_backend(self) -> str | None:
        """Under mixed_precision="fp8" "AO" (torchao, as Accelerate's FP8BackendType.AO), else None."""
        return "AO" if self.mixed_precision == "fp8" else None

    is_composable_parallelism_enabled = property(lambda self: False)

    # ----- decorators ------------------------------------------------------------------------
    def on_local_main_process(self, function: Callable) -> Callable:
        return self._on(function, lambda: self.is_local_main_process)

    def on_last_process(self, function: Callable) -> Callable:
        return self._on(function, lambda: self.is_last_process)

    def on_process(self, function: Callable | None = None, process_index: int | None = None) -> Callable:
        if function is None:
            return lambda f: self.on_process(f, process_index)
        return self._on(function, lambda: self.process_index == process_index)

    def on_local_process(self, function: Callable | None = None, local_process_index: int | None = None) -> Callable:
        if function is None:
            return lambda f: self.on_local_process(f, local_process_index)
        return self._on(function, lambda: self.local_process_index == local_process_index)

    @staticmethod
    def _on(function: Callable, here: Callable[[], bool]) -> Callable:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return function(*args, **kwargs) if here() else None
        return wrapper

    def clear(self, *objects: Any) -> list[None]:
        """Accelerate's other name for `free_memory`."""
        return self.free_memory(*objects)

    def verify_device_map(self, model: Any) -> bool:
        """True when the model was spread over several devices with a `device_map`."""
        device_map = getattr(model, "hf_device_map", None)
        return bool(device_map) and len(set(device_map.values())) > 1

    @contextlib.contextmanager
    def join_uneven_inputs(self, joinables: list[Any], even_batches: bool | None = None) -> Iterator[None]:
        """Train DDP models on processes that hold different numbers of batches
        (`DataLoaderConfiguration(even_batches=False)`): processes that run out take part in the
        others' gradient reductions (torch's `Join`). `even_batches` changes the prepared
        dataloaders' setting for the block, as in Accelerate."""
        from torch.distributed.algorithms.join import Join

        if self.strategy.name not in ("ddp", "single"):
            raise NotImplementedError(f"join_uneven_inputs works with DDP only, not {self.strategy.name}: "
                                      "keep even_batches=True")
        with contextlib.ExitStack() as stack:
            if even_batches is not None:
                for loader in self._dataloaders:
                    stack.enter_context(loader.even_batches_set_to(even_batches))
            joinable = [j for j in joinables if hasattr(j, "join_hook")]  # DDP models (one process: none)
            if joinable:
                stack.enter_context(Join(joinable))
            yield

    @contextlib.contextmanager
    def profile(self, profile_handler: Any = None) -> Iterator[Any]:
        """A `torch.profiler.profile` built from ProfileKwargs (this call's, else the Accelerator's
        kwargs_handlers', else the defaults); with `output_trace_dir` every process writes its
        Chrome trace there at the end, as `profile_<process_index>.json`, and then waits for the
        others, as Accelerate does."""
        from kiln.kwargs_handlers import ProfileKwargs

        handler = profile_handler or self.profile_handler or ProfileKwargs()
        with handler.build() as profiler:
            yield profiler
        if handler.output_trace_dir:
            os.makedirs(handler.output_trace_dir, exist_ok=True)
            trace = os.path.join(handler.output_trace_dir, f"profile_{self.process_index}.json")
            profiler.export_chrome_trace(trace)
            self.wait_for_everyone()

    # ----- refused -----------------------------------------------------------------------------
    def lomo_backward(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("lomo_backward (the LOMO optimizer) is not supported by Kiln; use a torch "
                                  "optimizer with accelerator.backward")

    def maybe_context_parallel(self, buffers: Any = None, buffer_seq_dims: Any = None,
                               no_restore_buffers: Any = None) -> contextlib.AbstractContextManager:
        """With `cp_size` > 1, slice `buffers` (input ids, labels, position ids: every tensor whose
        dimension `buffer_seq_dims[i]` is the sequence) in place over the `cp` group, and run every
        `scaled_dot_product_attention` inside as ring attention; put forward and backward inside,
        once per step. The buffers not in `no_restore_buffers` are whole again afterwards. Without
        context parallelism it does nothing, as Accelerate's, so scripts that always enter it run.

        Example::

            with accelerator.maybe_context_parallel(buffers=[ids, shift_labels, positions],
                                                    buffer_seq_dims=[1, 1, 1],
                                                    no_restore_buffers={ids, shift_labels, positions}):
                loss = model(input_ids=ids, labels=shift_labels, shift_labels=shift_labels,
                             position_ids=positions).loss
                accelerator.backward(loss)
        """
        config = self.parallelism_config
        if config is None or not config.cp_enabled or self.torch_device_mesh is None:
            return contextlib.nullcontext()
        from kiln.parallel.context_parallel import context_parallel_region

        return context_parallel_region(self.torch_device_mesh["cp"], buffers if buffers is not None else [],
                                       buffer_seq_dims if buffer_seq_dims is not None else [],
                                       no_restore_buffers if no_restore_buffers is not None else set(),
                                       config.cp_handler.cp_comm_strategy)

    def trigger_sync_in_backward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("trigger_sync_in_backward is not supported by Kiln; leave the accumulation "
                                  "window to accelerator.accumulate, or use GradientAccumulationPlugin(sync_each_batch=True)")

    def deepspeed_ulysses_dl_adapter(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("DeepSpeed Ulysses sequence parallelism is not supported by Kiln")
