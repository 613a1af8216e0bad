"""Model and optimizer state as torch.distributed.checkpoint (DCP) keeps it, which is what sharded
checkpoints are: written per process, read back on any number of processes, into a sharded
(FSDP2) or a whole module; and whole weights and optimizer files loaded into a sharded module.

Depends on torch only; never on the facade or a strategy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn


def save_dcp(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer]) -> None:
    """A collective: every process writes its own shards of `model` and of its `optimizers`."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizers)
    dcp.save({"model": model_state, "optimizers": optimizer_state}, checkpoint_id=str(path))


def saved_weight_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The model's weight names and global shapes in a DCP checkpoint, read from its metadata only."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {key[len("model."):]: tuple(entry.size) for key, entry in metadata.items()
            if key.startswith("model.") and hasattr(entry, "size")}


def load_dcp(path: Path, model: nn.Module, optimizers: list[torch.optim.Optimizer], strict: bool = True) -> None:
    """Read a DCP checkpoint into `model` and its `optimizers`, resharded to however this run lays
    them out: FSDP2 shards on another number of processes, or a whole module on one process or
    under DDP (every process then reads every tensor). A collective when a process group is up."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizers)
    state = {"model": model_state, "optimizers": optimizer_state}
    if not strict:  # DCP refuses a requested name it cannot find; ask only for the names it holds
        held = set(saved_weight_shapes(path))
        state["model"] = {k: v for k, v in model_state.items() if k in held}
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizers"],
                   options=StateDictOptions(strict=strict))


def load_whole_into_sharded(model: nn.Module, optimizers: list[torch.optim.Optimizer],
                            model_state: dict[str, torch.Tensor], optimizer_states: list[dict[str, Any]],
                            strict: bool = True) -> None:
    """Whole weights and `optimizer.state_dict()` files (a checkpoint of one process, or of DDP) into
    a sharded module: every process has the full tensors and keeps its own shards of them."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    options = StateDictOptions(full_state_dict=True, strict=strict)
    set_model_state_dict(model, model_state, options=options)
    for optimizer, native in zip(optimizers, optimizer_states):
        set_optimizer_state_dict(model, optimizer, _by_name(model, optimizer, native), options=options)


def _by_name(model: nn.Module, optimizer: torch.optim.Optimizer, native: dict[str, Any]) -> dict[str, Any]:
    """`optimizer.state_dict()` keys parameters by their position in the parameter groups; DCP's
    functions key them by name. The saved positions are those of the live optimizer's groups,
    since the script builds its optimizer the same way (the group sizes are checked before)."""
    names = {id(p): name for name, p in model.named_parameters()}
    positions: dict[int, str] = {}
    groups = []
    for saved_group, live_group in zip(native["param_groups"], optimizer.param_groups):
        fqns = [names[id(p)] for p in live_group["params"]]
        positions.update(zip(saved_group["params"], fqns))
        groups.append({**saved_group, "params": fqns})
    state = {positions[position]: value for position, value in native["state"].items()}
    return {"state": state, "param_groups": groups}


def whole_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A collective: the sharded `optimizer`'s state gathered whole, keyed as `optimizer.state_dict()`
    keys it on one process of the plain loop (by position in the parameter groups), so a whole
    checkpoint reads the same whoever wrote it. The main process gets it; the others get {}."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    by_name = get_optimizer_state_dict(model, optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not by_name:
        return {}
    names = {id(p): name for name, p in model.named_parameters()}
    position: dict[str, int] = {}
    groups = []
    for saved_group, live_group in zip(by_name["param_groups"], optimizer.param_groups):
        start = len(position)
        fqns = [names[id(p)] for p in live_group["params"]]
        position.update({fqn: start + i for i, fqn in enumerate(fqns)})
        groups.append({**saved_group, "params": [position[fqn] for fqn in fqns]})
    state = {position[fqn]: value for fqn, value in by_name["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": groups}
