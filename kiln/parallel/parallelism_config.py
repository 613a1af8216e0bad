"""Accelerate's `ParallelismConfig`: the sizes of the parallel dimensions (dp_replicate, dp_shard,
tp, cp, sp), their validation, and the device mesh built from them under Accelerate's names.

Depends on torch, kiln.plugins (parse_bool) and kiln.parallel.context_parallel (its handler) only. The Accelerator builds the mesh; the FSDP2
strategy shards over its `fsdp_dim_names` (HSDP when dp_replicate_size > 1).
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field
from typing import Any

from kiln.parallel.context_parallel import TorchContextParallelConfig

ENV_PREFIX = "PARALLELISM_CONFIG_"
USE_ENV = "KILN_USE_PARALLELISM_CONFIG"  # set by `kiln launch` when any parallelism_config_* setting is given
_MESH_ORDER = ("dp_replicate", "dp_shard", "cp", "sp", "tp")  # outermost first, as Accelerate and torchtitan
_NOT_YET = {"sp": "sequence parallelism (DeepSpeed Ulysses)"}


@dataclass
class ParallelismConfig:
    """How the processes split the work, as Accelerate's `ParallelismConfig`: `dp_replicate_size`
    copies of the model (DDP-style), each sharded over `dp_shard_size` processes (FSDP2); both >1
    is HSDP; `tp_size` > 1 splits each block's projections over that many processes (tensor
    parallel), alone or inside each FSDP2 shard group; `cp_size` > 1 slices every sequence over
    that many processes (context parallel, under FSDP2, which shards over `dp_shard_cp`; steps run
    inside `accelerator.maybe_context_parallel`). A size left None is read from
    `PARALLELISM_CONFIG_<NAME>` (what `kiln launch` sets), else 1; sizes of 1 everywhere mean plain
    data parallelism over every process. Kiln does not do sequence parallelism (DeepSpeed Ulysses):
    `sp_size` > 1 is refused when the Accelerator is built.

    Example (4 processes, two groups of two that each hold one sharded copy)::

        Accelerator(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
                    fsdp_plugin=FullyShardedDataParallelPlugin())
    """

    dp_replicate_size: int | None = None
    dp_shard_size: int | None = None
    tp_size: int | None = None
    cp_size: int | None = None
    cp_backend: str | None = None
    sp_size: int | None = None
    sp_backend: str | None = None
    tp_handler: Any = None
    cp_handler: Any = None
    sp_handler: Any = None
    device_mesh: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("dp_replicate", "dp_shard", "tp", "cp", "sp"):
            value = getattr(self, f"{name}_size")
            if value is None:
                value = os.environ.get(ENV_PREFIX + f"{name}_size".upper()) or 1
            if isinstance(value, bool) or not str(value).strip().isdigit() or int(value) < 1:
                raise ValueError(f"{name}_size must be a whole number of at least 1, not {value!r}")
            setattr(self, f"{name}_size", int(value))
        self.cp_backend = self.cp_backend or os.environ.get(ENV_PREFIX + "CP_BACKEND") or "torch"
        self.sp_backend = self.sp_backend or os.environ.get(ENV_PREFIX + "SP_BACKEND") or "deepspeed"
        if self.cp_backend != "torch":
            raise ValueError(f"cp_backend must be 'torch', not {self.cp_backend!r}")
        if self.sp_backend != "deepspeed":
            raise ValueError(f"sp_backend must be 'deepspeed', not {self.sp_backend!r}")
        if self.cp_size > 1 and self.sp_size > 1:
            raise ValueError(f"context parallelism (cp_size={self.cp_size}) and sequence parallelism "
                             f"(sp_size={self.sp_size}) exclude each other: set one of them to 1")
        if self.cp_size > 1 and self.dp_replicate_size > 1 and self.dp_shard_size == 1:
            raise ValueError("context parallelism (cp_size > 1) does not compose with pure replication "
                             "(dp_replicate_size > 1, dp_shard_size == 1): set dp_shard_size > 1")
        if self.cp_size > 1 and self.cp_handler is None:
            self.cp_handler = TorchContextParallelConfig()
        if self.cp_handler is not None and not isinstance(self.cp_handler, TorchContextParallelConfig):
            raise TypeError("cp_handler must be a TorchContextParallelConfig (cp_backend='torch'), not "
                            f"{type(self.cp_handler).__name__}")

    # ----- sizes and names, as Accelerate's --------------------------------------------------
    @property
    def _sizes(self) -> dict[str, int]:
        return {name: getattr(self, f"{name}_size") for name in _MESH_ORDER}

    @property
    def total_size(self) -> int:
        total = 1
        for size in self._sizes.values():
            total *= size
        return total

    @property
    def data_parallel_size(self) -> int:
        return self.dp_replicate_size * self.dp_shard_size

    @property
    def non_data_parallel_size(self) -> int:
        return self.tp_size * self.cp_size * self.sp_size

    dp_replicate_enabled = property(lambda self: self.dp_replicate_size > 1)
    dp_shard_enabled = property(lambda self: self.dp_shard_size > 1)
    tp_enabled = property(lambda self: self.tp_size > 1)
    cp_enabled = property(lambda self: self.cp_size > 1)
    sp_enabled = property(lambda self: self.sp_size > 1)

    def _active(self, names: tuple[str, ...]) -> list[str]:
        return [name for name in names if self._sizes[name] > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """The dimensions over which batches differ."""
        return self._active(("dp_replicate", "dp_shard"))

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The dimensions whose processes see the same batch."""
        return self._active(("tp", "cp", "sp"))

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        return self._active(("dp_shard", "cp"))

    @property
    def dp_cp_dim_names(self) -> list[str]:
        return self._active(("dp_replicate", "dp_shard", "cp"))

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The mesh dimensions FSDP2 shards over: replicate across `dp_replicate`, shard within `dp_shard_cp`."""
        return (["dp_replicate"] if self.dp_replicate_enabled else []) + ["dp_shard_cp"]

    @property
    def active_mesh_dims(self) -> list[str]:
        return self.dp_dim_names + self.non_dp_dim_names

    def to_json(self) -> dict[str, Any]:
        """The fields as plain values (a handler as its own fields), for trackers and JSON."""
        return copy.deepcopy({k: dict(vars(v)) if hasattr(v, "__dict__") else v
                              for k, v in vars(self).items() if k != "device_mesh"})

    # ----- the mesh ----------------------------------------------------------------------------
    def build_device_mesh(self, device_type: str) -> Any:
        """The device mesh of the active dimensions (outermost first: dp_replicate, dp_shard, cp,
        sp, tp), with the flattened `dp`, `dp_shard_cp` and `dp_cp` beside them; None when every
        size is 1. A collective: every process builds it."""
        from torch.distributed.device_mesh import init_device_mesh

        names = [name for name in _MESH_ORDER if name in self.active_mesh_dims]
        if not names:
            return None
        mesh = init_device_mesh(device_type, tuple(self._sizes[n] for n in names), mesh_dim_names=tuple(names))
        for flat, dims in (("dp", self.dp_dim_names), ("dp_shard_cp", self.dp_shard_cp_dim_names),
                           ("dp_cp", self.dp_cp_dim_names)):
            if dims:
                _flatten(mesh, dims, flat)
        return mesh

    def get_device_mesh(self, device_type: str | None = None) -> Any:
        if self.device_mesh is None:
            if device_type is None:
                raise ValueError("no device mesh yet: pass the device type (e.g. 'cuda' or 'cpu') to build it")
            self.device_mesh = self.build_device_mesh(device_type)
        elif device_type is not None and self.device_mesh.device_type != device_type:
            raise ValueError(f"the device mesh was built for {self.device_mesh.device_type!r}, not {device_type!r}")
        return self.device_mesh

    def fit_to(self, num_processes: int, strategy: str) -> None:
        """Check the sizes against the job (Accelerate's checks, and what Kiln does not do yet).
        All sizes 1 become data parallelism over every process (DDP), as in Accelerate."""
        for name, what in _NOT_YET.items():
            if self._sizes[name] > 1:
                raise NotImplementedError(f"ParallelismConfig({name}_size={self._sizes[name]}): {what} is not "
                                          "supported by Kiln yet; use dp_replicate_size, dp_shard_size, tp_size "
                                          "and cp_size (DDP, FSDP2, HSDP, tensor and context parallel)")
        if self.total_size == 1:
            self.dp_replicate_size = num_processes
        if self.total_size != num_processes:
            raise ValueError(f"ParallelismConfig's sizes multiply to {self.total_size} (dp_replicate_size="
                             f"{self.dp_replicate_size} x dp_shard_size={self.dp_shard_size} x tp_size={self.tp_size} "
                             f"x cp_size={self.cp_size}), but this job has {num_processes} processes")
        if self.cp_enabled and strategy != "fsdp":
            raise ValueError(f"context parallelism (cp_size={self.cp_size}) trains under FSDP2, which shards over "
                             "dp_shard x cp (as in Accelerate): pass fsdp_plugin=FullyShardedDataParallelPlugin() "
                             f"(or launch with --distributed_type fsdp); this Accelerator's strategy is {strategy}")
        if self.tp_enabled:
            if strategy == "deepspeed":
                raise ValueError("tensor parallelism does not compose with DeepSpeed here: use FSDP2 "
                                 "(fsdp_plugin=) for the data-parallel dimension")
            if self.dp_replicate_enabled and not self.dp_shard_enabled:
                raise ValueError("tp_size > 1 with dp_replicate_size > 1 needs dp_shard_size > 1 (as in Accelerate): "
                                 "replicas of a tensor-parallel model are FSDP2's HSDP")
            if strategy == "fsdp" and not (self.dp_shard_enabled or self.cp_enabled):
                raise ValueError("FSDP2 has nothing to shard over: the processes are all tensor-parallel "
                                 "(dp_shard_size is 1). Drop fsdp_plugin (tensor parallel alone), or set dp_shard_size")
            return
        if self.dp_shard_enabled and strategy != "fsdp":
            raise ValueError(f"dp_shard_size={self.dp_shard_size} shards the model with FSDP2: pass "
                             "fsdp_plugin=FullyShardedDataParallelPlugin() (or launch with --distributed_type "
                             f"fsdp); this Accelerator's strategy is {strategy}")
        if strategy == "fsdp" and not (self.dp_shard_enabled or self.cp_enabled) and num_processes > 1:
            raise ValueError("FSDP2 has no dimension to shard over: dp_shard_size is 1. Set dp_shard_size > 1 "
                             "(with dp_replicate_size for HSDP), or train with DDP (no fsdp_plugin)")
        if strategy == "deepspeed" and self.dp_replicate_size != num_processes:
            raise ValueError("under DeepSpeed a ParallelismConfig can only be plain data parallelism "
                             f"(dp_replicate_size={num_processes}); DeepSpeed's ZeRO stage says how it shards")


def from_environment() -> ParallelismConfig | None:
    """The config `kiln launch` asked for (its parallelism_config_* settings), else None."""
    from kiln.plugins import parse_bool

    raw = os.environ.get(USE_ENV)
    return ParallelismConfig() if raw is not None and parse_bool(raw, USE_ENV) else None


def _flatten(mesh: Any, dims: list[str], name: str) -> None:
    """A named 1-D view over several dimensions. DeviceMesh._flatten is private (torch 2.6 to 2.14
    have it); without it the flattened names are missing, and a single dimension is its own view."""
    sub = mesh[tuple(dims)] if len(dims) > 1 else mesh[dims[0]]
    if hasattr(sub, "_flatten"):
        sub._flatten(name)


def build_parallelism(config: ParallelismConfig | None, num_processes: int, strategy: Any,
                      device_type: str) -> tuple[ParallelismConfig | None, Any, Any]:
    """The Accelerator's config (given, else the launcher's, else None) checked against the job, its
    device mesh, and the strategy: a sharding strategy is handed the mesh it shards over, and a
    tensor-parallel job gets FSDP2's strategy (which handles DTensors) whatever was chosen."""
    config = config if config is not None else from_environment()
    if config is None:
        return None, None, strategy
    if not isinstance(config, ParallelismConfig):
        raise TypeError(f"parallelism_config must be a kiln ParallelismConfig, not {type(config).__name__}")
    config.fit_to(num_processes, strategy.name)
    mesh = config.get_device_mesh(device_type) if num_processes > 1 else None
    if mesh is not None and config.tp_enabled:
        # Tensor-parallel parameters are DTensors: FSDP2's strategy is the one that saves, loads and
        # clips them; with no data-parallel dimension it shards nothing, and it syncs nothing.
        from kiln.parallel.fsdp import FSDPStrategy, FullyShardedDataParallelPlugin

        if not isinstance(strategy, FSDPStrategy):
            strategy = FSDPStrategy(FullyShardedDataParallelPlugin(), strategy_device(strategy, device_type))
        strategy.use_mesh(mesh[tuple(config.fsdp_dim_names)] if config.dp_shard_enabled or config.cp_enabled else None,
                          tp_mesh=mesh["tp"], cp_mesh=mesh["cp"] if config.cp_enabled else None)
    elif mesh is not None and hasattr(strategy, "use_mesh"):
        strategy.use_mesh(mesh[tuple(config.fsdp_dim_names)], cp_mesh=mesh["cp"] if config.cp_enabled else None)
    return config, mesh, strategy


def strategy_device(strategy: Any, device_type: str) -> Any:
    import torch

    return getattr(strategy, "device", None) or torch.device(device_type)


def data_shard(config: ParallelismConfig | None, mesh: Any, num_processes: int, process_index: int) -> tuple[int, int]:
    """(how many data-parallel shards, this process's): every process of one tensor- or
    context-parallel group reads the same batches (context parallel then slices their sequences)."""
    if config is None or mesh is None or not (config.tp_enabled or config.cp_enabled):
        return num_processes, process_index
    if not config.dp_dim_names:
        return 1, 0
    return config.data_parallel_size, mesh["dp"].get_local_rank()
