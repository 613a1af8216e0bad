"""Resuming a run that Accelerate saved: reads a folder written by Accelerate 1.x's `save_state`
(whole checkpoints: one process or DDP) into Kiln's prepared objects, in prepare order.

Depends on torch, numpy (for Accelerate's RNG files), safetensors and kiln.checkpoint's integrity,
weights and training_state modules; never on the facade, and never on accelerate itself.

Accelerate's names (accelerate/checkpointing.py; index 0 has no suffix, custom objects always do):
    model.safetensors, model_{i}.safetensors (or pytorch_model.bin, pytorch_model_{i}.bin)
    optimizer.bin, scheduler.bin, sampler.bin, dl_state_dict.bin (and _{i}), scaler.pt,
    random_states_{process}.pkl, custom_checkpoint_{i}.pkl
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kiln.checkpoint.safe_load import load_any_object, load_rng_file, load_state_file
from kiln.checkpoint.integrity import CheckpointCorruptError, check_weights, read, shapes_of
from kiln.checkpoint.training_state import (LoadReport, _rng_for, _set_rng_state, read_optimizer,
                                            whole_checkpoint_loads)
from kiln.checkpoint.weights import clean_key
from kiln.data import KilnResumeWarning
from kiln.parallel.base import Strategy

# name -> (kind, index); index 0 is written without a suffix, as Accelerate does.
_NUMBERED = {"model": r"model(?:_(\d+))?\.safetensors", "torch_model": r"pytorch_model(?:_(\d+))?\.bin",
             "optimizer": r"optimizer(?:_(\d+))?\.bin", "scheduler": r"scheduler(?:_(\d+))?\.bin",
             "sampler": r"sampler(?:_(\d+))?\.bin", "dl_state_dict": r"dl_state_dict(?:_(\d+))?\.bin",
             "custom": r"custom_checkpoint_(\d+)\.pkl", "random_states": r"random_states_(\d+)\.pkl"}
_WEIGHT_INDEXES = {"model.safetensors.index.json": "model", "pytorch_model.bin.index.json": "torch_model"}
SCALER = "scaler.pt"
# Written by Accelerate's FSDP, DeepSpeed and Megatron-LM paths: sharded, in formats Kiln cannot map.
_FSDP = re.compile(r"^(pytorch_model_fsdp(_\d+)?(\.bin)?|optimizer_\d+)$")
_DEEPSPEED = re.compile(r"^(pytorch_model(_\d+)?|latest|zero_to_fp32\.py)$")
_MEGATRON = re.compile(r"^(iter_\d+|latest_checkpointed_iteration\.txt)$")
# A Kiln checkpoint that lost its manifest has these; it must get Kiln's own error, not this reader.
_KILN_ONLY = re.compile(r"^(model_\d+|sharded_model_\d+|dataloader_\d+\.json|custom_\d+\.bin|scaler\.bin)$")


def _kind_of(name: str) -> tuple[str, int] | None:
    for kind, pattern in _NUMBERED.items():
        match = re.fullmatch(pattern, name)
        if match:
            return kind, int(match.group(1) or 0)
    return None


def is_accelerate_folder(folder: Path) -> bool:
    """True when `folder` holds files that Accelerate's save_state writes and nothing only Kiln writes."""
    if not folder.is_dir():
        return False
    names = [p.name for p in folder.iterdir()]
    if any(_KILN_ONLY.match(name) for name in names):
        return False
    return any(_kind_of(name) or name == SCALER or name in _WEIGHT_INDEXES or _FSDP.match(name)
               or _DEEPSPEED.match(name) or _MEGATRON.match(name) for name in names)


def _refuse_sharded(folder: Path, name: str) -> None:
    path = folder / name
    if _FSDP.match(name):
        how = ("its weights are one whole state dict: load them with model.load_state_dict(torch.load(path)) before "
               "prepare" if path.is_file() else
               f"merge its weights into one file with `accelerate merge-weights {path} <out>` and load them with "
               "kiln.load_model(model, <out>) before prepare")
        raise ValueError(f"{path} was written by Accelerate's FSDP plugin, whose sharded model and optimizer state "
                         f"Kiln cannot map onto this run's objects. Resume it with Accelerate's FSDP, or {how}, and "
                         "start a new optimizer")
    if _DEEPSPEED.match(name):
        raise ValueError(f"{path} was written by Accelerate's DeepSpeed integration (ZeRO shards of the model and "
                         "optimizer), which Kiln cannot map onto this run's objects. Resume it with Accelerate's "
                         f"DeepSpeed, or recover the weights with DeepSpeed's zero_to_fp32.py (python "
                         f"{folder / 'zero_to_fp32.py'} {folder} <out>), load them with kiln.load_model(model, <out>) "
                         "before prepare, and start a new optimizer")
    raise ValueError(f"{path} was written by Accelerate's Megatron-LM integration, which Kiln cannot read: resume it "
                     "with Accelerate's Megatron-LM")


def _accelerate_name(kind: str, index: int) -> str:
    stems = {"model": "model{}.safetensors", "torch_model": "pytorch_model{}.bin", "optimizer": "optimizer{}.bin",
             "scheduler": "scheduler{}.bin", "sampler": "sampler{}.bin", "dl_state_dict": "dl_state_dict{}.bin"}
    if kind == "custom":
        return f"custom_checkpoint_{index}.pkl"
    if kind == "random_states":
        return f"random_states_{index}.pkl"
    return stems[kind].format(f"_{index}" if index else "")


def load_accelerate_folder(folder: Path, *, models: list, strategy: Strategy, optimizers: list, schedulers: list,
                           dataloaders: list, custom: list, scaler: Any, process_index: int, num_processes: int,
                           load_hooks: Iterable[Callable] = (), strict: bool = True) -> LoadReport:
    """Restore what Accelerate's `save_state` wrote into Kiln's prepared objects, as load_training_state
    does for Kiln's own folders: every file is read and checked before anything is loaded, and a file
    that cannot be mapped is an error naming it. Each of `load_hooks` runs first as `hook(models,
    folder)`; the models it pops are not loaded, and the weights files number the remaining ones."""
    hooks = list(load_hooks)
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    found: dict[str, dict[int, str]] = {kind: {} for kind in _NUMBERED}
    unknown = []
    for name in names:
        if _FSDP.match(name) or _DEEPSPEED.match(name) or _MEGATRON.match(name):
            _refuse_sharded(folder, name)
        kind = _kind_of(name)
        if kind is not None:
            found[kind[0]][kind[1]] = name
        elif name in _WEIGHT_INDEXES:
            found[_WEIGHT_INDEXES[name]].setdefault(0, name)
        elif name != SCALER and not _is_indexed_shard(folder, name):
            unknown.append(name)
    if strategy.name == "deepspeed":
        raise ValueError(f"{folder} was written whole by Accelerate, which a DeepSpeed engine cannot read: resume it "
                         "without DeepSpeed, or load its model weights before prepare and start a new optimizer")
    models = list(models)
    for hook in hooks:
        hook(models, str(folder))
    if unknown and not hooks:
        raise ValueError(f"{folder / unknown[0]} is not a file Accelerate's save_state writes, and this run "
                         "registered no load_state pre-hook that could read it (scripts such as diffusers' save "
                         f"models like unet/ from a save hook): register the matching hook with "
                         f"accelerator.register_load_state_pre_hook, or move {unknown[0]} out of the folder")

    weights_files = {**found["torch_model"], **found["model"]}  # safetensors first, as Accelerate reads them
    _check_numbering(folder, "model", weights_files, len(models), "models",
                     "prepare the same models in the same order as the Accelerate script (a model its save hook "
                     "wrote itself needs the matching load hook)")
    _check_numbering(folder, "optimizer", found["optimizer"], len(optimizers), "optimizers",
                     "prepare the same optimizers in the same order as the Accelerate script")
    _check_numbering(folder, "scheduler", found["scheduler"], len(schedulers), "schedulers",
                     "prepare the same schedulers in the same order as the Accelerate script")
    _check_numbering(folder, "custom", found["custom"], len(custom), "registered objects",
                     "register_for_checkpointing the same objects in the same order as the Accelerate script")
    for kind in ("sampler", "dl_state_dict"):
        for index, name in found[kind].items():
            if index >= len(dataloaders):
                raise ValueError(f"{folder / name} is the state of dataloader {index}, and this run prepared "
                                 f"{len(dataloaders)} dataloader(s): prepare the same dataloaders in the same order "
                                 "as the Accelerate script")
    saved_processes = len(found["random_states"])
    if sorted(found["random_states"]) != list(range(saved_processes)) or not saved_processes:
        missing = next(i for i in range(saved_processes + 1) if i not in found["random_states"])
        raise FileNotFoundError(f"Accelerate checkpoint {folder} is incomplete: random_states_{missing}.pkl is "
                                "missing (every process of the saving run writes one)")

    # Read and check everything first; only then change anything.
    report = LoadReport(str(folder), saved_processes, num_processes,
                        rng_restored=list(range(min(saved_processes, num_processes))),
                        rng_derived=list(range(saved_processes, num_processes)),
                        notes=["read as a folder written by Accelerate's save_state"])
    def weights_for(i: int, model: Any) -> dict[str, Any]:
        path = folder / weights_files[i]
        target = strategy.unwrap(model).state_dict()
        weights, renamed = plain_weights(read(path, _read_weights), target)
        if renamed:
            report.notes.append(f"{weights_files[i]}: {renamed}")
        check_weights(path, shapes_of(weights), shapes_of(target), strict)
        return weights

    loads = whole_checkpoint_loads(models, optimizers, strategy, weights_for, strict,
                                   lambda i, opt: read_optimizer(folder / found["optimizer"][i], opt, load_state_file))
    for i, scheduler in enumerate(schedulers):
        loads.append(functools.partial(scheduler.load_state_dict, read(folder / found["scheduler"][i], load_state_file)))
    for i, obj in enumerate(custom):  # arbitrary objects: Accelerate reads these with weights_only=False too
        loads.append(functools.partial(obj.load_state_dict, read(folder / found["custom"][i], load_any_object)))
    if scaler is not None:
        if not (folder / SCALER).is_file():
            raise FileNotFoundError(f"Accelerate checkpoint {folder} has no {SCALER}, but this run uses fp16 scaling")
        loads.append(functools.partial(scaler.load_state_dict, read(folder / SCALER, load_state_file)))
    elif (folder / SCALER).is_file():
        report.notes.append(f"{SCALER} not loaded: this run does not scale fp16 losses")
    for i, loader in enumerate(dataloaders):
        position = _dataloader_position(folder, found["sampler"].get(i), found["dl_state_dict"].get(i), loader,
                                        saved_processes, report, i)
        if position is not None:
            loads.append(functools.partial(loader.load_state_dict, position))
    rng = _rng_for(folder, process_index, saved_processes, reader=read_accelerate_rng)

    for load in loads:
        load()
    _set_rng_state(rng)
    report.data += [f"{i}: {loader.resume_note}" for i, loader in enumerate(dataloaders)
                    if getattr(loader, "resume_note", None)]
    return report


def _is_indexed_shard(folder: Path, name: str) -> bool:
    """A weights shard named by an index file (model-00001-of-00002.safetensors), which save_model writes."""
    for index in _WEIGHT_INDEXES:
        if (folder / index).is_file():
            weight_map = read(folder / index, lambda path: json.loads(path.read_text())).get("weight_map", {})
            if name in weight_map.values():
                return True
    return False


def _check_numbering(folder: Path, kind: str, files: dict[int, str], prepared: int, what: str, fix: str) -> None:
    for index, name in sorted(files.items()):
        if index >= prepared:
            raise ValueError(f"{folder / name} has no counterpart in this run: the Accelerate checkpoint holds "
                             f"{len(files)} {what}, this run prepared {prepared}; {fix}")
    for index in range(prepared):
        if index not in files:
            expected = " or ".join(_accelerate_name(k, index) for k in
                                   (("model", "torch_model") if kind == "model" else (kind,)))
            raise FileNotFoundError(f"Accelerate checkpoint {folder} has no {expected}, and this run prepared "
                                    f"{prepared} {what}; {fix}")


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if path.name in _WEIGHT_INDEXES:
        index = json.loads(path.read_text())
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(set(index["weight_map"].values())):
            if not (path.parent / shard).is_file():
                raise FileNotFoundError(f"shard {path.parent / shard} named in {path} is missing")
            state.update(read(path.parent / shard, _read_weights))
        return state
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def plain_weights(saved: dict[str, torch.Tensor],
                  target: dict[str, Any]) -> tuple[dict[str, torch.Tensor], str]:
    """`saved` under the names of `target` (the model's state dict): torch.compile's `_orig_mod.` and a
    leading `module.` (Accelerate saves DDP models wrapped) removed when the model's own names have
    none, and tied weights that safetensors stored once filled back in. Also says what was renamed."""
    renamed = []
    if not any("_orig_mod" in key.split(".") for key in target) and \
            any("_orig_mod" in key.split(".") for key in saved):
        saved = {clean_key(key): value for key, value in saved.items()}
        renamed.append("removed torch.compile's '_orig_mod.' from the names")
    if saved and all(key.startswith("module.") for key in saved) and not any(k.startswith("module.") for k in target):
        saved = {key[len("module."):]: value for key, value in saved.items()}
        renamed.append("removed the DDP wrapper's 'module.' from the names")
    for name, alias in _tied_names(target).items():
        if name not in saved and alias in saved:
            saved[name] = saved[alias]
    return saved, "; ".join(renamed)


def _tied_names(state_dict: dict[str, Any]) -> dict[str, str]:
    """Each name whose tensor shares its storage with an earlier name's, mapped to that name."""
    first: dict[tuple, str] = {}
    tied = {}
    for name, tensor in state_dict.items():
        if not isinstance(tensor, torch.Tensor) or not tensor.numel():
            continue
        identity = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape),
                    tuple(tensor.stride()))
        if identity in first:
            tied[name] = first[identity]
        else:
            first[identity] = name
    return tied


def read_accelerate_rng(path: Path) -> dict[str, Any]:
    """An Accelerate `random_states_{process}.pkl` (a torch.save of python, numpy, torch and accelerator
    RNG states) as the states Kiln restores, read with weights-only reading (safe_load.py)."""
    saved = read(path, load_rng_file)
    state = {"python": saved["random_state"], "torch": saved["torch_manual_seed"]}
    if "numpy_random_seed" in saved:
        state["numpy"] = saved["numpy_random_seed"]
    if "torch_cuda_manual_seed" in saved:
        state["cuda"] = saved["torch_cuda_manual_seed"]
    return state


def _dataloader_position(folder: Path, sampler_file: str | None, state_file: str | None, loader: Any,
                         saved_processes: int, report: LoadReport, index: int) -> dict[str, Any] | None:
    """Kiln's position for a prepared loader from Accelerate's seedable sampler (its seed and epoch) and
    stateful-dataloader state (the batches handed out in the current pass, `_num_yielded`), or None
    when Accelerate saved neither: then, as in Accelerate, the position is the script's to restore
    (skip_first_batches). Assumes Accelerate's default split_batches=False for the batch count."""
    if sampler_file is None and state_file is None:
        return None
    batch = getattr(loader, "batch_size", None)
    position: dict[str, Any] = {"epoch": loader.epoch, "batches_yielded": 0, "seed": None,
                                "global_batch_size": None if batch is None else batch * saved_processes,
                                "num_processes": saved_processes}
    if sampler_file is not None:
        sampler = read(folder / sampler_file, _read_pickled_sampler)
        position["epoch"] = int(getattr(sampler, "epoch", 0))
        position["seed"] = getattr(sampler, "initial_seed", None)
        if position["seed"] is not None and loader._sampler_seed_holder() is None:
            report.data.append(f"{index}: {sampler_file}'s shuffle seed not used: this run's loader shuffles with "
                               "its own generator (or does not shuffle)")
    if state_file is not None:
        state = read(folder / state_file, load_state_file)
        used = 0 if state.get("_iterator_finished") else int(state.get("_num_yielded") or 0)
        if loader.stateful:
            position["batches_yielded"] = used
        elif used:
            note = (f"{state_file} says {used} batch(es) of the current epoch were used, and this run's dataloader "
                    f"{index} is not stateful: iterate accelerator.skip_first_batches(loader, {used}) for the rest "
                    "of the epoch, or prepare with DataLoaderConfiguration(use_stateful_dataloader=True)")
            report.data.append(f"{index}: {note}")
            warnings.warn(note, KilnResumeWarning, stacklevel=5)
    return position


def _read_pickled_sampler(path: Path) -> Any:
    """sampler.bin is a pickled accelerate SeedableRandomSampler: reading it needs accelerate importable."""
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except ModuleNotFoundError as error:
        raise CheckpointCorruptError(f"{path} is a pickled Accelerate sampler, which needs {error.name} to read: "
                                     "install accelerate for the load, or move the file out of the folder (the "
                                     "epoch then starts from this run's own shuffle seed)") from error
