"""Collectives over the processes of a run: gather, reduce, pad, broadcast, for nested tensors.

Depends on torch only. On one process each is the identity (or a copy), so scripts need no branch.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch
import torch.distributed as dist


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def apply_to_tensors(value: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """`fn` on every tensor of a nested structure (dicts, lists, tuples, named tuples)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return type(value)({k: apply_to_tensors(v, fn) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(apply_to_tensors(v, fn) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(apply_to_tensors(v, fn) for v in value)
    raise TypeError(f"cannot gather or reduce a {type(value).__name__}; use gather_object for Python objects")


def _gather_tensor(tensor: torch.Tensor, every: int = 1) -> torch.Tensor:
    if tensor.dim() == 0:
        tensor = tensor[None]
    world = dist.get_world_size()
    # Processes may hold different lengths along dim 0 (an uneven last batch): pad, gather, trim.
    length = torch.tensor([tensor.shape[0]], device=tensor.device)
    lengths = [torch.zeros_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = int(max(l.item() for l in lengths))
    padded = pad_tensor(tensor, longest)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded.contiguous())
    return torch.cat([part[: int(n.item())] for rank, (part, n) in enumerate(zip(parts, lengths))
                      if rank % every == 0], dim=0)


def gather(value: Any, every: int = 1) -> Any:
    """Concatenate each tensor along dim 0 across processes, in rank order (scalars become 1-D);
    `every=k` keeps the parts of ranks 0, k, 2k, ... (one of each tensor-parallel group, whose
    processes hold the same data)."""
    if not _distributed():
        return apply_to_tensors(value, lambda t: t[None] if t.dim() == 0 else t)
    return apply_to_tensors(value, lambda t: _gather_tensor(t, every))


def gather_object(obj: Any) -> list[Any]:
    """Every process's Python object, in rank order."""
    if not _distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, from_process: int = 0) -> Any:
    """The object of process `from_process`, on every process."""
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=from_process)
    return box[0]


def reduce(value: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
    """Sum or mean each tensor across processes (a new tensor; the input is left alone)."""
    if reduction not in ("sum", "mean"):
        raise ValueError(f"unknown reduction {reduction!r}; choose 'sum' or 'mean'")

    def one(tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        if _distributed():
            dist.all_reduce(out, op=dist.ReduceOp.SUM)
            if reduction == "mean":
                out = out / dist.get_world_size()
        return out * scale if scale != 1.0 else out

    return apply_to_tensors(value, one)


def pad_tensor(tensor: torch.Tensor, length: int, dim: int = 0, pad_index: Any = 0,
               pad_first: bool = False) -> torch.Tensor:
    if tensor.shape[dim] >= length:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = length - tensor.shape[dim]
    filler = torch.full(shape, pad_index, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([filler, tensor] if pad_first else [tensor, filler], dim=dim)


def pad_across_processes(value: Any, dim: int = 0, pad_index: Any = 0, pad_first: bool = False) -> Any:
    """Pad each tensor along `dim` to the longest length any process holds, so it can be gathered."""

    def one(tensor: torch.Tensor) -> torch.Tensor:
        if not _distributed() or dim >= tensor.dim():
            return tensor
        size = torch.tensor([tensor.shape[dim]], device=tensor.device)
        sizes = [torch.zeros_like(size) for _ in range(dist.get_world_size())]
        dist.all_gather(sizes, size)
        return pad_tensor(tensor, int(max(s.item() for s in sizes)), dim, pad_index, pad_first)

    return apply_to_tensors(value, one)


def holds_tensors(value: Any) -> bool:
    """True when `value` is tensors in dicts, lists and tuples only (what `gather` takes)."""
    try:
        apply_to_tensors(value, lambda t: t)
        return True
    except TypeError:
        return False


def split_between(inputs: Any, parts: int, index: int, apply_padding: bool = False) -> Any:
    """Part `index` of `parts` contiguous parts of a list, tuple, tensor (dim 0) or dict of those.

    The first `len % parts` parts are one longer; with `apply_padding` the shorter ones repeat the
    last element so that every part has the same length (for gathering).
    """
    if isinstance(inputs, Mapping):
        return {k: split_between(v, parts, index, apply_padding) for k, v in inputs.items()}
    length = len(inputs)
    per, extra = divmod(length, parts)
    start = index * per + min(index, extra)
    chunk = inputs[start: start + per + (1 if index < extra else 0)]
    if apply_padding and extra and index >= extra and length:
        last = inputs[-1:]
        chunk = torch.cat([chunk, last]) if isinstance(chunk, torch.Tensor) else chunk + last
    return chunk
