"""FSDP2 (`fully_shard`): each unit the plugin chooses (by default each repeated block) is sharded
on its own, then the root; parameters, gradients and optimizer state live in shards, and
checkpoints are written per process with torch.distributed.checkpoint, or whole.

Depends on torch, kiln.checkpoint.sharded, kiln.parallel.base and kiln.parallel.fsdp_plugin only.
The blocks arrive compiled in place; FSDP2's hooks gather each block's parameters around its
compiled forward (DESIGN.md: compile each block, then shard each block, then the root).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from kiln.checkpoint.sharded import load_dcp, load_whole_into_sharded, save_dcp, whole_optimizer_state
from kiln.parallel.base import Strategy, refuse_outer_graph
from kiln.parallel.fsdp_plugin import FullyShardedDataParallelPlugin, ignored_parameters, shard_units
from kiln.parallel.tensor_parallel import apply_tensor_parallel
from kiln.state import DistributedType

def clip_mixed_grad_norm(parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """`clip_grad_norm_` over gradients that live on different meshes (tensor-parallel DTensors,
    FSDP2 shards, plain replicated tensors), which torch's cannot stack: each norm made whole first."""
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in ([parameters] if isinstance(parameters, torch.Tensor) else parameters)
             if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coefficient = float(max_norm) / (float(total) + 1e-6)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
    return total


def _refuse_units_inside_regions(units: list[str], regions: list[str]) -> None:
    """FSDP2's hooks are opaque to Dynamo (torch 2.13: "Attempted to call function marked as
    skipped"), so a unit inside a compiled block would break its graph: a clear error instead."""
    inside = [(unit, region) for unit in units for region in regions if unit.startswith(region + ".")]
    if inside:
        unit, region = inside[0]
        raise ValueError(f"FSDP unit {unit!r} lies inside the compiled block {region!r} ({len(inside)} such unit(s)): "
                         "FSDP2's hooks cannot run inside a compiled graph. Shard whole blocks (auto_wrap_policy=None, "
                         "or transformer_based_wrap naming the block class) or raise min_num_params")


class FSDPStrategy(Strategy):
    name = "fsdp"
    distributed_type = DistributedType.FSDP
    sharded_checkpoints = True

    def __init__(self, plugin: FullyShardedDataParallelPlugin, device: torch.device | None = None) -> None:
        self.plugin = plugin
        self.device = device or torch.device("cpu")
        self.activation_checkpointing = plugin.activation_checkpointing
        self._new_parameter: dict[int, nn.Parameter] = {}  # id(old parameter) -> its sharded successor
        self._regions_compiled = False
        self.mesh: Any = None  # None: every process, one dimension; a 2-D mesh shards within rows, replicates across
        self.tp_mesh: Any = None  # tensor parallel: each block's projections split over this mesh first
        self.shards = True  # False: tensor parallel alone, no data-parallel dimension to shard or sync over
        self.cp_mesh: Any = None  # context parallel: sequences sliced over this mesh inside maybe_context_parallel
        self._names_before: dict[int, str] = {}

    def use_mesh(self, mesh: Any, tp_mesh: Any = None, cp_mesh: Any = None) -> None:
        """Shard over this device mesh (a ParallelismConfig's `fsdp_dim_names`): HSDP when it has two
        dimensions; with `tp_mesh`, split each block over it first (`mesh` None: nothing to shard);
        with `cp_mesh`, sequences are sliced over it (which precompiled regions cannot follow)."""
        self.mesh, self.tp_mesh, self.cp_mesh = mesh, tp_mesh, cp_mesh
        self.shards = mesh is not None or tp_mesh is None
        if not self.shards:
            self.distributed_type = None  # the process state's MULTI_CPU/MULTI_GPU, as Accelerate's TP alone

    def parallelize(self, model: nn.Module, block_paths: list[str]) -> None:
        if self.tp_mesh is None:
            return
        # Parallelizing replaces the parameters: the optimizer is pointed at them by these names.
        self._names_before = {id(p): name for name, p in model.named_parameters()}
        apply_tensor_parallel(model, self.tp_mesh, block_paths)

    def clip_grad_norm_of(self, parameters: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        if self.tp_mesh is None:
            return super().clip_grad_norm_of(parameters, max_norm, norm_type)
        return clip_mixed_grad_norm(parameters, max_norm, norm_type)

    def check_compile(self, dynamo_plugin: Any) -> None:
        self._regions_compiled = bool(dynamo_plugin is not None and dynamo_plugin.enabled and
                                      dynamo_plugin.use_regional_compilation)
        refuse_outer_graph(dynamo_plugin, "FSDP2 (and tensor parallel)")
        if self.cp_mesh is not None and dynamo_plugin is not None and dynamo_plugin.enabled and dynamo_plugin.precompile:
            # A precompiled region is compiled by one process and loaded by the others, but ring
            # attention's compiled code is each process's own: its rank in the cp group decides which
            # chunks it computes and which it skips. Loaded elsewhere, it issues other collectives than
            # its group expects (seen on torch 2.13: gloo "Received data size doesn't match expected
            # size" in the first backward).
            raise ValueError("precompiled regions (precompile=True) do not compose with context parallelism "
                             "(cp_size > 1): ring attention compiles differently on each process of a cp group, "
                             "so one process's code cannot be shared. Leave precompile off, and the regions "
                             "compile as they run")

    @property
    def precompiles_by_default(self) -> bool:
        # Every process runs the same regions on its own shards, except under context parallelism,
        # whose ring attention compiles differently on each process (check_compile).
        return self.cp_mesh is None

    @property
    def saves_shards(self) -> bool:
        return not self.plugin.writes_whole_checkpoints

    def receives_weights_from_main(self) -> bool:
        import torch.distributed as dist

        return self.plugin.cpu_ram_efficient_loading and dist.is_initialized() and dist.get_rank() != 0

    def wrap_model(self, model: nn.Module, block_paths: list[str]) -> nn.Module:
        names = {**self._names_before, **{id(p): name for name, p in model.named_parameters()}}
        if self.shards:  # tensor parallel alone has nothing to shard over
            self._shard(model, block_paths)
        params = dict(model.named_parameters())
        self._new_parameter.update({old: params[name] for old, name in names.items()})
        return model

    def _shard(self, model: nn.Module, block_paths: list[str]) -> None:
        from torch.distributed.fsdp import fully_shard

        options: dict[str, Any] = {"mp_policy": self.plugin.mp_policy(),
                                   "reshard_after_forward": self.plugin.reshard_after_forward,
                                   "offload_policy": self.plugin.offload_policy(), "mesh": self.mesh}
        ignored = ignored_parameters(model, self.plugin.ignored_modules)
        if ignored:
            if "ignored_params" not in inspect.signature(fully_shard).parameters:  # torch < 2.7
                raise ValueError("ignored_modules needs fully_shard's ignored_params (torch 2.7 or later); "
                                 f"this is torch {torch.__version__}")
            options["ignored_params"] = ignored
            if any(p.requires_grad for p in ignored):
                warnings.warn("ignored_modules holds trainable parameters: FSDP2 neither shards them nor averages "
                              "their gradients over the processes, so each process trains its own copy (as in "
                              "Accelerate); freeze them or sync them yourself for the plain loop's numbers",
                              UserWarning, stacklevel=5)
        units = shard_units(model, self.plugin, block_paths)
        if self._regions_compiled:
            _refuse_units_inside_regions(units, block_paths)
        loading = self._weights_to_broadcast(model)
        # Units first, each its own, deepest first, so only one unit's parameters are gathered at a time.
        for path in units:
            fully_shard(model.get_submodule(path), **options)
        fully_shard(model, **options)
        if loading is not None:
            loading(model)

    def _weights_to_broadcast(self, model: nn.Module) -> Any:
        """cpu_ram_efficient_loading: the main process keeps its weights to broadcast once sharded;
        every other process drops its own to the meta device (no memory) and, once sharded,
        allocates its shards and receives the main process's values into them. None otherwise."""
        if not self.plugin.cpu_ram_efficient_loading:
            return None
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        main = dist.get_rank() == 0
        full = model.state_dict() if main else {}
        # Buffers outside the state dict (rotary tables) are sent as well: nothing else carries them.
        transient = [(module, name) for module in model.modules() for name in module._non_persistent_buffers_set
                     if module._buffers.get(name) is not None]
        if not main:
            model.to(torch.device("meta"))

        def receive(sharded: nn.Module) -> None:
            if not main:
                sharded.to_empty(device=self.device)
            set_model_state_dict(sharded, full, options=StateDictOptions(full_state_dict=True,
                                                                        broadcast_from_rank0=True))
            for module, name in transient:
                dist.broadcast(module._buffers[name], src=0)

        return receive

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer.state:
            raise ValueError("this optimizer already has state; with FSDP, prepare the optimizer before "
                             "its first step (its parameters are replaced by sharded ones)")
        for group in optimizer.param_groups:
            group["params"] = [self._new_parameter.get(id(p), p) for p in group["params"]]

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        if not self.shards:  # tensor parallel alone: nothing is synchronised between steps
            yield
            return
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    def whole_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return whole_optimizer_state(model, optimizer)

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Every process takes part in gathering; full tensors, on the CPU, on every process.
        options = StateDictOptions(full_state_dict=True, cpu_offload=False)
        return {k: v.cpu() for k, v in get_model_state_dict(model, options=options).items()}

    def save_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer]) -> str:
        name = f"sharded_model_{index}"
        save_dcp(folder / name, model, optimizers)
        return name

    def load_sharded(self, folder: Path, index: int, model: nn.Module,
                     optimizers: list[torch.optim.Optimizer], strict: bool = True,
                     saved_processes: int | None = None) -> None:
        load_dcp(folder / f"sharded_model_{index}", model, optimizers, strict=strict)  # on any number of processes

    def load_whole(self, model: nn.Module, optimizers: list[torch.optim.Optimizer],
                   model_state: dict[str, torch.Tensor], optimizer_states: list[dict],
                   strict: bool = True) -> None:
        load_whole_into_sharded(model, optimizers, model_state, optimizer_states, strict=strict)
