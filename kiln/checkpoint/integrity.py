"""Is a checkpoint whole, and does it fit what is being loaded: the size of every file it was
written with, and the names and shapes of the weights against the model, checked before anything loads.

Depends on the standard library and torch only; never on the facade or a strategy.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")
SHOWN = 5  # mismatches named in one error
# The compile artifacts a save may add (docs/checkpoints.md): the file checks itself, and its damage is a
# warning and a cold compile at load, never a failed resume, so the manifest's strict checks leave it out.
COMPILE_ARTIFACTS = "compile_artifacts.kiln"


class CheckpointMismatchError(ValueError, RuntimeError):
    """The checkpoint holds weights or optimizer state of another model (names or shapes differ).
    A RuntimeError too, which is what `load_state_dict` raises for the same cause."""


class CheckpointCorruptError(OSError):
    """A file of the checkpoint is missing, has another size than was written, or cannot be read."""


def file_sizes(folder: Path) -> dict[str, int]:
    """Every file under `folder` but the compile artifacts, by its path relative to it (with '/'), and
    its size in bytes."""
    sizes = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = Path(root) / name
            relative = path.relative_to(folder).as_posix()
            if relative != COMPILE_ARTIFACTS:
                sizes[relative] = path.stat().st_size
    return dict(sorted(sizes.items()))


def check_sizes(folder: Path, sizes: Mapping[str, int]) -> None:
    """Every file the save wrote is there with the size it had: a truncated file or a lost shard is named."""
    for name, size in sizes.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointCorruptError(f"checkpoint {folder} is damaged: {name} is missing")
        found = path.stat().st_size
        if found != size:
            raise CheckpointCorruptError(f"checkpoint {folder} is damaged: {name} has {found} bytes, the save "
                                         f"wrote {size} (truncated or overwritten)")


def read(path: Path, reader: Callable[[Path], T]) -> T:
    """`reader(path)`, with any failure turned into an error that names the file and what to do."""
    try:
        return reader(path)
    except (FileNotFoundError, CheckpointCorruptError):
        raise
    except Exception as error:  # torch.load, safetensors and json each fail in their own way
        raise CheckpointCorruptError(f"cannot read {path}: {type(error).__name__}: {error}. The file is damaged "
                                     "or was not written by a finished save: restore it from another copy, "
                                     "or load an earlier checkpoint") from error


def check_weights(folder: Path, saved: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]],
                  strict: bool) -> None:
    """The saved weights' names and shapes against the model's: missing or unexpected names (when
    strict) and any shape difference are one error naming the first few of each."""
    problems = []
    shapes = [f"{k}: checkpoint {list(saved[k])}, model {list(expected[k])}"
              for k in expected if k in saved and tuple(saved[k]) != tuple(expected[k])]
    if shapes:
        problems.append(_listed("shapes differ", shapes))
    if strict:
        missing = [k for k in expected if k not in saved]
        unexpected = [k for k in saved if k not in expected]
        if missing:
            problems.append(_listed("missing from the checkpoint", missing))
        if unexpected:
            problems.append(_listed("in the checkpoint but not in the model", unexpected))
    if problems:
        raise CheckpointMismatchError(f"checkpoint {folder} does not fit this model (nothing was loaded): "
                                      + "; ".join(problems) + (" (strict=False allows missing and unexpected "
                                                               "names, never other shapes)" if strict else ""))


def check_optimizer(path: Path, state: Mapping[str, Any], optimizer: Any) -> None:
    """A saved optimizer state dict has the live optimizer's parameter groups, each of the same size."""
    saved = [len(group["params"]) for group in state.get("param_groups", [])]
    live = [len(group["params"]) for group in optimizer.param_groups]
    if saved != live:
        raise CheckpointMismatchError(f"{path} holds an optimizer with parameter groups of {saved} parameters, "
                                      f"this run's has {live} (nothing was loaded)")


def shapes_of(state_dict: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Names and (global, for sharded tensors) shapes of the tensors in a state dict."""
    return {k: tuple(v.shape) for k, v in state_dict.items() if hasattr(v, "shape")}


def _listed(what: str, names: list[str]) -> str:
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return f"{len(names)} {what}: " + ", ".join(names[:SHOWN]) + more
