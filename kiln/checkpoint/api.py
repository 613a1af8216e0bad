"""The checkpoint side of the Accelerator: where a project's files go, save_state/load_state with
their hooks, automatic checkpoint names, and `save`.

Depends on torch, kiln.project, kiln.plugins (its boolean parser), kiln.checkpoint.training_state (Kiln's
folders) and kiln.checkpoint.accelerate_folder (Accelerate's), choosing between the two; `Accelerator` builds on
it and provides the prepared objects (`_models`, `_optimizers`, ...), the strategy, the process facts and the
compile session (`compiler`: its `save_artifacts`/`install_artifacts` carry compiled code in checkpoints) it reads.
"""

from __future__ import annotations

import collections
import functools
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch.utils.hooks import RemovableHandle

from kiln.project import ProjectConfiguration, latest_checkpoint, next_checkpoint, prune_checkpoints
from kiln.data import KilnResumeWarning
from kiln.checkpoint.accelerate_folder import is_accelerate_folder, load_accelerate_folder
from kiln.checkpoint.integrity import COMPILE_ARTIFACTS
from kiln.checkpoint.training_state import MANIFEST, LoadReport, load_training_state, save_training_state
from kiln.plugins import parse_bool

# Whether save_state carries the job's compiled code (default on, with the compile cache): docs/checkpoints.md.
ENV_COMPILE_ARTIFACTS = "KILN_CHECKPOINT_COMPILE_ARTIFACTS"


class CheckpointAPI:
    """Needs `_models`, `_optimizers`, `_schedulers`, `_dataloaders`, `strategy`, `scaler`, `compiler`
    and the process facts; `_init_checkpointing` sets up its own state."""

    def _init_checkpointing(self, project_config: ProjectConfiguration | None,
                            project_dir: str | os.PathLike | None) -> None:
        self.project_configuration = _project_configuration(project_config, project_dir)
        self._custom_objects: list[Any] = []
        # OrderedDicts: RemovableHandle holds a weak reference to its dict, which a plain dict cannot take.
        self._save_state_pre_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
        self._load_state_pre_hooks: collections.OrderedDict[int, Callable] = collections.OrderedDict()
        self._compile_artifacts_said = False  # their size is printed at the first save_state only

    @property
    def project_dir(self) -> str | None:
        return self.project_configuration.project_dir

    @property
    def logging_dir(self) -> str | None:
        return self.project_configuration.logging_dir

    @property
    def save_iteration(self) -> int:
        """The number of the next automatic checkpoint (`checkpoint_<save_iteration>`)."""
        return self.project_configuration.iteration

    def register_for_checkpointing(self, *objects: Any) -> None:
        """Objects with `state_dict`/`load_state_dict` that save_state and load_state carry too."""
        for obj in objects:
            if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
                raise TypeError(f"{type(obj).__name__} cannot be checkpointed: "
                                "it needs state_dict() and load_state_dict()")
        self._custom_objects.extend(objects)

    def register_save_state_pre_hook(self, hook: Callable[[list, list, str], None]) -> RemovableHandle:
        """`hook(models, weights, output_dir)` runs in `save_state` before the weights are written, on
        every process, as in Accelerate: it may save models its own way into `output_dir` and pop
        their state dicts from `weights` so that Kiln does not write them too. Returns a handle
        whose `remove()` unregisters it."""
        handle = RemovableHandle(self._save_state_pre_hooks)
        self._save_state_pre_hooks[handle.id] = hook
        return handle

    def register_load_state_pre_hook(self, hook: Callable[[list, str], None]) -> RemovableHandle:
        """`hook(models, input_dir)` runs in `load_state` before the weights are read: the models it
        pops from `models` (having loaded them itself) are not loaded again."""
        handle = RemovableHandle(self._load_state_pre_hooks)
        self._load_state_pre_hooks[handle.id] = hook
        return handle

    def save_state(self, output_dir: str | os.PathLike | None = None, safe_serialization: bool = True) -> str:
        """Write models, optimizers, schedulers, scaler, RNG states, dataloader positions and
        registered objects; the folder appears only once complete. Returns its path.

        Without `output_dir`, `ProjectConfiguration(automatic_checkpoint_naming=True)` names it
        `<project_dir>/checkpoints/checkpoint_<iteration>`; once it is complete, the oldest automatic
        checkpoints past `total_limit` are removed, and the iteration advances.

        With the compile cache on, the job's compiled code goes in too (`compile_artifacts.kiln`), so
        that `load_state` on a machine with empty caches starts warm; KILN_CHECKPOINT_COMPILE_ARTIFACTS=0
        leaves it out (docs/checkpoints.md)."""
        if not safe_serialization:
            raise NotImplementedError("save_state always writes model weights as safetensors; drop "
                                      "safe_serialization=False")
        carry_compile_artifacts = _compile_artifacts_on()  # a bad value fails here, before any process waits
        automatic = output_dir is None
        target = next_checkpoint(self.project_configuration) if automatic else Path(output_dir)
        saved = save_training_state(
            target, models=self._models, strategy=self.strategy, optimizers=self._optimizers,
            schedulers=self._schedulers, dataloaders=self._dataloaders, custom=self._custom_objects,
            scaler=self.scaler, process_index=self.process_index, num_processes=self.num_processes,
            is_main_process=self.is_main_process, barrier=self.wait_for_everyone,
            save_hooks=[*self._save_state_pre_hooks.values(),
                        functools.partial(self._save_compile_artifacts, carry_compile_artifacts)])
        if automatic:
            if self.is_main_process:
                prune_checkpoints(self.project_configuration)
            self.wait_for_everyone()
        self.project_configuration.iteration += 1  # as Accelerate: every save_state advances it
        return str(saved)

    def load_state(self, input_dir: str | os.PathLike | None = None, strict: bool = True,
                   trust_compile_artifacts: bool = False) -> LoadReport:
        """Restore what save_state wrote into the objects prepared, in the same order. A missing,
        truncated or incomplete checkpoint is an error naming the file, one of another model an
        error naming the first mismatched names and shapes; either way nothing is loaded. Without
        `input_dir`, the latest complete automatic checkpoint (`ProjectConfiguration(
        automatic_checkpoint_naming=True)`), and the next save_state() numbers after it.

        The checkpoint may come from another number of processes (DDP, FSDP2 and one process, in any
        pairing; DeepSpeed on two or more, through its universal checkpoint): the returned report,
        also a KilnResumeWarning then, says which RNG states were restored and which derived, and
        how dataloader positions were mapped. Positions come back only with
        `DataLoaderConfiguration(use_stateful_dataloader=True)`; else use skip_first_batches.
        `strict=False`: model weights may miss names or hold extra ones.

        The checkpoint's compiled code (`compile_artifacts.kiln`) is installed only when its signature was
        made with this job's signing key (KILN_COMPILE_SIGNING_KEY, else the key in the Kiln cache folder);
        `trust_compile_artifacts=True` installs an unsigned or foreign one, for a checkpoint whose author
        you trust to run code on this machine (docs/checkpoints.md#trust).

        A folder written by Accelerate's `save_state` (one process or DDP) loads too, into the objects
        prepared in the same order as the Accelerate script prepared them (docs/checkpoints.md)."""
        if not isinstance(trust_compile_artifacts, bool):
            raise TypeError(f"trust_compile_artifacts must be True or False, got {trust_compile_artifacts!r}")
        if input_dir is None:
            number, input_dir = latest_checkpoint(self.project_configuration)
            self.project_configuration.iteration = number + 1
        # A folder without Kiln's manifest that Accelerate's save_state wrote is read by its own
        # reader, into the same objects, with the same checks; anything else gets Kiln's reader
        # (whose errors name what is missing).
        folder = Path(input_dir)
        is_accelerate = not (folder / MANIFEST).is_file() and is_accelerate_folder(folder)
        load_folder = load_accelerate_folder if is_accelerate else load_training_state
        report = load_folder(
            folder, models=self._models, strategy=self.strategy, optimizers=self._optimizers,
            schedulers=self._schedulers, dataloaders=self._dataloaders, custom=self._custom_objects,
            scaler=self.scaler, process_index=self.process_index, num_processes=self.num_processes,
            load_hooks=list(self._load_state_pre_hooks.values()), strict=strict)
        if report.saved_processes != report.processes and self.is_main_process:
            warnings.warn(f"resuming on another number of processes: {report}", KilnResumeWarning, stacklevel=2)
        if not is_accelerate:  # before the first step: compilation waits for the first call
            self.compiler.install_artifacts(folder / COMPILE_ARTIFACTS, self.device, self.wait_for_everyone,
                                            trust_all=trust_compile_artifacts)
        self.wait_for_everyone()
        return report

    def _save_compile_artifacts(self, carry: bool, models: list, weights: list, folder: str) -> None:
        """A save hook, so the file is inside the staging folder that appears whole (training_state.py).
        The main process writes: one machine's caches hold what the job compiled."""
        if not carry or not self.is_main_process:
            return
        size, files = self.compiler.save_artifacts(Path(folder) / COMPILE_ARTIFACTS)
        if size and not self._compile_artifacts_said:
            self._compile_artifacts_said = True
            print(f"compile artifacts: {size / 1e6:.1f} MB ({files} files) added to the checkpoint, so that a "
                  f"machine with empty caches resumes warm; {ENV_COMPILE_ARTIFACTS}=0 leaves them out")

    def save(self, obj: Any, f: str | os.PathLike, safe_serialization: bool = False) -> None:
        """`torch.save` (or, with `safe_serialization`, safetensors for a dict of tensors) on the main
        process only. No barrier: scripts call it inside `if accelerator.is_main_process:` too."""
        if not self.is_main_process:
            return
        if safe_serialization:
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in obj.items()}, str(f), metadata={"format": "pt"})
        else:
            torch.save(obj, f)


def _compile_artifacts_on() -> bool:
    value = os.environ.get(ENV_COMPILE_ARTIFACTS)
    return True if value is None else parse_bool(value, ENV_COMPILE_ARTIFACTS)


def _project_configuration(config: ProjectConfiguration | None,
                           project_dir: str | os.PathLike | None) -> ProjectConfiguration:
    """The ProjectConfiguration, with `project_dir=` filled in (both given and different is an error)."""
    if config is not None and not isinstance(config, ProjectConfiguration):
        raise TypeError(f"project_config must be a ProjectConfiguration, got {type(config).__name__}")
    config = config or ProjectConfiguration()
    if project_dir is not None:
        if config.project_dir is not None and Path(config.project_dir) != Path(project_dir):
            raise ValueError(f"project_dir={str(project_dir)!r} but project_config.project_dir="
                             f"{config.project_dir!r}; set it in one place")
        config.set_directories(project_dir)
    return config
