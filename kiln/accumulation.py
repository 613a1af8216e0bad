"""Gradient accumulation bookkeeping: when gradients are synchronised and the optimizer may step.

Depends on nothing in Kiln. The prepared dataloaders tell it when an epoch ends, so the last,
possibly partial, accumulation window of an epoch still steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GradientAccumulationPlugin:
    """Accelerate's accumulation settings: `Accelerator(gradient_accumulation_plugin=...)`.

    num_steps: micro-batches per optimizer step. sync_with_dataloader: the end of a dataloader
    ends the window too (a short last window still steps). sync_each_batch: synchronise gradients
    at every micro-batch instead of skipping it with `no_sync` (less memory, more communication;
    the arithmetic is the same). adjust_scheduler: accepted for Accelerate's scripts; it only
    counted scheduler calls there, and Kiln's schedulers step on optimizer steps either way.
    """

    num_steps: int | None = None
    adjust_scheduler: bool = True
    sync_with_dataloader: bool = True
    sync_each_batch: bool = False


class GradientState:
    """Shared by the accelerator, its prepared optimizers, schedulers and dataloaders."""

    def __init__(self, num_steps: int = 1, sync_with_dataloader: bool = True, sync_each_batch: bool = False) -> None:
        self.num_steps = check_steps(num_steps)
        self.sync_with_dataloader = sync_with_dataloader
        self.sync_each_batch = sync_each_batch
        self.sync_gradients = True
        self.end_of_dataloader = False
        self.step = 0  # micro-batches seen in the current accumulation window
        self.active_dataloaders: list = []  # innermost last

    def advance(self) -> None:
        """Called once per micro-batch by `Accelerator.accumulate`."""
        self.step += 1
        at_boundary = self.step % self.num_steps == 0
        if at_boundary or (self.sync_with_dataloader and self.active_dataloaders and self.end_of_dataloader):
            self.sync_gradients = True
            self.step = 0
        else:
            self.sync_gradients = False

    @property
    def active_dataloader(self):
        return self.active_dataloaders[-1] if self.active_dataloaders else None

    def begin_dataloader(self, dataloader) -> None:
        self.active_dataloaders.append(dataloader)
        self.end_of_dataloader = False

    def end_dataloader(self, dataloader) -> None:
        if dataloader in self.active_dataloaders:
            self.active_dataloaders.remove(dataloader)


def check_steps(num_steps: int) -> int:
    if not isinstance(num_steps, int) or isinstance(num_steps, bool) or num_steps < 1:
        raise ValueError(f"gradient_accumulation_steps must be a positive int, got {num_steps!r}")
    return num_steps
