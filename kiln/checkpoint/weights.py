"""Model weights on disk: clean keys, safetensors shards, tied weights, atomic writes.

Depends on torch, safetensors and kiln.checkpoint.integrity only; never imports the facade or the
compile package.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.checkpoint.integrity import CheckpointMismatchError, read

SAFE_WEIGHTS = "model.safetensors"
SAFE_INDEX = "model.safetensors.index.json"
TORCH_WEIGHTS = "pytorch_model.bin"
# torch.compile's OptimizedModule puts "_orig_mod." into every name below it. Kiln compiles in
# place and adds none, but a user may have compiled a submodule themselves.
COMPILE_SEGMENT = "_orig_mod"
_WEIGHT_FILE = re.compile(r"^(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|pytorch_model\.bin)$")


def clean_key(key: str) -> str:
    """A parameter name as the plain model spells it: torch.compile's segment removed at any depth.

    Distributed wrappers ("module.") are removed by unwrapping the model before its state_dict is
    taken, not here, since a user's own submodule may be called "module".
    """
    return ".".join(p for p in key.split(".") if p != COMPILE_SEGMENT)


def clean_state_dict(state_dict: dict[str, Any]) -> dict[str, Any]:
    cleaned: dict[str, Any] = {}
    for key, value in state_dict.items():
        new_key = clean_key(key)
        if new_key in cleaned:
            raise ValueError(f"two parameters map to {new_key!r} after removing wrapper prefixes")
        cleaned[new_key] = value
    return cleaned


def parse_size(size: int | str) -> int:
    """'10GB', '500MB', '2GiB' or a number of bytes."""
    if isinstance(size, int):
        return size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B)\s*", size.upper())
    if not match:
        raise ValueError(f"cannot read size {size!r}; write it like '10GB', '500MB' or a number of bytes")
    number, unit = float(match.group(1)), match.group(2)
    base = 1024 if "I" in unit else 1000
    power = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[0]]
    return int(number * base**power)


def _dedupe_tied(state_dict: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """safetensors refuses shared storage: keep the first name of each tied tensor, remember the rest."""
    kept: dict[str, torch.Tensor] = {}
    tied: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for key, tensor in state_dict.items():
        identity = (tensor.device, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
                    tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        if tensor.numel() and identity in seen:
            tied[key] = seen[identity]
            continue
        seen[identity] = key
        kept[key] = tensor.detach().contiguous().cpu()
    return kept, tied


def _shards(state_dict: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state_dict.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    return shards


def save_state_dict(state_dict: dict[str, torch.Tensor], save_directory: str | os.PathLike,
                    max_shard_size: int | str = "10GB", safe_serialization: bool = True) -> list[Path]:
    """Write weights as `model.safetensors` (or numbered shards and an index), atomically.

    Everything is written into a temporary folder beside the target and moved into place once
    complete; weight files of an earlier save in the same folder are replaced, never mixed in.
    """
    target = Path(save_directory)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"save_model needs a directory, and {target} is a file")
    target.mkdir(parents=True, exist_ok=True)
    tensors = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor)}
    skipped = sorted(set(state_dict) - set(tensors))
    if skipped:
        raise TypeError(f"state_dict entries that are not tensors cannot be saved as weights: {skipped}")
    staging = Path(tempfile.mkdtemp(prefix=".kiln-save-", dir=target))
    try:
        if safe_serialization:
            written = _write_safetensors(tensors, staging, parse_size(max_shard_size))
        else:
            torch.save({k: v.detach().cpu() for k, v in tensors.items()}, staging / TORCH_WEIGHTS)
            written = [TORCH_WEIGHTS]
        for old in target.iterdir():
            if old.is_file() and _WEIGHT_FILE.match(old.name) and old.name not in written:
                old.unlink()
        for name in written:
            os.replace(staging / name, target / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return [target / name for name in written]


def _write_safetensors(tensors: dict[str, torch.Tensor], folder: Path, max_bytes: int) -> list[str]:
    from safetensors.torch import save_file

    kept, tied = _dedupe_tied(tensors)
    metadata = {"format": "pt", "kiln_tied": json.dumps(tied)}
    shards = _shards(kept, max_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / SAFE_WEIGHTS), metadata=metadata)
        return [SAFE_WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(folder / name), metadata=metadata)
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in kept.values())
    index = {"metadata": {"total_size": total, "kiln_tied": tied}, "weight_map": weight_map}
    (folder / SAFE_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True))
    return names + [SAFE_INDEX]


def load_state_dict(save_directory: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Read what `save_state_dict` wrote (single file, shards or torch pickle), tied names restored.
    A file that cannot be read is a CheckpointCorruptError naming it."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    def tied_names(path: Path) -> dict[str, str]:
        with safe_open(str(path), framework="pt") as handle:
            return json.loads((handle.metadata() or {}).get("kiln_tied", "{}"))

    folder = Path(save_directory)
    if (folder / SAFE_INDEX).is_file():
        index = read(folder / SAFE_INDEX, lambda path: json.loads(path.read_text()))
        state: dict[str, torch.Tensor] = {}
        for name in sorted(set(index["weight_map"].values())):
            path = folder / name
            if not path.is_file():
                raise FileNotFoundError(f"shard {path} named in {folder / SAFE_INDEX} is missing")
            state.update(read(path, lambda p: load_file(str(p))))
        tied = index["metadata"].get("kiln_tied", {})
    elif (folder / SAFE_WEIGHTS).is_file():
        state = read(folder / SAFE_WEIGHTS, lambda p: load_file(str(p)))
        tied = read(folder / SAFE_WEIGHTS, tied_names)
    elif (folder / TORCH_WEIGHTS).is_file():
        return read(folder / TORCH_WEIGHTS, lambda p: torch.load(p, map_location="cpu", weights_only=True))
    else:
        raise FileNotFoundError(f"no weights in {folder}: expected {SAFE_WEIGHTS}, {SAFE_INDEX} or {TORCH_WEIGHTS}")
    for alias, source in tied.items():
        state[alias] = state[source]
    return state


def load_model(model: nn.Module, save_directory: str | os.PathLike, strict: bool = True) -> nn.Module:
    """Load weights written by `Accelerator.save_model` into a plain model; a damaged weights file
    is a `CheckpointCorruptError` that names it. A model built under `init_empty_weights` is filled
    in place (`fill_empty_tensors`).

    >>> load_model(MyModel(), "out/")
    """
    state = load_state_dict(save_directory)
    fill_empty_tensors(model, state)
    model.load_state_dict(state, strict=strict)
    return model


def fill_empty_tensors(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Give each parameter and buffer of `model` still on the meta device (`init_empty_weights`)
    its value from `state`, cast to its dtype, in place: `torch.utils.swap_tensors` keeps each
    object, so tied weights and an optimizer built on them stay valid. `state` then holds those
    tensors themselves, so the `load_state_dict` that follows copies nothing for them. A meta
    tensor that `state` has no value for is a CheckpointMismatchError naming it (even with
    strict=False: it would stay empty, and train on garbage)."""
    empty: dict[int, tuple[torch.Tensor, list[str]]] = {}  # by object: tied names share one entry
    for name, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                        model.named_buffers(remove_duplicate=False)):
        if tensor.is_meta:
            empty.setdefault(id(tensor), (tensor, []))[1].append(name)
    missing = [names[0] for _, names in empty.values() if not any(name in state for name in names)]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointMismatchError(
            f"the checkpoint has no values for {len(missing)} tensor(s) of {type(model).__name__} that are on the "
            f"meta device (built under init_empty_weights): {shown}. Load a checkpoint of this model; buffers "
            "that are not saved (non-persistent ones such as rotary inv_freq) need init_empty_weights("
            "include_buffers=False), the default")
    storages: set[int] = set()
    for tensor, names in empty.values():
        value = state[next(name for name in names if name in state)]
        if value.shape != tensor.shape:
            continue  # load_state_dict reports the size mismatch, with the name
        value = value.to(tensor.dtype)
        if value.untyped_storage().data_ptr() in storages:
            value = value.clone()  # tied in the file but not in this model: copy_ would not share either
        storages.add(value.untyped_storage().data_ptr())
        filled = nn.Parameter(value, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) \
            else value.detach()
        filled.__dict__.update(tensor.__dict__)  # swap_tensors swaps attributes too; keep the model's
        torch.utils.swap_tensors(tensor, filled)
        for name in names:
            state[name] = tensor
