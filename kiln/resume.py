"""The whole training state on disk: models, optimizers, schedulers, gradient scaler, RNG states,
dataloader positions and registered objects, written so that a crash never leaves a checkpoint
that loads.

Depends on torch, kiln.checkpoint and kiln.collectives only; never on the facade.

Layout of a checkpoint folder (each process writes its own RNG file; the main process the rest):
    kiln_checkpoint.json      manifest, written last: its presence means the folder is complete
    model_{i}/                weights (safetensors), as save_model writes them, or with a sharding
    sharded_model_{i}/        strategy, that model and its optimizers, one shard per process (DCP)
    optimizer_{i}.bin, scheduler_{i}.bin, scaler.bin, dataloader_{i}.json, custom_{i}.bin
    random_states_{rank}.pkl
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kiln.checkpoint import clean_state_dict, load_state_dict, save_state_dict
from kiln.parallel.base import Strategy

MANIFEST = "kiln_checkpoint.json"
FORMAT_VERSION = 1
STAGING_SUFFIX = ".kiln-staging"  # `.<name>.kiln-staging`: a save in progress, or one that crashed


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _optimizers_of(model: torch.nn.Module, optimizers: list) -> list:
    params = {id(p) for p in model.parameters()}
    return [opt for opt in optimizers if any(id(p) in params for g in opt.param_groups for p in g["params"])]


def save_training_state(output_dir: str | os.PathLike, *, models: list, strategy: Strategy, optimizers: list,
                        schedulers: list, dataloaders: list, custom: list, scaler: Any, process_index: int,
                        num_processes: int, is_main_process: bool, barrier: Any,
                        save_hooks: Iterable[Callable] = ()) -> Path:
    """Write everything into a staging folder, then rename it onto `output_dir` in one step.

    `models` are the prepared models; `optimizers` the prepared optimizers (their `.optimizer`
    is the user's), in prepare order. Each of `save_hooks` is called as in Accelerate,
    `hook(models, weights, folder)`, on every process before the weights are written: it may write
    files of its own into `folder` (they move with the checkpoint) and pop the state dicts it saved
    itself from `weights` (whole checkpoints; `weights` is empty with a sharding strategy)."""
    target = Path(output_dir).resolve()
    staging = target.with_name(f".{target.name}{STAGING_SUFFIX}")
    if is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    with open(staging / f"random_states_{process_index}.pkl", "wb") as handle:
        pickle.dump(_rng_state(), handle)
    files = [f"random_states_{rank}.pkl" for rank in range(num_processes)]
    state_dicts = [] if strategy.sharded_checkpoints else \
        [clean_state_dict(strategy.full_state_dict(model)) for model in models]
    for hook in save_hooks:
        hook(list(models), state_dicts, str(staging))
    if strategy.sharded_checkpoints:
        for i, model in enumerate(models):  # a collective: every process writes its shard
            owned = [opt.optimizer for opt in _optimizers_of(model, optimizers)]
            files.append(strategy.save_sharded(staging, i, model, owned))
    if is_main_process:
        if not strategy.sharded_checkpoints:
            for i, state_dict in enumerate(state_dicts):
                save_state_dict(state_dict, staging / f"model_{i}")
                files.append(f"model_{i}")
            for i, opt in enumerate(optimizers):
                torch.save(opt.state_dict(), staging / f"optimizer_{i}.bin")
                files.append(f"optimizer_{i}.bin")
        for prefix, objects in (("scheduler", schedulers), ("custom", custom)):
            for i, obj in enumerate(objects):
                torch.save(obj.state_dict(), staging / f"{prefix}_{i}.bin")
                files.append(f"{prefix}_{i}.bin")
        if scaler is not None:
            torch.save(scaler.state_dict(), staging / "scaler.bin")
            files.append("scaler.bin")
        for i, loader in enumerate(dataloaders):
            (staging / f"dataloader_{i}.json").write_text(json.dumps(loader.state_dict()))
            files.append(f"dataloader_{i}.json")
    barrier()  # every process's RNG file is on disk before the manifest says so
    if is_main_process:
        manifest = {"format": FORMAT_VERSION, "created": time.time(), "num_processes": num_processes,
                    "files": sorted(files), "torch": torch.__version__, "strategy": strategy.name}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _replace_dir(staging, target)
    barrier()
    return target


def _replace_dir(staging: Path, target: Path) -> None:
    """Swap the finished staging folder into place; an older checkpoint is removed only afterwards."""
    old = target.with_name(f".{target.name}.kiln-old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        os.replace(target, old)
    os.replace(staging, target)
    shutil.rmtree(old, ignore_errors=True)


def read_manifest(input_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a complete checkpoint; a clear error for a missing or incomplete one."""
    folder = Path(input_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint at {folder}")
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{folder} is not a complete Kiln checkpoint: {MANIFEST} is missing "
                                "(the save did not finish, or the folder was written by something else)")
    manifest = json.loads(manifest_path.read_text())
    for name in manifest["files"]:
        if not (folder / name).exists():
            raise FileNotFoundError(f"checkpoint {folder} is incomplete: {name} is missing")
    return manifest


def load_training_state(input_dir: str | os.PathLike, *, models: list, strategy: Strategy, optimizers: list,
                        schedulers: list, dataloaders: list, custom: list, scaler: Any, process_index: int,
                        num_processes: int, load_hooks: Iterable[Callable] = (),
                        strict: bool = True) -> dict[str, Any]:
    """Restore what `save_training_state` wrote into the prepared objects, in the same order.

    Each of `load_hooks` is called first as `hook(models, folder)`; the models it pops from
    `models` (having loaded them itself) are not loaded again. `strict=False` lets whole model
    checkpoints miss keys or hold extra ones (as `load_state_dict(strict=False)`)."""
    folder = Path(input_dir)
    manifest = read_manifest(folder)
    models = list(models)
    for hook in load_hooks:
        hook(models, str(folder))
    if manifest["num_processes"] != num_processes:
        raise ValueError(f"checkpoint {folder} was written by {manifest['num_processes']} processes, "
                         f"this run has {num_processes}; the RNG and data positions would not line up")
    sharded = any(f.startswith("sharded_model_") for f in manifest["files"])
    if sharded != strategy.sharded_checkpoints:
        raise ValueError(f"checkpoint {folder} was written {'per process (sharded)' if sharded else 'whole'}, "
                         f"but this run's {strategy.name} strategy {'shards' if strategy.sharded_checkpoints else 'does not shard'}")
    if sharded and manifest.get("strategy", strategy.name) != strategy.name:
        raise ValueError(f"checkpoint {folder} holds {manifest['strategy']} shards, which the {strategy.name} "
                         "strategy of this run cannot read; load it with the strategy that wrote it")
    counts = {prefix: sum(1 for f in manifest["files"] if f.startswith(prefix + "_"))
              for prefix in ("scheduler", "custom", "dataloader")}
    counts["model"] = sum(1 for f in manifest["files"] if f.startswith(("model_", "sharded_model_")))
    if not sharded:
        counts["optimizer"] = sum(1 for f in manifest["files"] if f.startswith("optimizer_"))
    given = {"model": len(models), "optimizer": len(optimizers), "scheduler": len(schedulers),
             "custom": len(custom), "dataloader": len(dataloaders)}
    for prefix, count in counts.items():  # an optimizer count is checked only for whole checkpoints
        if count != given[prefix]:
            raise ValueError(f"checkpoint {folder} holds {count} {prefix}(s), this run prepared {given[prefix]}")
    for i, model in enumerate(models):
        if sharded:
            strategy.load_sharded(folder, i, model, [opt.optimizer for opt in _optimizers_of(model, optimizers)],
                                  strict=strict)
        else:
            strategy.unwrap(model).load_state_dict(load_state_dict(folder / f"model_{i}"), strict=strict)
    if not sharded:
        for i, opt in enumerate(optimizers):
            opt.load_state_dict(torch.load(folder / f"optimizer_{i}.bin", map_location="cpu", weights_only=False))
    for prefix, objects in (("scheduler", schedulers), ("custom", custom)):
        for i, obj in enumerate(objects):
            obj.load_state_dict(torch.load(folder / f"{prefix}_{i}.bin", map_location="cpu", weights_only=False))
    if scaler is not None:
        if not (folder / "scaler.bin").is_file():
            raise FileNotFoundError(f"checkpoint {folder} has no scaler.bin, but this run uses fp16 scaling")
        scaler.load_state_dict(torch.load(folder / "scaler.bin", weights_only=False))
    for i, loader in enumerate(dataloaders):
        loader.load_state_dict(json.loads((folder / f"dataloader_{i}.json").read_text()))
    with open(folder / f"random_states_{process_index}.pkl", "rb") as handle:
        _set_rng_state(pickle.load(handle))
    return manifest
