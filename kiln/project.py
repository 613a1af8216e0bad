"""Where a project's files go: `ProjectConfiguration` (Accelerate's fields), automatic checkpoint
names under `<project_dir>/checkpoints`, the latest complete checkpoint, and pruning to `total_limit`.

Depends on the standard library and kiln.checkpoint.training_state's manifest name only; never on the facade.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from kiln.checkpoint.training_state import MANIFEST, STAGING_SUFFIX

CHECKPOINT_NAME = re.compile(r"^checkpoint_(\d+)$")


@dataclass
class ProjectConfiguration:
    """Folders and checkpoint naming for one project.

    project_dir: the project's folder. logging_dir: where trackers write (default: project_dir).
    automatic_checkpoint_naming: `save_state()` with no folder writes
    `<project_dir>/checkpoints/checkpoint_<iteration>` and `load_state()` with no folder loads the
    latest complete one. total_limit: keep at most this many automatic checkpoints; the oldest are
    removed only once the new one is complete. iteration: the number of the next automatic checkpoint.

    >>> Accelerator(project_config=ProjectConfiguration(project_dir="runs/a", automatic_checkpoint_naming=True,
    ...                                                 total_limit=3))
    """

    project_dir: str | os.PathLike | None = None
    logging_dir: str | os.PathLike | None = None
    automatic_checkpoint_naming: bool = False
    total_limit: int | None = None
    iteration: int = 0
    save_on_each_node: bool = False

    def __post_init__(self) -> None:
        if self.total_limit is not None and (isinstance(self.total_limit, bool) or not isinstance(self.total_limit, int)
                                             or self.total_limit < 1):
            raise ValueError(f"total_limit must be None or an int >= 1, got {self.total_limit!r}")
        if isinstance(self.iteration, bool) or not isinstance(self.iteration, int) or self.iteration < 0:
            raise ValueError(f"iteration must be an int >= 0, got {self.iteration!r}")
        if self.save_on_each_node:
            raise NotImplementedError("save_on_each_node=True is not supported: Kiln's main process writes each "
                                      "checkpoint, into a folder every machine reads (a shared file system)")
        self.set_directories(self.project_dir)

    def set_directories(self, project_dir: str | os.PathLike | None = None) -> None:
        """Set `project_dir`, and `logging_dir` to it where no logging_dir was given (as Accelerate does)."""
        self.project_dir = None if project_dir is None else str(project_dir)
        if self.logging_dir is None:
            self.logging_dir = self.project_dir
        else:
            self.logging_dir = str(self.logging_dir)


def checkpoints_folder(config: ProjectConfiguration) -> Path:
    if not config.automatic_checkpoint_naming:
        raise ValueError("no folder was given, and automatic checkpoint naming is off: pass a folder, or "
                         "Accelerator(project_config=ProjectConfiguration(project_dir=..., "
                         "automatic_checkpoint_naming=True))")
    if config.project_dir is None:
        raise ValueError("automatic_checkpoint_naming needs ProjectConfiguration(project_dir=...), the folder "
                         "that holds checkpoints/")
    return Path(config.project_dir) / "checkpoints"


def next_checkpoint(config: ProjectConfiguration) -> Path:
    """The folder the next automatic `save_state()` writes: checkpoint_<iteration>, which must not exist."""
    target = checkpoints_folder(config) / f"checkpoint_{config.iteration}"
    if target.exists():
        raise ValueError(f"checkpoint {target} already exists (iteration {config.iteration}); set "
                         "accelerator.project_configuration.iteration to the number to continue from")
    return target


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """The automatic checkpoints in `folder` whose save finished, oldest first."""
    found = []
    for path in folder.iterdir() if folder.is_dir() else []:
        match = CHECKPOINT_NAME.match(path.name)
        if match and (path / MANIFEST).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(config: ProjectConfiguration) -> tuple[int, Path]:
    folder = checkpoints_folder(config)
    found = complete_checkpoints(folder)
    if not found:
        raise FileNotFoundError(f"no complete checkpoint in {folder} to load")
    return found[-1]


def prune_checkpoints(config: ProjectConfiguration) -> list[Path]:
    """After a complete save: remove the oldest automatic checkpoints past `total_limit`, and folders
    left by saves that never finished (a crash). Returns what was removed."""
    folder = checkpoints_folder(config)
    removed = [path for path in folder.iterdir() if path.name.endswith(STAGING_SUFFIX)]
    if config.total_limit is not None:
        complete = complete_checkpoints(folder)
        removed += [path for _, path in complete[: max(0, len(complete) - config.total_limit)]]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed
