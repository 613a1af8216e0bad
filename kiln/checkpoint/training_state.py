"""The whole training state on disk: models, optimizers, schedulers, gradient scaler, RNG states,
dataloader positions and registered objects, written so that a crash never leaves a checkpoint
that loads.

Depends on torch, kiln.checkpoint's weights, integrity, safe_load and sharded modules and the strategy
interface only; never on the facade.

Layout of a checkpoint folder (each process writes its own RNG file; the main process the rest):
    kiln_checkpoint.json      manifest, written last: its presence means the folder is complete
    model_{i}/                weights (safetensors), as save_model writes them, or with a sharding
    sharded_model_{i}/        strategy, that model and its optimizers, one shard per process (DCP)
    optimizer_{i}.bin, scheduler_{i}.bin, scaler.bin, dataloader_{i}.json, custom_{i}.bin
    random_states_{rank}.pkl
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import random
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from kiln.checkpoint.safe_load import load_any_object, load_rng_file, load_state_file
from kiln.checkpoint.integrity import check_optimizer, check_sizes, check_weights, file_sizes, read, shapes_of
from kiln.checkpoint.sharded import saved_weight_shapes
from kiln.checkpoint.weights import clean_state_dict, load_state_dict, save_state_dict
from kiln.data import KilnResumeWarning
from kiln.parallel.base import Strategy

MANIFEST = "kiln_checkpoint.json"
FORMAT_VERSION = 2  # 2: the manifest lists every file's size
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


def _model_of(optimizer: Any, models: list) -> torch.nn.Module | None:
    """The prepared model whose parameters `optimizer` steps (None: none of them)."""
    return next((model for model in models if _optimizers_of(model, [optimizer])), None)


def save_training_state(output_dir: str | os.PathLike, *, models: list, strategy: Strategy, optimizers: list,
                        schedulers: list, dataloaders: list, custom: list, scaler: Any, process_index: int,
                        num_processes: int, is_main_process: bool, barrier: Any,
                        save_hooks: Iterable[Callable] = ()) -> Path:
    """Write everything into a staging folder, then rename it onto `output_dir` in one step.

    `models` are the prepared models; `optimizers` the prepared optimizers (their `.optimizer`
    is the user's), in prepare order. Each of `save_hooks` is called as in Accelerate,
    `hook(models, weights, folder)`, on every process before the weights are written: it may write
    files of its own into `folder` (they move with the checkpoint) and pop the state dicts it saved
    itself from `weights` (whole checkpoints; `weights` is empty when the strategy writes shards)."""
    target = Path(output_dir).resolve()
    staging = target.with_name(f".{target.name}{STAGING_SUFFIX}")
    if is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    barrier()
    files = [f"random_states_{rank}.pkl" for rank in range(num_processes)]
    shards = strategy.saves_shards
    # Whole files: gathered by every process (a collective for sharded models), written by the main one.
    state_dicts = [] if shards else [clean_state_dict(strategy.full_state_dict(model)) for model in models]
    optimizer_states = [] if shards else [strategy.whole_optimizer_state(_model_of(opt, models), opt.optimizer)
                                          for opt in optimizers]
    for hook in save_hooks:
        hook(list(models), state_dicts, str(staging))
    if shards:
        for i, model in enumerate(models):  # a collective: every process writes its shard
            owned = [opt.optimizer for opt in _optimizers_of(model, optimizers)]
            files.append(strategy.save_sharded(staging, i, model, owned))
    if is_main_process:
        if not shards:
            for i, state_dict in enumerate(state_dicts):
                save_state_dict(state_dict, staging / f"model_{i}")
                files.append(f"model_{i}")
            for i, state in enumerate(optimizer_states):
                torch.save(state, staging / f"optimizer_{i}.bin")
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
    # The RNG states last, as the run goes on from here: a save hook may draw random numbers (diffusers'
    # EMAModel.save_pretrained builds a UNet), and a resumed run must draw what the unbroken run draws.
    # torch.save's format, read back with weights-only reading (safe_load.py); the name is the one earlier
    # Kiln versions wrote with pickle.dump, which safe_load still reads.
    torch.save(_rng_state(), staging / f"random_states_{process_index}.pkl")
    barrier()  # every process's RNG file is on disk before the manifest says so
    if is_main_process:
        manifest = {"format": FORMAT_VERSION, "created": time.time(), "num_processes": num_processes,
                    "files": sorted(files), "torch": torch.__version__, "strategy": strategy.name,
                    "sizes": file_sizes(staging),
                    "scheduler_ticks_per_step": [getattr(s, "ticks_per_step", 1) for s in schedulers]}
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
    """The manifest of a complete checkpoint, whose files are all there with the sizes they were
    written with; a clear error naming the folder or the file otherwise."""
    folder = Path(input_dir)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint at {folder}")
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{folder} is not a complete Kiln checkpoint: {MANIFEST} is missing "
                                "(the save did not finish, or the folder was written by something else)")
    manifest = read(manifest_path, lambda path: json.loads(path.read_text()))
    for name in manifest["files"]:
        if not (folder / name).exists():
            raise FileNotFoundError(f"checkpoint {folder} is incomplete: {name} is missing")
    check_sizes(folder, manifest.get("sizes", {}))  # format 1 wrote no sizes
    return manifest


@dataclass
class LoadReport:
    """What `load_state` restored, and what it had to map because the number of processes changed.

    rng_restored: the process indices whose saved RNG states were restored; rng_derived: those
    that had none saved (more processes than the save) and got states derived from process 0's
    and their index; data: how each stateful dataloader's position was mapped, if it was; notes:
    anything else said about the load (for a folder Accelerate wrote, what was renamed or left out)."""

    folder: str
    saved_processes: int
    processes: int
    rng_restored: list[int] = field(default_factory=list)
    rng_derived: list[int] = field(default_factory=list)
    data: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"loaded {self.folder}: saved by {self.saved_processes} process(es), loaded by {self.processes}",
                 *self.notes, f"RNG states restored for process(es) {self.rng_restored or 'none'}"]
        if self.rng_derived:
            lines.append(f"RNG states derived from process 0's for process(es) {self.rng_derived}")
        lines += [f"dataloader {line}" for line in self.data]
        return "\n".join(lines)


def load_training_state(input_dir: str | os.PathLike, *, models: list, strategy: Strategy, optimizers: list,
                        schedulers: list, dataloaders: list, custom: list, scaler: Any, process_index: int,
                        num_processes: int, load_hooks: Iterable[Callable] = (),
                        strict: bool = True) -> LoadReport:
    """Restore what `save_training_state` wrote into the prepared objects, in the same order, also
    on another number of processes than wrote it, and from whole checkpoints into a sharding
    strategy or back (not DeepSpeed's). Every file is read and checked against what it is loaded
    into before anything is loaded: a failure leaves the objects as they were.

    Each of `load_hooks` is called first as `hook(models, folder)`; the models it pops from
    `models` (having loaded them itself) are not loaded again. `strict=False` lets model weights
    miss names or hold extra ones (as `load_state_dict(strict=False)`).

    Kiln's folders only (they carry a manifest); kiln.checkpoint.api chooses between this and
    Accelerate's folder reader."""
    folder = Path(input_dir)
    manifest = read_manifest(folder)
    models = list(models)
    for hook in load_hooks:
        hook(models, str(folder))
    saved_processes = int(manifest["num_processes"])
    sharded = any(f.startswith("sharded_model_") for f in manifest["files"])
    _check_layout(folder, manifest, sharded, strategy)
    _check_counts(folder, manifest, sharded, models, optimizers, schedulers, custom, dataloaders)

    # Read and check everything first; only then change anything.
    loads: list[Callable[[], None]] = []
    if sharded:
        for i, model in enumerate(models):
            if strategy.name != "deepspeed":
                saved = saved_weight_shapes(folder / f"sharded_model_{i}")
                check_weights(folder / f"sharded_model_{i}", saved, shapes_of(strategy.unwrap(model).state_dict()),
                              strict)
            owned = [opt.optimizer for opt in _optimizers_of(model, optimizers)]
            loads.append(functools.partial(strategy.load_sharded, folder, i, model, owned, strict=strict,
                                           saved_processes=saved_processes))
    else:
        def weights_for(i: int, model: Any) -> dict[str, Any]:
            weights = read(folder / f"model_{i}", load_state_dict)
            check_weights(folder / f"model_{i}", shapes_of(weights), shapes_of(strategy.unwrap(model).state_dict()),
                          strict)
            return weights

        loads += whole_checkpoint_loads(models, optimizers, strategy, weights_for, strict,
                                        lambda i, opt: read_optimizer(folder / f"optimizer_{i}.bin", opt,
                                                                      load_state_file))
    # Tensors and plain containers only, but a registered object's state, which may hold anything
    # (docs/checkpoints.md#trust).
    for prefix, objects, reader in (("scheduler", schedulers, load_state_file), ("custom", custom, load_any_object)):
        for i, obj in enumerate(objects):
            loads.append(functools.partial(obj.load_state_dict, read(folder / f"{prefix}_{i}.bin", reader)))
    if scaler is not None:
        if not (folder / "scaler.bin").is_file():
            raise FileNotFoundError(f"checkpoint {folder} has no scaler.bin, but this run uses fp16 scaling")
        loads.append(functools.partial(scaler.load_state_dict, read(folder / "scaler.bin", load_state_file)))
    for i, loader in enumerate(dataloaders):
        position = read(folder / f"dataloader_{i}.json", lambda path: json.loads(path.read_text()))
        loads.append(functools.partial(loader.load_state_dict, position))
    report = LoadReport(str(folder), saved_processes, num_processes,
                        rng_restored=list(range(min(saved_processes, num_processes))),
                        rng_derived=list(range(saved_processes, num_processes)))
    _check_scheduler_pace(manifest, schedulers, process_index)
    rng = _rng_for(folder, process_index, saved_processes)

    for load in loads:
        load()
    _set_rng_state(rng)
    report.data = [f"{i}: {loader.resume_note}" for i, loader in enumerate(dataloaders)
                   if getattr(loader, "resume_note", None)]
    return report


def _check_layout(folder: Path, manifest: dict, sharded: bool, strategy: Strategy) -> None:
    """DeepSpeed reads and writes only its own shards (on another number of processes through its
    universal checkpoint); every other pairing of checkpoint and strategy loads on any number of processes."""
    saved_strategy = manifest.get("strategy")
    deepspeed_shards = sharded and saved_strategy == "deepspeed"
    if deepspeed_shards and strategy.name != "deepspeed":
        raise ValueError(f"checkpoint {folder} holds DeepSpeed shards, which the {strategy.name} strategy of this "
                         "run cannot read (on one process Kiln does not run DeepSpeed); resume it with DeepSpeed on "
                         "two or more processes, or take its weights with DeepSpeed's zero_to_fp32.py and start a "
                         "new optimizer")
    if strategy.name == "deepspeed" and not deepspeed_shards:
        instead = ("resume it with FSDP2 or on one process" if sharded else
                   "resume it without DeepSpeed, or load its weights with kiln.load_model(model, "
                   f"'{folder / 'model_0'}') before prepare and start a new optimizer")
        raise ValueError(f"checkpoint {folder} was written {'as FSDP2 shards' if sharded else 'whole'} by the "
                         f"{saved_strategy} strategy, which a DeepSpeed engine cannot read: {instead}")


def _check_counts(folder: Path, manifest: dict, sharded: bool, models: list, optimizers: list, schedulers: list,
                  custom: list, dataloaders: list) -> None:
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


def _check_scheduler_pace(manifest: dict, schedulers: list, process_index: int) -> None:
    """Prepared schedulers tick once per process per optimizer step (as Accelerate's): on another
    number of processes a schedule resumes at another pace per optimizer step. Said once, not changed."""
    saved = manifest.get("scheduler_ticks_per_step", [])
    for i, (before, scheduler) in enumerate(zip(saved, schedulers)):
        now = getattr(scheduler, "ticks_per_step", 1)
        if before != now and process_index == 0:
            warnings.warn(f"scheduler {i} was stepped {before} time(s) per optimizer step when saved and is stepped "
                          f"{now} time(s) now (once per process): from here its schedule advances {now}/{before} as "
                          "fast per optimizer step. For a pace that does not depend on the number of processes, "
                          "use DataLoaderConfiguration(split_batches=True) (one tick per step)",
                          KilnResumeWarning, stacklevel=4)


def whole_checkpoint_loads(models: list, optimizers: list, strategy: Strategy,
                           weights_for: Callable[[int, Any], dict[str, Any]], strict: bool,
                           optimizer_state_for: Callable[[int, Any], dict[str, Any]]) -> list[Callable[[], None]]:
    """The loads of whole-file model weights and optimizer states into the prepared objects, each
    read and checked now (`weights_for(i, model)`, `optimizer_state_for(i, optimizer)`) and run
    later. A strategy whose checkpoints are sharded takes each model with its own optimizers;
    otherwise the optimizers follow, by their index."""
    loads: list[Callable[[], None]] = []
    for i, model in enumerate(models):
        weights = weights_for(i, model)
        if strategy.sharded_checkpoints:  # whole files into shards
            prepared = _optimizers_of(model, optimizers)
            states = [optimizer_state_for(optimizers.index(opt), opt) for opt in prepared]
            loads.append(functools.partial(strategy.load_whole, model, [opt.optimizer for opt in prepared], weights,
                                           states, strict=strict))
        else:
            loads.append(functools.partial(strategy.load_whole, model, [], weights, [], strict=strict))
    if not strategy.sharded_checkpoints:
        for i, opt in enumerate(optimizers):
            loads.append(functools.partial(opt.load_state_dict, optimizer_state_for(i, opt)))
    return loads


def read_optimizer(path: Path, optimizer: Any, load: Callable[[Path], Any]) -> dict[str, Any]:
    """An optimizer's saved state, read with `load` and checked against the prepared `optimizer`."""
    state = read(path, load)
    check_optimizer(path, state, getattr(optimizer, "optimizer", optimizer))
    return state


def _rng_for(folder: Path, process_index: int, saved_processes: int,
             reader: Callable[[Path], dict[str, Any]] | None = None) -> dict[str, Any]:
    """This process's saved RNG states; for a process index the save did not have, states seeded
    from process 0's and the index, the same in every run resumed from this checkpoint. `reader`
    turns a `random_states_{i}.pkl` into Kiln's states (default: Kiln's own file, safe_load.py)."""
    if reader is None:
        reader = functools.partial(read, reader=load_rng_file)
    if process_index < saved_processes:
        return reader(folder / f"random_states_{process_index}.pkl")
    base = reader(folder / "random_states_0.pkl")
    digest = hashlib.sha256(base["torch"].numpy().tobytes() + process_index.to_bytes(8, "little")).digest()
    return _seeded_rng_state(int.from_bytes(digest[:8], "little"), base)


def _seeded_rng_state(seed: int, like: dict[str, Any]) -> dict[str, Any]:
    """The RNG states `seed` gives, for the same generators `like` holds, without touching the live ones."""
    state: dict[str, Any] = {"python": random.Random(seed).getstate(),
                             "torch": torch.Generator().manual_seed(seed).get_state()}
    if "numpy" in like:
        import numpy

        state["numpy"] = numpy.random.RandomState(seed % 2**32).get_state()
    if "cuda" in like and torch.cuda.is_available():
        state["cuda"] = [torch.Generator(f"cuda:{i}").manual_seed(seed).get_state()
                         for i in range(torch.cuda.device_count())]
    return state
