"""Prepared dataloaders: batches moved to the device, and the end of an epoch announced in advance.

Depends on torch and kiln.accumulation only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader

from kiln.accumulation import GradientState


def move_to_device(value: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Tensors in `value` (nested dicts, lists, tuples, batch encodings) moved to `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=non_blocking)
    if hasattr(value, "to") and callable(value.to) and type(value).__name__ == "BatchEncoding":
        return value.to(device)
    if isinstance(value, Mapping):
        return type(value)({k: move_to_device(v, device, non_blocking) for k, v in value.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(move_to_device(v, device, non_blocking) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(move_to_device(v, device, non_blocking) for v in value)
    return value


class PreparedDataLoader:
    """Iterates the user's DataLoader, moving each batch to the device.

    It reads one batch ahead so that, while the last batch is being used, `sync_gradients`
    already knows the epoch is ending. Every other attribute is the user's DataLoader's.
    """

    def __init__(self, dataloader: DataLoader, device: torch.device | None,
                 gradient_state: GradientState) -> None:
        self.base_dataloader = dataloader
        self.device = device
        self.gradient_state = gradient_state
        self.end_of_dataloader = False

    def __iter__(self) -> Iterator[Any]:
        self.gradient_state.begin_dataloader()
        self.end_of_dataloader = False
        try:
            iterator = iter(self.base_dataloader)
            try:
                current = next(iterator)
            except StopIteration:
                return
            while True:
                try:
                    upcoming = next(iterator)
                except StopIteration:
                    self.end_of_dataloader = True
                    self.gradient_state.end_of_dataloader = True
                    yield self._place(current)
                    return
                yield self._place(current)
                current = upcoming
        finally:
            self.gradient_state.end_dataloader()

    def _place(self, batch: Any) -> Any:
        return batch if self.device is None else move_to_device(batch, self.device)

    def __len__(self) -> int:
        return len(self.base_dataloader)

    def set_epoch(self, epoch: int) -> None:
        """Forwarded to the sampler, for samplers that shuffle per epoch."""
        for holder in (self.base_dataloader.sampler, getattr(self.base_dataloader, "batch_sampler", None)):
            if hasattr(holder, "set_epoch"):
                holder.set_epoch(epoch)

    def __getattr__(self, name: str) -> Any:
        if name == "base_dataloader":  # not set yet (unpickling): avoid infinite recursion
            raise AttributeError(name)
        return getattr(self.base_dataloader, name)
